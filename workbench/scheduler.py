"""Scheduler: the request queue, admission into slots, and the per-step plan.

One engine step is `plan = schedule()` -> run `forwards(plan)` on the device -> `commit(plan,
sampled)`. The scheduler owns every request's bookkeeping (prompt progress, generated tokens,
its slot and its memory reservation); the runner owns the device state and learns from the
events that `commit` and `cancel` return which slots to reset. Plain Python: no torch.

Memory: a request is admitted when a slot is free and the budget can reserve, on top of the
fixed bytes and the caches already reserved, its full cache (prompt + max_tokens, capped at the
slot capacity) plus one activation row per slot in use. Nothing grows past its reservation, so
admission never has to be undone; the prefill chunk gets what the reservations leave.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Protocol

from .engine_config import EngineConfig
from .errors import WorkbenchError
from .planner import BatchPlanner, ChunkSizer, PrefillChunk, SlotView, StepPlan, format_bytes
from .slots import SlotTable


class RunnerInfo(Protocol):
    """What the scheduler needs to know about the runner (the model on its device).

    Optional: `supports_fused_step: bool` (default True), whether decode rows and prefill
    chunks may share one forward.
    """

    bytes_per_prefill_row: int  # activation bytes one row of a forward takes
    fixed_bytes: int  # weights and buffers that do not scale with slots or rows
    slot_capacity: int  # most context tokens a slot holds

    def cache_bytes(self, num_tokens: int) -> int: ...

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]: ...


@dataclass(frozen=True)
class Request:
    request_id: Hashable
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Any = None  # opaque to the scheduler
    stop_ids: tuple[int, ...] = ()  # EOS / stop token ids: generating one finishes the request

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        if self.request_id is None:
            raise WorkbenchError("request_id=None is not allowed: give each request an id")
        if not self.prompt_ids:
            raise WorkbenchError(f"request {self.request_id!r} has an empty prompt: allowed >= 1 token")
        n = self.max_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WorkbenchError(f"max_tokens={self.max_tokens!r} is out of range: allowed >= 1")


@dataclass(frozen=True)
class Segment:
    """The rows one slot contributes to a forward: `token_ids` at positions `start_pos`..."""

    slot_id: int
    request_id: Hashable
    token_ids: tuple[int, ...]
    start_pos: int
    samples: bool  # whether the engine samples this segment's last row


@dataclass(frozen=True)
class RequestEvent:
    kind: str  # "finished" | "cancelled"
    request_id: Hashable
    slot_id: int | None  # the slot to reset; None when it never left the queue
    reason: str  # "eos" | "max_tokens" | "max_context" | "cancelled"
    output_ids: tuple[int, ...]


@dataclass
class _Sequence:
    request: Request
    slot_id: int
    max_context: int
    reserved_bytes: int
    num_prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the slot's KV: the prompt so far, then every generated token but the last."""
        return self.num_prefilled + max(len(self.output_ids) - 1, 0)


class Scheduler:
    def __init__(
        self, config: EngineConfig, runner_info: RunnerInfo, *, budget_bytes: int | None = None
    ):
        """`budget_bytes`: the budget learnt from the machine, used when the config leaves
        `memory_budget_bytes` unset."""
        self.config = config
        self.runner = runner_info
        self.budget_bytes = config.memory_budget_bytes or budget_bytes
        if self.budget_bytes is None:
            raise WorkbenchError(
                "memory budget unknown: set memory_budget_bytes or derive it from the machine"
            )
        if config.max_context is not None and config.max_context > runner_info.slot_capacity:
            raise WorkbenchError(
                f"max_context={config.max_context} exceeds the runner's slot capacity: "
                f"allowed 1..{runner_info.slot_capacity}"
            )
        self.capacity = config.max_context or runner_info.slot_capacity
        if runner_info.fixed_bytes + runner_info.bytes_per_prefill_row > self.budget_bytes:
            raise WorkbenchError(
                f"memory budget {format_bytes(self.budget_bytes)} is below the runner's fixed "
                f"{format_bytes(runner_info.fixed_bytes)} plus one row"
            )
        self.slots = SlotTable(config.max_concurrency)
        self.sizer = ChunkSizer(config.chunk_cap, config.chunk_size)
        self.planner = BatchPlanner()
        self._fuse = bool(getattr(runner_info, "supports_fused_step", True))
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Sequence] = {}  # slot id -> sequence
        self._known: set[Hashable] = set()  # waiting or running
        self._done: dict[Hashable, str] = {}  # request id -> "finished" | "cancelled"
        self._pending: StepPlan | None = None

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def reserved_cache_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self._running.values())

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def waiting_ids(self) -> list[Hashable]:
        return [r.request_id for r in self._waiting]

    def running_ids(self) -> dict[int, Hashable]:
        """Slot id -> request id of every admitted request."""
        return {slot: s.request.request_id for slot, s in sorted(self._running.items())}

    def views(self) -> list[SlotView]:
        """One view per slot in use, ascending slot id, with the runner's batch verdict."""
        out = []
        for slot, s in sorted(self._running.items()):
            fields = dict(
                slot_id=slot,
                request_id=s.request.request_id,
                phase="prefill" if s.num_prefilled < s.prompt_len else "decode",
                prompt_len=s.prompt_len,
                num_prefilled=s.num_prefilled,
                num_generated=len(s.output_ids),
                context_len=s.context_len,
                max_context=s.max_context,
            )
            ok, reason = self.runner.batch_verdict(SlotView(**fields))
            # (a second constructor call: dataclasses.replace cost 5 us per slot per step)
            out.append(SlotView(**fields, exact_batchable=bool(ok), solo_reason=None if ok else reason))
        return out

    def repeats_after(self, plan: StepPlan) -> bool:
        """Whether the step after ``plan`` will be the same decode rows one position on, unless
        a sampled token stops a request: a one-forward decode-only plan of every running slot,
        nothing waiting, no slot at its token or context limit. (A runner may start that next
        step early; it is only a hint, the runner checks the next step's inputs.)"""
        if self._waiting or plan.prefill_chunks or len(plan.forwards()) != 1:
            return False
        if plan.num_decode_rows != len(self._running):
            return False
        for s in self._running.values():
            n = len(s.output_ids) + 1
            if n >= s.request.max_tokens or s.prompt_len + n >= s.max_context:
                return False
        return True

    def max_contexts(self) -> dict[int, int]:
        """Slot id -> the context reserved for it, for every admitted request (what a runner
        sizes its per-slot state by)."""
        return {slot: s.max_context for slot, s in self._running.items()}

    # -- requests --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._known or rid in self._done:
            raise WorkbenchError(f"request {rid!r} already exists")
        n = len(request.prompt_ids)
        if n + 1 > self.capacity:
            raise WorkbenchError(
                f"prompt of {n} tokens does not fit the context of {self.capacity} tokens"
            )
        need = self.runner.fixed_bytes + self._cache_bytes(request) + self.runner.bytes_per_prefill_row
        if need > self.budget_bytes:
            raise WorkbenchError(
                f"request {rid!r} needs {format_bytes(need)} alone but the memory budget is "
                f"{format_bytes(self.budget_bytes)}"
            )
        self._waiting.append(request)
        self._known.add(rid)

    def cancel(self, request_id: Hashable) -> list[RequestEvent]:
        """Cancel a waiting or running request. Call between steps; a plan scheduled and not
        yet committed is discarded (committing it raises), since it may touch the slot."""
        if request_id in self._done:
            raise WorkbenchError(f"request {request_id!r} already {self._done[request_id]}")
        if request_id not in self._known:
            raise WorkbenchError(f"unknown request {request_id!r}")
        self._pending = None
        slot = self.slots.slot_of(request_id)
        if slot is None:
            self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
            output: tuple[int, ...] = ()
        else:
            output = tuple(self._running[slot].output_ids)
            self._release(slot)
        self._known.discard(request_id)
        self._done[request_id] = "cancelled"
        return [RequestEvent("cancelled", request_id, slot, "cancelled", output)]

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Admit what fits, then plan the next step; None when nothing is running."""
        self._admit()
        self._pending = None
        if not self._running:
            return None
        views = self.views()
        prefilling = any(v.phase == "prefill" for v in views)
        decode_rows = 0
        if prefilling and self.config.policy == "decode-first":
            decode_rows = sum(1 for v in views if v.phase == "decode")
        chunk, reason = self.sizer.size(
            budget_bytes=self.budget_bytes,
            reserved_cache_bytes=self.reserved_cache_bytes,
            fixed_bytes=self.runner.fixed_bytes,
            bytes_per_prefill_row=self.runner.bytes_per_prefill_row,
            decode_rows=decode_rows,
        )
        plan = self.planner.plan(
            views,
            chunk_size=chunk,
            max_batch_rows=self.config.max_batch_rows,
            policy=self.config.policy,
            chunk_reason=reason,
            fuse=self._fuse,
        )
        self._pending = plan
        return plan

    def forwards(self, plan: StepPlan) -> list[list[Segment]]:
        """The plan's forward calls as segments (decode rows first, then prefill chunks)."""
        self._check_pending(plan)
        out = []
        for fwd in plan.forwards():
            segs = [self._decode_segment(slot) for slot in fwd.decode_slot_ids]
            segs += [self._prefill_segment(c) for c in fwd.prefill_chunks]
            out.append(segs)
        return out

    def commit(self, plan: StepPlan, sampled: Mapping[int, int]) -> list[RequestEvent]:
        """Advance the bookkeeping by the step's results: `sampled` maps slot id -> the token
        sampled from that slot's last row (needed for decode rows and final prefill chunks)."""
        self._check_pending(plan)
        self._pending = None
        events = []
        for group in plan.decode_groups:
            for slot in group.slot_ids:
                events += self._append(slot, _need(sampled, slot))
        for chunk in plan.prefill_chunks:
            s = self._running[chunk.slot_id]
            s.num_prefilled += chunk.length
            if s.num_prefilled == s.prompt_len:
                events += self._append(chunk.slot_id, _need(sampled, chunk.slot_id))
        return events

    # -- internals -------------------------------------------------------------------------

    def _cache_bytes(self, request: Request) -> int:
        return self.runner.cache_bytes(self._max_context(request))

    def _max_context(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.max_tokens, self.capacity)

    def _admit(self) -> None:
        """Admit from the head of the queue (FIFO, no overtaking) while a slot and memory allow."""
        while self._waiting and self.slots.can_allocate():
            request = self._waiting[0]
            cache = self._cache_bytes(request)
            need = (
                self.runner.fixed_bytes
                + self.reserved_cache_bytes
                + cache
                + self.runner.bytes_per_prefill_row * (self.slots.num_used + 1)
            )
            if need > self.budget_bytes:
                return
            self._waiting.popleft()
            slot = self.slots.allocate(request.request_id)
            self._running[slot] = _Sequence(request, slot, self._max_context(request), cache)

    def _append(self, slot: int, token: int) -> list[RequestEvent]:
        s = self._running[slot]
        s.output_ids.append(int(token))
        if token in s.request.stop_ids:
            reason = "eos"
        elif len(s.output_ids) >= s.request.max_tokens:
            reason = "max_tokens"
        elif s.prompt_len + len(s.output_ids) >= s.max_context:
            reason = "max_context"
        else:
            return []
        rid = s.request.request_id
        self._release(slot)
        self._known.discard(rid)
        self._done[rid] = "finished"
        return [RequestEvent("finished", rid, slot, reason, tuple(s.output_ids))]

    def _release(self, slot: int) -> None:
        self.slots.free(slot)
        del self._running[slot]

    def _decode_segment(self, slot: int) -> Segment:
        s = self._running[slot]
        return Segment(slot, s.request.request_id, (s.output_ids[-1],), s.context_len, True)

    def _prefill_segment(self, chunk: PrefillChunk) -> Segment:
        s = self._running[chunk.slot_id]
        end = chunk.start + chunk.length
        tokens = s.request.prompt_ids[chunk.start : end]
        return Segment(chunk.slot_id, s.request.request_id, tokens, chunk.start, end == s.prompt_len)

    def _check_pending(self, plan: StepPlan) -> None:
        if plan is not self._pending:
            raise RuntimeError(
                "plan is not the pending one: it was committed, replaced by a later schedule(), "
                "or discarded by cancel(); call schedule() again"
            )


def _need(sampled: Mapping[int, int], slot: int) -> int:
    if slot not in sampled:
        raise ValueError(f"no sampled token for slot {slot}, which the plan asked to sample")
    return sampled[slot]
