"""Verification: which draft tokens a slot keeps, as pure functions.

A slot that drafted d_1..d_k feeds (t, d_1, .., d_k) at positions p..p+k in one segment whose
rows are all scored; row i's logits are the target's at position p+i, bitwise what a plain
decode step there gives (every op is row-invariant: a verify segment is a prefill chunk that
is scored at every row). So with `pick(i)` the target's own token at row i:

* `accept_exact`: the emitted tokens are pick(0), pick(1), ... while each equals the draft
  token it follows; the first that differs is emitted too and ends the burst (the bonus token).
  Every emitted token is then the target's own, so the output is bitwise speculation-off's.
  Rows are picked lazily: a sampled row past the first mismatch is never drawn.
* `accept_rejection`: rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for a
  deterministic draft (a point mass on d_i): d_i is kept with probability p_i(d_i); at the first
  rejection the token is drawn from p_i with d_i removed; with every draft kept, the bonus is
  drawn from p_k. The output follows the target distribution, not its bits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["accept_exact", "accept_rejection", "num_accepted"]


def num_accepted(draft: Sequence[int], emitted: Sequence[int]) -> int:
    """Draft tokens kept by a burst that emitted `emitted` (all but its last token match)."""
    n = 0
    while n < len(draft) and n < len(emitted) - 1 and emitted[n] == draft[n]:
        n += 1
    return n


def accept_exact(draft: Sequence[int], pick: Callable[[int], int]) -> list[int]:
    """The tokens a burst emits: pick(i) for rows 0.. up to and including the first row whose
    pick is not the draft token that follows it (or row len(draft), the bonus)."""
    out = []
    for i in range(len(draft) + 1):
        out.append(int(pick(i)))
        if i == len(draft) or out[-1] != draft[i]:
            break
    return out


def accept_rejection(draft: Sequence[int], probs: Callable[[int], torch.Tensor],
                     generator: torch.Generator | None) -> list[int]:
    """Rejection sampling of a point-mass draft: `probs(i)` is the target's distribution at row
    i (float32 [vocab], sampling.probabilities), drawn from `generator`."""
    out = []
    for i, d in enumerate(draft):
        p = probs(i)
        u = float(torch.rand((), generator=generator))
        if u < float(p[d]):
            out.append(int(d))
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # (p was a point mass on d and u drew 1.0's edge: keep d)
            out.append(int(d))
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs(len(draft)), 1, generator=generator)))
    return out
