"""QSAConfig: query-selected sparse attention's options, validated on construction (no torch).

    EngineConfig(qsa=QSAConfig(block=4, top_k=512))

A light indexer keeps, per page of a sequence's KV, one summary of every `block` keys (the mean
of the block's keys, or Quest's elementwise min and max). A query row at position p scores the
blocks before its local window with its own query (summed over the query heads that share a KV
head, as NSA selects per GQA group) and attends to

    the first `sink_blocks` blocks   (attention sinks: dropping them collapses output,
                                      mlx-lm #1443)
  + the `top_k` best-scoring blocks  (ties go to the earlier block)
  + the last `local_blocks` blocks   (the query's own block and the ones just before it: MoBA's
                                      rule that a query always sees its own block)

in position order. A row whose context has no more than `dense_positions` =
(sink_blocks + top_k + local_blocks) * block positions would keep every block, so it takes the
dense path itself and is bitwise dense: that is the QSA boundary.

Every row selects for itself, prefill rows included: a prompt row at position p attends as a
decode row at p would. So a row's output is one function of its own sequence whatever its
chunk, its batch, its verify segment, or whether it is recomputed after a preemption (a dense
prefill, as DSA's and NSA's users run, would make a recomputed generated token's KV differ from
the KV it was decoded with). workbench/sparse_attention.py is the torch path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from .errors import ConfigError, WorkbenchError, refuse_unknown_keys

__all__ = ["QSAConfig", "SUMMARIES", "BLOCKS"]

SUMMARIES = ("mean", "minmax")
# a block divides the page (256 positions, workbench/state/layout.py), so a page holds whole blocks
BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_TOP_K = 16384
MAX_KEPT = 4096  # most sink or local blocks


@dataclass(frozen=True)
class QSAConfig:
    block: int = 4  # positions per indexer block (BLOCKS)
    top_k: int = 512  # blocks each row keeps by score, besides the sink and local ones
    # which attention layers go sparse: "global" (every full-attention layer; sliding-window
    # layers already read a bounded window) or a tuple of full-attention layer indices
    layers: str | tuple[int, ...] = "global"
    sink_blocks: int = 1  # the first blocks of the sequence, always kept
    local_blocks: int = 1  # the row's own block and those just before it, always kept (>= 1)
    summary: str = "mean"  # "mean" (MoBA) or "minmax" (Quest's per-block key bounds)

    def __post_init__(self):
        if self.block not in BLOCKS or isinstance(self.block, bool):
            raise ConfigError(f"qsa block={self.block!r} is not allowed: allowed {', '.join(map(str, BLOCKS))} "
                              f"(a divisor of the 256-position page)")
        _int("top_k", self.top_k, 1, MAX_TOP_K)
        _int("sink_blocks", self.sink_blocks, 0, MAX_KEPT)
        _int("local_blocks", self.local_blocks, 1, MAX_KEPT)
        if self.summary not in SUMMARIES:
            raise ConfigError(f"qsa summary={self.summary!r} is not allowed: allowed {', '.join(SUMMARIES)}")
        layers = self.layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "layers", layers)
        if isinstance(layers, str):
            if layers != "global":
                raise ConfigError(f"qsa layers={layers!r} is not allowed: allowed 'global' or a tuple of "
                                  f"full-attention layer indices")
        elif (not isinstance(layers, tuple) or not layers
              or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
              or len(set(layers)) != len(layers)):
            raise ConfigError(f"qsa layers={layers!r} is not allowed: allowed 'global' or a non-empty tuple of "
                              f"distinct full-attention layer indices")

    @property
    def kept_blocks(self) -> int:
        """Blocks a sparse row attends to: sinks + top_k + local."""
        return self.sink_blocks + self.top_k + self.local_blocks

    @property
    def dense_positions(self) -> int:
        """The boundary: a row at position p < this (context <= this many positions) is dense."""
        return self.kept_blocks * self.block

    def resolve_layers(self, model_config) -> tuple[int, ...]:
        """The layer indices that go sparse for a model (a ModelConfig): refused, naming what is
        allowed, where the model has no full-attention layer or a named layer is not one."""
        full = tuple(i for i in range(model_config.n_layers) if model_config.layer_window(i) == 0)
        if not full:
            raise WorkbenchError("QSA needs full-attention layers and this model has none (every layer has a "
                                 "sliding window): allowed qsa=None for it")
        if self.layers == "global":
            return full
        bad = [i for i in self.layers if i not in full]
        if bad:
            raise WorkbenchError(f"qsa layers={self.layers!r}: layer(s) {bad} are not full-attention layers of this "
                                 f"model: allowed a subset of {list(full)}")
        return tuple(sorted(self.layers))

    @classmethod
    def parse(cls, text: str) -> "QSAConfig":
        """The CLI's form: "on" (the defaults) or NAME=VALUE pairs, comma-separated, e.g.
        "top_k=512,block=4,summary=minmax"; layers as "global" or indices joined by "+" ("5+11")."""
        if text.strip() == "on":
            return cls()
        names = [f.name for f in fields(cls)]
        kw: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            if not eq or name not in names:
                raise ConfigError(f"qsa option {part!r} is not allowed: allowed 'on' or NAME=VALUE with NAME one of "
                                  f"{', '.join(names)}")
            if name in ("summary",) or (name == "layers" and value == "global"):
                kw[name] = value
            else:
                try:
                    kw[name] = tuple(int(v) for v in value.split("+")) if name == "layers" else int(value)
                except ValueError:
                    raise ConfigError(f"qsa {name}={value!r} is not an integer: allowed an integer"
                                      + (" list joined by '+', or 'global'" if name == "layers" else "")) from None
        return cls(**kw)

    def text(self) -> str:
        """A short form for run parameters and tables ("top_k=512,block=4" and what differs)."""
        d = self.to_dict()
        base = QSAConfig().to_dict()
        keep = ["top_k", "block"] + [k for k in d if k not in ("top_k", "block") and d[k] != base[k]]
        return ",".join(f"{k}={'+'.join(map(str, d[k])) if isinstance(d[k], list) else d[k]}" for k in keep)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QSAConfig":
        refuse_unknown_keys(cls, d, "qsa")
        d = dict(d)
        if isinstance(d.get("layers"), list):
            d["layers"] = tuple(d["layers"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if isinstance(d["layers"], tuple):
            d["layers"] = list(d["layers"])
        return d


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"qsa {name}={value!r} is not an integer: allowed {lo}..{hi}")
    if not lo <= value <= hi:
        raise ConfigError(f"qsa {name}={value} is out of range: allowed {lo}..{hi}")
