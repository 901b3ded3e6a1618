"""BatchPlanner, ChunkSizer, StepPlan: what runs in one engine step, and why.

Each step the scheduler hands the planner one `SlotView` per slot in use. The planner answers
with a `StepPlan`: which decoding slots run together (or alone, and why) and which prefill
chunks run. Plain Python: no torch.

Prefill chunks of different slots interleave (the chunk budget is split fairly across the
prefilling slots, round-robin with a start that rotates every step), so first tokens arrive
together instead of one slot's prompt starving the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from .errors import WorkbenchError

POLICIES = ("decode-first", "prefill-first")
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class SlotView:
    slot_id: int
    request_id: Hashable
    phase: str  # "prefill" | "decode"
    prompt_len: int  # tokens to prefill: the prompt (after a preemption, + the generated tokens)
    num_prefilled: int
    num_generated: int
    context_len: int  # tokens in the slot's KV
    max_context: int  # tokens the slot reserves: prompt_len + max_tokens, capped at capacity
    exact_batchable: bool = True
    solo_reason: str | None = None  # why the runner will not batch it, when it will not

    def __post_init__(self):
        if self.phase not in PHASES:
            raise WorkbenchError(f"phase={self.phase!r} is not allowed: allowed {', '.join(PHASES)}")

    @property
    def prompt_remaining(self) -> int:
        return self.prompt_len - self.num_prefilled


@dataclass(frozen=True)
class PrefillChunk:
    slot_id: int
    start: int  # first prompt position of the chunk
    length: int


@dataclass(frozen=True)
class DecodeGroup:
    slot_ids: tuple[int, ...]
    batched: bool
    reason: str  # "exact-batch" | "single" | the runner's solo reason


@dataclass(frozen=True)
class Forward:
    """One forward call: decode rows (one per slot) and prefill chunks, run together."""

    decode_slot_ids: tuple[int, ...]
    prefill_chunks: tuple[PrefillChunk, ...]


@dataclass(frozen=True)
class StepPlan:
    decode_groups: tuple[DecodeGroup, ...]
    prefill_chunks: tuple[PrefillChunk, ...]
    chunk_size: int
    chunk_reason: str
    policy: str
    fused: bool  # prefill chunks ride in decode_groups[0]'s forward
    # speculation: decoding slot -> the draft tokens it verifies after its next token (its
    # segment then scores 1 + len(draft) rows); slots without a draft decode one row
    drafts: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # token trees: decoding slot (one with a draft) -> its alternative paths, each verified as a
    # segment of its own on a fork of the slot's pages (1 + len(path) rows; speculator.py)
    branches: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    @property
    def num_prefill_rows(self) -> int:
        return sum(c.length for c in self.prefill_chunks)

    @property
    def num_decode_rows(self) -> int:
        """Rows of the decoding slots: one each, plus their draft tokens and tree paths."""
        return sum(len(g.slot_ids) for g in self.decode_groups) + self.num_draft_tokens + self.num_branch_rows

    @property
    def num_branch_rows(self) -> int:
        return sum(1 + len(p) for paths in self.branches.values() for p in paths)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts.values())

    @property
    def num_solo_fallback(self) -> int:
        """Decode groups run alone because the runner could not batch them exactly."""
        return sum(1 for g in self.decode_groups if not g.batched and g.reason != "single")

    def slot_ids(self) -> tuple[int, ...]:
        ids = [s for g in self.decode_groups for s in g.slot_ids]
        return tuple(ids + [c.slot_id for c in self.prefill_chunks])

    def forwards(self) -> tuple[Forward, ...]:
        """The forward calls of this step, in order.

        Fused: decode_groups[0] and every prefill chunk share the first forward, each further
        decode group runs as its own. Not fused: each decode group is a forward, then all
        prefill chunks together are one more.
        """
        groups = [Forward(g.slot_ids, ()) for g in self.decode_groups]
        if not self.prefill_chunks:
            return tuple(groups)
        if self.fused:
            groups[0] = Forward(groups[0].decode_slot_ids, self.prefill_chunks)
            return tuple(groups)
        return tuple(groups + [Forward((), self.prefill_chunks)])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


class ChunkSizer:
    """Prefill rows per step, sized from what the memory budget leaves.

    The budget first reserves the weights / fixed buffers and every admitted slot's full cache
    (so nothing grows past the budget later), then the decode rows that share the step; what
    is left, in prefill rows, is the chunk, capped at `cap`: uncapped, a large budget picks a
    chunk so long that the other slots' decode stalls behind it. An explicit `override` wins.
    """

    def __init__(self, cap: int = 4096, override: int | None = None):
        if cap < 1:
            raise WorkbenchError(f"chunk_cap={cap} is out of range: allowed >= 1")
        if override is not None and override < 1:
            raise WorkbenchError(f"chunk_size={override} is out of range: allowed >= 1")
        self.cap = cap
        self.override = override

    def size(
        self,
        *,
        budget_bytes: int,
        reserved_cache_bytes: int,
        fixed_bytes: int,
        bytes_per_prefill_row: int,
        decode_rows: int = 0,
    ) -> tuple[int, str]:
        if self.override is not None:
            return self.override, "override"
        free = budget_bytes - reserved_cache_bytes - fixed_bytes
        rows = max(free, 0) // bytes_per_prefill_row - decode_rows
        if rows < 1:
            raise WorkbenchError(
                f"memory budget {format_bytes(budget_bytes)} cannot fit one prefill row: "
                f"reserved cache {format_bytes(reserved_cache_bytes)}, fixed "
                f"{format_bytes(fixed_bytes)}, {decode_rows} decode rows of "
                f"{format_bytes(bytes_per_prefill_row)}"
            )
        chunk = min(self.cap, rows)
        reason = (
            f"auto: budget {format_bytes(budget_bytes)} - reserved "
            f"{format_bytes(reserved_cache_bytes)} - fixed {format_bytes(fixed_bytes)}"
        )
        if decode_rows:
            reason += f" - {decode_rows} decode rows"
        reason += f" -> {rows} rows"
        if chunk < rows:
            reason += f", capped at {self.cap}"
        return chunk, reason


class BatchPlanner:
    """Turns slot views into a StepPlan. Deterministic: a pure function of its inputs and of
    the rotation counter, which advances once per plan."""

    def __init__(self):
        self.rotation = 0

    def plan(
        self,
        views: Sequence[SlotView],
        *,
        chunk_size: int,
        max_batch_rows: int,
        policy: str,
        chunk_reason: str = "",
        fuse: bool = True,
        drafts: Mapping[int, tuple[int, ...]] | None = None,
    ) -> StepPlan:
        if policy not in POLICIES:
            raise WorkbenchError(f"policy={policy!r} is not allowed: allowed {', '.join(POLICIES)}")
        if chunk_size < 1 or max_batch_rows < 1:
            raise WorkbenchError(
                f"chunk_size={chunk_size}, max_batch_rows={max_batch_rows}: allowed >= 1"
            )
        views = sorted(views, key=lambda v: v.slot_id)
        prefilling = [v for v in views if v.phase == "prefill"]
        decoding = [v for v in views if v.phase == "decode"]
        rotation, self.rotation = self.rotation, self.rotation + 1

        chunks = tuple(_split_prefill(prefilling, chunk_size, rotation))
        if policy == "prefill-first" and chunks:
            groups: tuple[DecodeGroup, ...] = ()
        else:
            groups = tuple(_group_decode(decoding, max_batch_rows))
        # Only a group of exactly-batchable slots may share its forward with prefill rows.
        batchable = {v.slot_id for v in decoding if v.exact_batchable}
        fused = bool(fuse and chunks and groups and set(groups[0].slot_ids) <= batchable)
        planned = {s for g in groups for s in g.slot_ids}
        drafts = {s: tuple(d) for s, d in (drafts or {}).items() if d and s in planned}
        return StepPlan(groups, chunks, chunk_size, chunk_reason, policy, fused, drafts)


def _group_decode(decoding: list[SlotView], max_batch_rows: int) -> list[DecodeGroup]:
    batchable = [v.slot_id for v in decoding if v.exact_batchable]
    groups = []
    for i in range(0, len(batchable), max_batch_rows):
        ids = tuple(batchable[i : i + max_batch_rows])
        groups.append(DecodeGroup(ids, len(ids) > 1, "exact-batch" if len(ids) > 1 else "single"))
    for v in decoding:
        if not v.exact_batchable:
            groups.append(DecodeGroup((v.slot_id,), False, v.solo_reason or "not exactly batchable"))
    return groups


def _split_prefill(prefilling: list[SlotView], budget: int, rotation: int) -> list[PrefillChunk]:
    """Split `budget` rows fairly over the prefilling slots: equal shares, each at most its
    remaining prompt, leftovers handed out one row at a time starting at a rotating slot."""
    if not prefilling:
        return []
    start = rotation % len(prefilling)
    order = prefilling[start:] + prefilling[:start]
    given = {v.slot_id: 0 for v in order}
    active = [v for v in order if v.prompt_remaining > 0]
    while budget > 0 and active:
        share = budget // len(active)
        if share == 0:  # fewer rows than slots: one row each, in rotation order
            for v in active[:budget]:
                given[v.slot_id] += 1
            break
        for v in active:
            take = min(share, v.prompt_remaining - given[v.slot_id])
            given[v.slot_id] += take
            budget -= take
        active = [v for v in active if given[v.slot_id] < v.prompt_remaining]
    return [
        PrefillChunk(v.slot_id, v.num_prefilled, given[v.slot_id])
        for v in prefilling
        if given[v.slot_id] > 0
    ]
