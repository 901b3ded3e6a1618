"""Token sampling: greedy, temperature, top-k, top-p, each request with its own generator.

A request's generator is seeded by (seed, request index), so a sampled output does not depend
on what else runs beside it. Sampling is per row, on float32 logits that are themselves
batch-invariant, so batched sampling equals solo sampling bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import WorkbenchError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise WorkbenchError(f"temperature={self.temperature!r} is out of range: allowed 0..100 (0 = greedy)")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise WorkbenchError(f"top_k={self.top_k!r} is invalid: allowed an integer >= 1, or None")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise WorkbenchError(f"top_p={self.top_p!r} is out of range: allowed 0 < top_p <= 1")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise WorkbenchError(f"seed={self.seed!r} is invalid: allowed an integer 0..2**63-1, or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """The generator of request `index` under `seed`: a pure function of the pair."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index) % (2**63))
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a float32 logits row [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    if params.top_k is not None and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = sp.cumsum(0) - sp < params.top_p
        keep[0] = True
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[si[keep]] = True
        probs = probs.masked_fill(~mask, 0.0)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
