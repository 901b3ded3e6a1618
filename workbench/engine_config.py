"""EngineConfig: how the engine serves, validated on construction.

The config holds what the user chose. Values the engine learns at run time (the memory budget
derived from the machine, the chunk size the planner picked) live in runtime objects and are
never written back here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from .compression import CompressionOptions, check_ratio
from .errors import ConfigError, refuse_unknown_keys
from .planner import POLICIES
from .qsa import QSAConfig
from .runners.triton_options import HEAD_MATMULS, TritonOptions
from .spec.config import SpecConfig

__all__ = ["ConfigError", "EngineConfig", "HEAD_MATMULS", "QSAConfig", "SpecConfig", "TritonOptions"]


MAX_CONCURRENCY = 64
BACKENDS = ("torch", "triton")
DTYPES = ("bfloat16", "float32")
# "lru": the resident sequence paged in longest ago whose quantum has run. (Scoring pages by the
# attention mass they received is issue 20's next slice: it needs partial residency.)
EVICTIONS = ("lru", "scored")
PREEMPTIONS = ("swap", "recompute")


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 4  # slots decoding together, 1..64
    max_context: int | None = None  # context tokens per slot; None = the model's
    chunk_size: int | None = None  # prefill rows per step; None = sized from the memory budget
    chunk_cap: int = 4096  # most prefill rows an auto-sized step takes
    memory_budget_bytes: int | None = None  # None = derived from the machine at run time
    policy: str = "decode-first"  # or "prefill-first"
    backend: str = "torch"  # or "triton"
    dtype: str | None = None  # None: the loaded model's precision; else it must match it
    max_batch_rows: int = 64  # most decode rows in one batched group
    # positions each global KV group's page pool holds; a sliding group's holds what every slot's
    # window spans plus a chunk (None: what the memory budget allows, at most max_concurrency
    # full contexts; workbench/memory.py)
    kv_resident_tokens: int | None = None
    # host backing (KVFlash, workbench/state/host.py): positions of each global KV group's host
    # store (a sliding group's holds what every slot's window spans); None: no host store, a
    # preempted request is recomputed
    kv_host_tokens: int | None = None
    # which pages leave the device first (EVICTIONS). A resident sequence paged out for one
    # waiting to page in is the one paged in longest ago, either way (each step reads all of a
    # live sequence's pages, so no page of one is worth less than another). Cached prefix pages
    # (refcount 0, kept for later hits): "lru", the least recently used first; "scored", the
    # one that received the least attention mass while it was read (every holder's rows, a
    # shared page counted once; both backends measure it in their dense attention layers, a QSA
    # layer's rows add none)
    eviction: str = "lru"
    # a request preempted for pages: "swap" (to the host store while it has room, else
    # recompute) or "recompute" (re-prefill it later)
    preemption: str = "swap"
    # steps a paged-in sequence runs before it may be paged out for a waiting one (the fairness
    # bound: a paged-out request waits about this many steps per turn of the resident set)
    residency_quantum: int = 32
    prefix_cache: bool = True  # paged runners: share full prompt pages across requests
    # paged runners: a request is admitted when its prompt plus this many positions of pages are free
    admission_headroom_tokens: int = 256
    # backend "triton" only: its options (workbench/runners/triton_options.py says what each
    # measured); the default is the measured best
    triton: TritonOptions = TritonOptions()
    # backend "triton" only: shorthand for triton=TritonOptions(head_matmul=...), kept in step
    # with triton.head_matmul (HEAD_MATMULS; None: the default form)
    head_matmul: str | None = None
    # prompt compression before admission (workbench/compression.py): "off", "auto" (prompts of
    # at least compression.auto_min_tokens keep about compression.auto_kept_tokens) or the
    # fraction of each prompt kept, in (0, 1]
    prompt_compression: str | float = "off"
    # its options (scorer, query window, block size, sinks, auto threshold); with compression on only
    compression: CompressionOptions = CompressionOptions()
    # speculative decoding (workbench/spec): None = off; a SpecConfig (proposer, k, verify, guard)
    speculation: SpecConfig | None = None
    # QSA sparse attention (workbench/qsa.py): None = dense; a QSAConfig (block, top_k, layers,
    # sink and local blocks, summary); rows past its boundary attend to their selected blocks
    qsa: QSAConfig | None = None

    def __post_init__(self):
        _int_in_range("max_concurrency", self.max_concurrency, 1, MAX_CONCURRENCY)
        _int_in_range("max_context", self.max_context, 1, None, optional=True)
        _int_in_range("chunk_size", self.chunk_size, 1, None, optional=True)
        _int_in_range("chunk_cap", self.chunk_cap, 1, None)
        _int_in_range("memory_budget_bytes", self.memory_budget_bytes, 1, None, optional=True)
        _int_in_range("max_batch_rows", self.max_batch_rows, 1, None)
        _int_in_range("kv_resident_tokens", self.kv_resident_tokens, 1, None, optional=True)
        _int_in_range("admission_headroom_tokens", self.admission_headroom_tokens, 0, None)
        _int_in_range("kv_host_tokens", self.kv_host_tokens, 1, None, optional=True)
        _choice("eviction", self.eviction, EVICTIONS)
        if self.eviction == "scored" and not self.prefix_cache:
            raise ConfigError("eviction='scored' orders the prefix cache's pages, and prefix_cache is off: allowed "
                              "eviction='lru', or prefix_cache=True")
        _choice("preemption", self.preemption, PREEMPTIONS)
        _int_in_range("residency_quantum", self.residency_quantum, 1, None)
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache={self.prefix_cache!r} is not allowed: allowed True or False")
        _choice("policy", self.policy, POLICIES)
        _choice("backend", self.backend, BACKENDS)
        if self.dtype is not None:
            _choice("dtype", self.dtype, DTYPES)
        if not isinstance(self.triton, TritonOptions):
            raise ConfigError(f"triton={self.triton!r} is not allowed: allowed a TritonOptions "
                              f"(workbench.runners.triton_options)")
        if self.head_matmul is not None:  # (one source of truth: triton.head_matmul; this mirrors it)
            _choice("head_matmul", self.head_matmul, HEAD_MATMULS)
            if self.triton.head_matmul not in (None, self.head_matmul):
                raise ConfigError(f"head_matmul={self.head_matmul!r} but triton.head_matmul="
                                  f"{self.triton.head_matmul!r}: allowed one of them, or both the same")
            object.__setattr__(self, "triton", replace(self.triton, head_matmul=self.head_matmul))
        object.__setattr__(self, "head_matmul", self.triton.head_matmul)
        if self.backend != "triton":
            if self.head_matmul is not None:
                raise ConfigError(f"head_matmul={self.head_matmul!r} is the triton backend's: allowed with "
                                  f"backend='triton' only (backend={self.backend!r})")
            if self.triton != TritonOptions():
                raise ConfigError(f"triton options ({', '.join(self.triton.changed())}) are the triton backend's: "
                                  f"allowed with backend='triton' only (backend={self.backend!r})")
        object.__setattr__(self, "prompt_compression", check_ratio(self.prompt_compression))
        if not isinstance(self.compression, CompressionOptions):
            raise ConfigError(f"compression={self.compression!r} is not allowed: allowed a CompressionOptions "
                              f"(workbench.compression)")
        if self.speculation is not None and not isinstance(self.speculation, SpecConfig):
            raise ConfigError(f"speculation={self.speculation!r} is not allowed: allowed None or a SpecConfig "
                              f"(workbench.spec)")
        if self.qsa is not None and not isinstance(self.qsa, QSAConfig):
            raise ConfigError(f"qsa={self.qsa!r} is not allowed: allowed None or a QSAConfig (workbench.qsa)")
        if self.prompt_compression == "off" and self.compression != CompressionOptions():
            raise ConfigError("compression options are prompt compression's: allowed with prompt_compression "
                              "'auto' or a ratio only (prompt_compression='off')")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineConfig":
        refuse_unknown_keys(cls, d, "engine config")
        d = dict(d)
        if isinstance(d.get("triton"), Mapping):  # (to_dict's form)
            d["triton"] = TritonOptions.from_dict(d["triton"])
        if isinstance(d.get("compression"), Mapping):
            d["compression"] = CompressionOptions.from_dict(d["compression"])
        if isinstance(d.get("speculation"), Mapping):
            d["speculation"] = SpecConfig.from_dict(d["speculation"])
        if isinstance(d.get("qsa"), Mapping):
            d["qsa"] = QSAConfig.from_dict(d["qsa"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["triton"] = self.triton.to_dict()
        d["compression"] = self.compression.to_dict()
        d["speculation"] = None if self.speculation is None else self.speculation.to_dict()
        d["qsa"] = None if self.qsa is None else self.qsa.to_dict()
        return d


def _int_in_range(name: str, value: Any, lo: int, hi: int | None, optional: bool = False):
    allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    if optional:
        allowed += " or None"
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} is not an integer: allowed {allowed}")
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{name}={value} is out of range: allowed {allowed}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]):
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed: allowed {', '.join(allowed)}")
