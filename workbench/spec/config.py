"""SpecConfig: speculative decoding's options, validated on construction (no torch).

    EngineConfig(speculation=SpecConfig(proposer="ngram", k=4))

`k` is the most draft tokens a slot verifies in one step; with `guard` on, each step picks a
draft length 0..k per slot from that slot's measured acceptance (guard.py). The proposers are
proposers.py's; `verify` says how a drafted token is accepted (verify.py):

* "exact" (the default): a token is accepted when it equals the target's own pick at that
  position (greedy: the argmax; seeded sampling: the sample drawn from the target's logits with
  the generator of (seed, request index, position), sampling.py). Output is then bitwise the
  output with speculation off, tokens and logits, whatever the proposer proposes.
* "rejection": standard rejection sampling (Leviathan et al. 2023), keeps the target
  distribution, not the bits; for a deterministic proposer the draft distribution is a point
  mass, so a token d is accepted with probability p(d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["PROPOSERS", "SpecConfig", "VERIFIES"]

# The proposers built so far (proposers.py). The self-draft (the target's first layers)
# and draft-GGUF proposers come in a later slice; naming one here is refused with this list.
PROPOSERS = ("ngram", "suffix")
VERIFIES = ("exact", "rejection")
MAX_K = 16  # draft tokens per slot per step: the verify rows stay within the chunk graphs' buckets


@dataclass(frozen=True)
class SpecConfig:
    proposer: str = "ngram"
    k: int = 4  # the most draft tokens a slot verifies in a step, 1..MAX_K
    # token trees (a node budget per step) are a later slice: only linear chains now (None)
    tree: int | None = None
    verify: str = "exact"
    # the yield guard: per slot, a draft length 0..k from its acceptance and the verify rows'
    # cost (guard.py); off: every slot drafts what its proposer offers, up to k
    guard: bool = True
    # the cost of one verify row beside a slot's share of a decode step, as a fraction of it:
    # the guard's value until it has measured one from the run's own steps (guard.py), or
    # always with measure_cost off (decisions then do not depend on timing: reproducible)
    row_cost: float = 0.1
    measure_cost: bool = True
    # n-gram (prompt lookup): the longest and the shortest suffix of the context matched
    ngram_max: int = 4
    ngram_min: int = 2
    # suffix: the longest context suffix looked up in the tree of earlier requests' outputs
    suffix_depth: int = 8

    def __post_init__(self):
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"speculation proposer={self.proposer!r} is not allowed: allowed {', '.join(PROPOSERS)}")
        _int("k", self.k, 1, MAX_K)
        if self.tree is not None:
            raise ConfigError(f"speculation tree={self.tree!r} is not allowed: allowed None (linear chains; "
                              f"token trees are not built yet)")
        if self.verify not in VERIFIES:
            raise ConfigError(f"speculation verify={self.verify!r} is not allowed: allowed {', '.join(VERIFIES)}")
        if not isinstance(self.guard, bool):
            raise ConfigError(f"speculation guard={self.guard!r} is not allowed: allowed True or False")
        if not isinstance(self.measure_cost, bool):
            raise ConfigError(f"speculation measure_cost={self.measure_cost!r} is not allowed: allowed True or False")
        if isinstance(self.row_cost, bool) or not isinstance(self.row_cost, (int, float)) or not 0 <= self.row_cost <= 1:
            raise ConfigError(f"speculation row_cost={self.row_cost!r} is out of range: allowed 0..1")
        _int("ngram_max", self.ngram_max, 1, 64)
        _int("ngram_min", self.ngram_min, 1, self.ngram_max)
        _int("suffix_depth", self.suffix_depth, 1, 64)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpecConfig":
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ConfigError(f"unknown speculation key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"speculation {name}={value!r} is out of range: allowed an integer {lo}..{hi}")
