"""EngineConfig: how the engine serves, validated on construction.

The config holds what the user chose. Values the engine learns at run time (the memory budget
derived from the machine, the chunk size the planner picked) live in runtime objects and are
never written back here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from .errors import WorkbenchError
from .planner import POLICIES

MAX_CONCURRENCY = 64
BACKENDS = ("torch", "triton")
DTYPES = ("bfloat16", "float32")
# backend "triton": the output head's product form (workbench/triton_runner.py's HEAD_MATMUL says
# what each computes; None = the runner's default: int8 MMAs against the head's input quantized
# per 32 values, llama.cpp's numerics, for a bfloat16 engine's Q8_0 head; the dense copy else)
HEAD_MATMULS = ("dense", "q8i8", "q8dense", "q8f16", "mma", "gemv")


class ConfigError(WorkbenchError):
    """A config field holds a value outside what it allows."""


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
    head_matmul: str | None = None  # backend "triton" only: the head's form (HEAD_MATMULS; None: the default)

    def __post_init__(self):
        _int_in_range("max_concurrency", self.max_concurrency, 1, MAX_CONCURRENCY)
        _int_in_range("max_context", self.max_context, 1, None, optional=True)
        _int_in_range("chunk_size", self.chunk_size, 1, None, optional=True)
        _int_in_range("chunk_cap", self.chunk_cap, 1, None)
        _int_in_range("memory_budget_bytes", self.memory_budget_bytes, 1, None, optional=True)
        _int_in_range("max_batch_rows", self.max_batch_rows, 1, None)
        _choice("policy", self.policy, POLICIES)
        _choice("backend", self.backend, BACKENDS)
        if self.dtype is not None:
            _choice("dtype", self.dtype, DTYPES)
        if self.head_matmul is not None:
            _choice("head_matmul", self.head_matmul, HEAD_MATMULS)
            if self.backend != "triton":
                raise ConfigError(f"head_matmul={self.head_matmul!r} is the triton backend's: allowed with "
                                  f"backend='triton' only (backend={self.backend!r})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineConfig":
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown engine config key(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(valid)}"
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
