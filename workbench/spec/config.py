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

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import ConfigError, name_values, refuse_unknown_keys

__all__ = ["PROPOSERS", "SpecConfig", "VERIFIES", "proposer_fields", "spec_config"]

# The proposers (proposers.py; "self" and "draft" are model_proposer.py's: greedy tokens of the
# target's first `draft_layers` layers and its head, or of a draft GGUF at `draft_model`).
PROPOSERS = ("ngram", "suffix", "self", "draft")
VERIFIES = ("exact", "rejection")
# pipeline="auto": the slots it starts at (at 8 slots code editing and essays went as fast with
# it as without on an H100; at 16, 1.8x faster: docs/GPU_NOTES.md, session 32)
AUTO_PIPELINE = 8
MAX_K = 16  # draft tokens per slot per step: the verify rows stay within the chunk graphs' buckets
MAX_TREE = 128  # a token tree's node budget per slot per step (a step's rows stay within the graphs')
MAX_PATHS = 8  # a tree's paths per slot per step: the main draft and up to 7 alternatives


@dataclass(frozen=True)
class SpecConfig:
    proposer: str = "ngram"
    k: int = 4  # the most draft tokens a slot verifies in a step, 1..MAX_K
    # token trees: None (a linear chain), or the node budget N (k+1..MAX_TREE): the draft tokens
    # a slot verifies per step across its tree's paths (the main draft and alternatives, each a
    # root-to-leaf path of at most k, verified on its own fork of the slot's pages, so shared
    # prefixes count once per path; see speculator.py)
    tree: int | None = None
    verify: str = "exact"
    # the yield guard: per slot, a draft length 0..k from its acceptance and the verify rows'
    # cost (guard.py); False: every slot drafts what its proposer offers, up to k; "cohort":
    # seed 002's rule for comparison (guard.py's CohortGuard: fewer than cohort_min_emitted
    # tokens emitted per request on the first verify step turns speculation off for the run)
    guard: bool | str = True
    cohort_min_emitted: int = 6
    # the cost of one verify row beside a slot's share of a decode step, as a fraction of it:
    # the guard's value until it has measured one from the run's own steps (guard.py), or
    # always with measure_cost off (decisions then do not depend on timing: reproducible)
    row_cost: float = 0.1
    measure_cost: bool = True
    # the pipeline (engine.py): from this many decoding slots on, the slots are split in two
    # halves whose verify steps alternate, so the host accepts, commits and drafts one half's
    # step while the device runs the other's (a 16-slot verify step was ~2 ms of host beside a
    # 2.6 ms forward: H100 runs 102-106). Each row's bits are its own whatever shares its
    # forward, so outputs do not change. 0: off. Lookup proposers only (ngram, suffix): a
    # model's drafts would run on the device between the halves. "auto" (the default): from
    # AUTO_PIPELINE slots on where it can run (a lookup proposer's chains) and the runner's
    # launch leaves its forward running (the Triton runner; on the CPU the halves would only
    # run one after the other): H100 session 32, code editing at 16 slots 1.81-1.84x AR with it
    # against 0.87-0.94x without (docs/GPU_NOTES.md).
    pipeline: int | str = "auto"
    # n-gram (prompt lookup): the longest and the shortest suffix of the context matched
    ngram_max: int = 4
    ngram_min: int = 2
    # suffix: the longest context suffix looked up in the tree of earlier requests' outputs
    suffix_depth: int = 8
    # self: the target's first draft_layers layers (1..its layers - 1, checked when the engine
    # is built) then its output norm and head, sharing the target's weights
    draft_layers: int | None = None
    # draft: the path of a GGUF with the target's tokenizer (checked when the engine is built)
    draft_model: str | None = None
    # self and draft: the draft's own KV pool, in positions (all requests together); a request
    # whose draft KV does not fit gets no draft that step and decodes plainly
    draft_kv_tokens: int = 65536

    def __post_init__(self):
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"speculation proposer={self.proposer!r} is not allowed: allowed {', '.join(PROPOSERS)}")
        _int("k", self.k, 1, MAX_K)
        if self.tree is not None:
            if isinstance(self.tree, bool) or not isinstance(self.tree, int) or not self.k < self.tree <= MAX_TREE:
                raise ConfigError(f"speculation tree={self.tree!r} is out of range: allowed None (a linear chain) "
                                  f"or a node budget {self.k + 1}..{MAX_TREE} (more than k={self.k})")
            if self.verify != "exact":
                raise ConfigError(f"speculation tree={self.tree} with verify={self.verify!r} is not allowed: "
                                  f"allowed verify='exact' (rejection sampling verifies one chain)")
        if self.verify not in VERIFIES:
            raise ConfigError(f"speculation verify={self.verify!r} is not allowed: allowed {', '.join(VERIFIES)}")
        if not (isinstance(self.guard, bool) or self.guard == "cohort"):
            raise ConfigError(f"speculation guard={self.guard!r} is not allowed: allowed True, False or 'cohort'")
        _int("cohort_min_emitted", self.cohort_min_emitted, 1, MAX_K + 1)
        if not isinstance(self.measure_cost, bool):
            raise ConfigError(f"speculation measure_cost={self.measure_cost!r} is not allowed: allowed True or False")
        if isinstance(self.row_cost, bool) or not isinstance(self.row_cost, (int, float)) or not 0 <= self.row_cost <= 1:
            raise ConfigError(f"speculation row_cost={self.row_cost!r} is out of range: allowed 0..1")
        n = self.pipeline
        if n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or not (n == 0 or 2 <= n <= 1 << 16)):
            raise ConfigError(f"speculation pipeline={n!r} is out of range: allowed 'auto', 0 (off) or the "
                              f"slots it starts at, an integer 2..{1 << 16}")
        if n != "auto" and n:
            if self.proposer not in ("ngram", "suffix"):
                raise ConfigError(f"speculation pipeline={self.pipeline} with proposer={self.proposer!r} is not "
                                  f"allowed: allowed with ngram or suffix (a model's drafts run on the device "
                                  f"between the halves), or pipeline=0")
            if self.tree is not None:
                raise ConfigError(f"speculation pipeline={self.pipeline} with tree={self.tree} is not allowed: "
                                  f"allowed tree=None (a chain), or pipeline=0")
        _int("ngram_max", self.ngram_max, 1, 64)
        _int("ngram_min", self.ngram_min, 1, self.ngram_max)
        _int("suffix_depth", self.suffix_depth, 1, 64)
        if self.proposer == "self":
            if self.draft_layers is None:
                raise ConfigError("speculation proposer='self' needs draft_layers: allowed an integer 1..the "
                                  "model's layers - 1 (e.g. SpecConfig(proposer='self', draft_layers=4))")
            _int("draft_layers", self.draft_layers, 1, 1 << 16)
        elif self.draft_layers is not None:
            raise ConfigError(f"speculation draft_layers={self.draft_layers!r} is not allowed with "
                              f"proposer={self.proposer!r}: allowed with proposer='self' only")
        if self.proposer == "draft":
            if not isinstance(self.draft_model, str) or not self.draft_model:
                raise ConfigError(f"speculation proposer='draft' needs draft_model: allowed the path of a GGUF "
                                  f"file, got {self.draft_model!r}")
        elif self.draft_model is not None:
            raise ConfigError(f"speculation draft_model={self.draft_model!r} is not allowed with "
                              f"proposer={self.proposer!r}: allowed with proposer='draft' only")
        _int("draft_kv_tokens", self.draft_kv_tokens, 1, 1 << 24)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpecConfig":
        refuse_unknown_keys(cls, d, "speculation")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def pipeline_slots(self, asynchronous: bool) -> int:
        """The decoding slots the pipeline starts at (0: off) on a runner whose launch leaves its
        forward running (`asynchronous`) or not: `pipeline` as given, or what "auto" makes of it."""
        if self.pipeline != "auto":
            return self.pipeline
        lookup_chains = self.proposer in ("ngram", "suffix") and self.tree is None
        return AUTO_PIPELINE if asynchronous and lookup_chains else 0

    def overridden(self, text: str) -> "SpecConfig":
        """This config with ``"name=value,..."`` fields changed (a script's --spec-variant, a shell
        word): true/false as booleans, none as None, integers and decimals as numbers, the rest
        as text; unknown names and each value refused as `from_dict` and the constructor refuse
        them. (Written here, not argparse: any of the fields in one word.)"""
        out = {name: _parse_value(raw) for name, raw in name_values(text, "speculation override", "pipeline=0,k=8")}
        return SpecConfig.from_dict({**self.to_dict(), **out})


def proposer_fields(text: str) -> dict[str, Any]:
    """A proposer named in one word, as SpecConfig fields: ngram, suffix, self:K (the model's
    first K layers) or draft:PATH (a draft GGUF). What `bench --spec` and the draft-yield
    ablation's `proposers` take."""
    name, _, arg = str(text).partition(":")
    if name in ("ngram", "suffix") and not arg:
        return {"proposer": name}
    if name == "self" and arg.isdigit():
        return {"proposer": "self", "draft_layers": int(arg)}
    if name == "draft" and arg:
        return {"proposer": "draft", "draft_model": arg}
    raise ConfigError(f"proposer {text!r} is not allowed: allowed ngram, suffix, self:K (the model's first K "
                      f"layers, e.g. self:4) or draft:PATH (a GGUF with the model's tokenizer)")


def spec_config(text: str, **overrides: Any) -> SpecConfig:
    """A script's one-word speculation, ``PROPOSER:K`` (the proposer as `proposer_fields` names
    it: "ngram:8", "self:4:2"), with other fields given as keywords."""
    name, _, k = str(text).rpartition(":")
    if not name or not k.isdigit():
        raise ConfigError(f"speculation {text!r} is not PROPOSER:K: e.g. 'ngram:8' or 'self:4:2'")
    return SpecConfig(**proposer_fields(name), k=int(k), **overrides)


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"speculation {name}={value!r} is out of range: allowed an integer {lo}..{hi}")


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
