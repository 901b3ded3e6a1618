"""Token sampling: greedy, temperature, top-k, top-p, each token with its own generator.

A seeded request's token at position t (its t-th generated token) is drawn with the generator
of (seed, request index, t), a counter-based scheme: the token is a function of that triple and
of the target's logits at t alone. So a sampled output does not depend on what else runs beside
it, on preemptions (a recomputed token draws the same sample), nor on how many positions one
forward verifies (speculation, workbench/spec/verify.py: a draft token is accepted when it
equals this sample). Sampling is per row, on float32 logits that are themselves batch-invariant,
so batched sampling equals solo sampling bitwise.
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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def token_generator(seed: int | None, index: int, position: int) -> torch.Generator | None:
    """The generator of request `index`'s token at `position` under `seed`: a pure function of
    the triple (None when unseeded: torch's global generator). The triple is hashed, not
    offset into one stream, so neighbouring positions or requests never share draws."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(_mix64(_mix64(_mix64(seed) ^ index) ^ position) >> 1)
    return g


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax of logits / temperature, cut to
    top-k and top-p and renormalised (float32 [vocab]); not for greedy requests."""
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
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a float32 logits row [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))
