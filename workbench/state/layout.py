"""StateLayout: what a sequence's state is made of, described once for every runner.

A layout owns no memory. It says:

* the page size: how many positions one KV page holds (the same for every group);
* the KV groups: attention layers that share a block table because they keep the same
  positions. `window == 0` is a global group (every position stays); `window > 0` is a
  sliding group, whose query at position q sees keys k with 0 <= q - k < window (the mask of
  `workbench/attention.py` and `kernels/attention.py`), so its old pages can be dropped;
* per-page side payloads: data kept per page of a group and indexed by the same page id as its
  KV (a sparse indexer's block summaries, issue 10);
* per-sequence state specs: fixed-size state a sequence owns outside the pages (a hybrid
  model's recurrent and conv state), kept in `StateSlots`.

Invariants (checked on construction): the page size is a positive multiple of every attention
kernel's key block, group names are unique, no layer is in two groups, windows are >= 0.

Page size. The default is 256 positions: the CPU path's attention walks keys in blocks of
`KV_BLOCK = 256` at absolute positions (`workbench/attention.py`), and the Triton path in
segments of 64 keys (`TritonOptions.attn_segment`, allowed 32..256; blocks of at most 64,
partials of at most `kernels/attention.ATTENTION_SEGMENT = 256`), all at absolute positions. A page that is a
multiple of each of these holds whole key blocks, so gathering a row's keys page by page
visits the same blocks in the same order as today's contiguous cache and a row's reduction is
bitwise unchanged. 256 is the smallest such size (lcm(256, 64)); it also divides Gemma 3's
512-token window, so a sliding layer keeps at most 3 pages a sequence in steady decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import WorkbenchError

DEFAULT_PAGE_SIZE = 256
# The attention kernels' key blocks today (attention.KV_BLOCK, TritonOptions.attn_segment's
# default): a copy, since attention.py imports torch; tests/test_state_layout.py asserts they
# agree. The engine should pass its runner's own values.
DEFAULT_KEY_BLOCKS = (256, 64)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkbenchError(f"{name}={value!r} is out of range: allowed an integer >= 1")
    return value


def _shape_bytes(what: str, shape: tuple[int, ...], dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise WorkbenchError(f"{what} dtype={dtype!r} is not allowed: allowed {', '.join(DTYPE_BYTES)}")
    for d in shape:
        _positive_int(f"{what} shape entry", d)
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class KVGroup:
    """Attention layers that share one block table per sequence."""

    name: str
    layers: tuple[int, ...]
    window: int = 0  # 0 = global; else a query at q sees keys k with 0 <= q - k < window
    bytes_per_position: int = 0  # K and V of one position in all of the group's layers

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.name:
            raise WorkbenchError("KV group name='' is not allowed: give each group a name")
        if not self.layers:
            raise WorkbenchError(f"KV group {self.name!r} has no layers: allowed >= 1 layer")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise WorkbenchError(f"KV group {self.name!r} window={self.window!r} is out of range: allowed >= 0 (0 = global)")
        if not isinstance(self.bytes_per_position, int) or self.bytes_per_position < 0:
            raise WorkbenchError(f"KV group {self.name!r} bytes_per_position={self.bytes_per_position!r}: allowed >= 0")

    @property
    def sliding(self) -> bool:
        return self.window > 0


@dataclass(frozen=True)
class PagePayloadSpec:
    """Data kept beside each page of `group`, at the same page id (e.g. indexer block keys)."""

    name: str
    group: str
    shape: tuple[int, ...]  # per page, all of the group's layers
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        _shape_bytes(f"page payload {self.name!r}", self.shape, self.dtype)

    @property
    def bytes_per_page(self) -> int:
        return _shape_bytes(self.name, self.shape, self.dtype)


@dataclass(frozen=True)
class SeqStateSpec:
    """Fixed-size state one sequence owns outside the pages (e.g. recurrent [L, H, K, V])."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # a recurrent state kept fp32 stays fp32 (ANCHORS: SGLang #33515)

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        _shape_bytes(f"sequence state {self.name!r}", self.shape, self.dtype)

    @property
    def bytes_per_slot(self) -> int:
        return _shape_bytes(self.name, self.shape, self.dtype)


@dataclass(frozen=True)
class StateLayout:
    groups: tuple[KVGroup, ...]
    page_size: int = DEFAULT_PAGE_SIZE
    key_blocks: tuple[int, ...] = DEFAULT_KEY_BLOCKS  # the attention kernels' key blocks
    page_payloads: tuple[PagePayloadSpec, ...] = ()
    seq_state: tuple[SeqStateSpec, ...] = ()

    def __post_init__(self):
        for name in ("groups", "key_blocks", "page_payloads", "seq_state"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _positive_int("page_size", self.page_size)
        for kb in self.key_blocks:
            _positive_int("key block", kb)
            if self.page_size % kb:
                raise WorkbenchError(
                    f"page_size={self.page_size} is not a multiple of the attention key block {kb}: "
                    f"allowed multiples of {math.lcm(*self.key_blocks)}"
                )
        if not self.groups:
            raise WorkbenchError("a state layout needs >= 1 KV group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise WorkbenchError(f"KV group names {names} repeat: allowed unique names")
        layers = [li for g in self.groups for li in g.layers]
        if len(set(layers)) != len(layers):
            raise WorkbenchError("a layer is in two KV groups: allowed one group per layer")
        for p in self.page_payloads:
            if p.group not in names:
                raise WorkbenchError(f"page payload {p.name!r} names group {p.group!r}: allowed {', '.join(names)}")
        state_names = [s.name for s in self.seq_state]
        if len(set(state_names)) != len(state_names):
            raise WorkbenchError(f"sequence state names {state_names} repeat: allowed unique names")

    # -- lookups ---------------------------------------------------------------------------

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def group(self, name: str) -> KVGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise WorkbenchError(f"unknown KV group {name!r}: allowed {', '.join(self.group_names)}")

    def group_of(self, layer: int) -> KVGroup:
        for g in self.groups:
            if layer in g.layers:
                return g
        raise WorkbenchError(f"layer {layer!r} is in no KV group")

    def page_bytes(self, name: str) -> int:
        """Bytes one page of group `name` takes: its KV plus its per-page payloads."""
        g = self.group(name)
        extra = sum(p.bytes_per_page for p in self.page_payloads if p.group == name)
        return g.bytes_per_position * self.page_size + extra

    @property
    def seq_state_bytes(self) -> int:
        """Bytes of one state slot (every `SeqStateSpec` together)."""
        return sum(s.bytes_per_slot for s in self.seq_state)

    def num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def first_live_page(self, name: str, floor: int) -> int:
        """The lowest page a query at any position >= floor can still see in group `name`.

        A page i holds positions [i*P, (i+1)*P); a query at q sees keys k >= q - window + 1,
        so page i is dead for every q >= floor when (i+1)*P - 1 < floor - window + 1.
        """
        g = self.group(name)
        if not g.sliding:
            return 0
        return max(0, floor - g.window + 1) // self.page_size

    def max_live_pages(self, name: str, num_tokens: int, chunk: int = 1, max_rollback: int = 0) -> int:
        """Most pages one sequence of up to `num_tokens` positions holds in group `name` when each
        append adds at most `chunk` positions and truncate may go back `max_rollback` positions
        further than the last append's start (the allocator's promise; see allocator.py)."""
        total = self.num_pages(num_tokens)
        g = self.group(name)
        if not g.sliding:
            return total
        span = g.window - 1 + chunk + max_rollback  # positions from floor - window + 1 to the end
        return min(total, (span - 1 + self.page_size - 1) // self.page_size + 1)

    @classmethod
    def from_model_config(
        cls,
        config: Any,
        *,
        kv_bytes_per_elem: int = 4,
        page_size: int = DEFAULT_PAGE_SIZE,
        key_blocks: tuple[int, ...] = DEFAULT_KEY_BLOCKS,
        page_payloads: tuple[PagePayloadSpec, ...] = (),
        seq_state: tuple[SeqStateSpec, ...] = (),
    ) -> "StateLayout":
        """Groups from a `ModelConfig`: one per distinct window, global first, then by window.
        Names: "global" for window 0, "sliding" when there is one window, "sliding_<w>" else."""
        windows: dict[int, list[int]] = {}
        for li in range(config.n_layers):
            windows.setdefault(config.layer_window(li), []).append(li)
        sliding = [w for w in windows if w]
        per_layer = 2 * config.n_kv_heads * config.head_dim * kv_bytes_per_elem

        def name(w: int) -> str:
            if not w:
                return "global"
            return "sliding" if len(sliding) == 1 else f"sliding_{w}"

        groups = tuple(
            KVGroup(name(w), tuple(ls), w, per_layer * len(ls)) for w, ls in sorted(windows.items())
        )
        return cls(groups, page_size, tuple(key_blocks), tuple(page_payloads), tuple(seq_state))
