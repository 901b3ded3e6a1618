"""Scheduler: the request queue, admission into slots, and the per-step plan.

One engine step is `plan = schedule()` -> run `forwards(plan)` on the device -> `commit(plan,
sampled)`. The scheduler owns every request's bookkeeping (prompt progress, generated tokens,
its slot, and through its memory form the memory it holds); the runner owns the device state and learns from the
events that `commit` and `cancel` return which slots to reset. Plain Python: no torch.

Memory is a `workbench.memory.CacheMemory`, in the form the runner needs (`RunnerInfo.paged`):
`ReservedMemory` reserves each request's full cache at admission, `PagedMemory` owns a page
pool and its `PageAllocator` (that module's docstring says how each one admits and fits).
The scheduler asks it whether the head of the queue fits (FIFO, no overtaking), and each step,
before anything runs, whether the plan fits; it commits the written tokens, and releases what a
finished, cancelled or preempted request held, fenced by the step id (the engine calls `retire` once the
device is done with a step).

Preemption (paged): when a decode row cannot get a page, the most recently admitted running
request is preempted: its pages are freed, it goes back to the front of the queue and is later
re-prefilled with its prompt and the tokens it had generated. The last of those re-prefilled
rows samples its next token, so no committed token is drawn twice (a seeded generator is
advanced once per committed token, preempted or not), and chunk invariance makes the recomputed
KV, hence every later token and logit, bitwise what it would have been.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Protocol, Sequence

from .engine_config import EngineConfig
from .errors import WorkbenchError
from .memory import CacheMemory, PagedMemory, ReservedMemory
from .planner import BatchPlanner, ChunkSizer, PrefillChunk, SlotView, StepPlan, format_bytes
from .slots import SlotTable
from .state import PageAllocator, PageCopy


class RunnerInfo(Protocol):
    """What the scheduler needs to know about the runner (the model on its device).

    Optional: `supports_fused_step: bool` (default True), whether decode rows and prefill
    chunks may share one forward; `paged: bool` (default False), whether it reads KV through
    block tables (then the scheduler's memory is a PagedMemory, every Segment carries its
    `block_tables` and `copies`, and the runner also has `state_layout: StateLayout` and
    `kv_cache_key: bytes`, the model identity and KV dtype the prefix cache's hashes start from).
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
    # paged runners: KV group -> the sequence's page ids by logical page (-1: a dropped page),
    # covering start_pos + len(token_ids) positions; None for a runner with slot state
    block_tables: Mapping[str, tuple[int, ...]] | None = None
    copies: tuple[PageCopy, ...] = ()  # page copies to run before this forward (copy-on-write)


def check_paged_forward(forward: Sequence[Segment], pool_allocated: bool) -> None:
    """What a paged runner requires of a forward before it runs: its pool allocated
    (`init_kv_pool`) and every segment carrying its block tables."""
    if not pool_allocated:
        raise RuntimeError("the KV pool is not allocated: call init_kv_pool first")
    for s in forward:
        if s.block_tables is None:
            raise RuntimeError(f"slot {s.slot_id}: a segment without block tables (the runner is paged)")


@dataclass(frozen=True)
class RequestEvent:
    kind: str  # "finished" | "cancelled"
    request_id: Hashable
    slot_id: int | None  # the slot to reset; None when it never left the queue
    reason: str  # "eos" | "max_tokens" | "max_context" | "cancelled"
    output_ids: tuple[int, ...]
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # tokens re-prefilled after preemptions (less cache hits)


@dataclass
class _Sequence:
    request: Request
    slot_id: int
    max_context: int
    num_prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    # what the slot prefills: the prompt, or after a preemption the prompt + the tokens generated
    prefill_ids: tuple[int, ...] = ()
    admitted: int = 0  # admission order (the newest running request is preempted first)
    cached_tokens: int = 0
    num_preemptions: int = 0
    recomputed_tokens: int = 0

    def __post_init__(self):
        self.prefill_ids = self.prefill_ids or self.request.prompt_ids

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefill_len(self) -> int:
        return len(self.prefill_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the slot's KV: the prefill so far, then every generated token after those
        it prefilled but the last."""
        fed = self.prefill_len - self.prompt_len  # generated tokens among the prefill ids
        return self.num_prefilled + max(len(self.output_ids) - fed - 1, 0)


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
        self._admissions = itertools.count()
        self._preempted: dict[Hashable, _Sequence] = {}  # waiting again after a preemption
        self._step_id: int | None = None  # the newest step handed out (its fence), None before any
        self.paged = bool(getattr(runner_info, "paged", False))
        self.memory: CacheMemory = (
            PagedMemory(config, runner_info, self.budget_bytes, self.capacity) if self.paged
            else ReservedMemory(runner_info, self.budget_bytes)
        )

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def reserved_cache_bytes(self) -> int:
        return self.memory.reserved_bytes

    @property
    def kv_bytes_in_use(self) -> int:
        """Paged: bytes of the pages held by running requests (0 for a runner with slot state)."""
        return self.memory.bytes_in_use

    @property
    def allocator(self) -> PageAllocator | None:
        """Paged: the PageAllocator over the pool; None for a runner with slot state."""
        return self.memory.allocator if isinstance(self.memory, PagedMemory) else None

    @property
    def kv_pool_pages(self) -> dict[str, int]:
        """Paged: pages per KV group, what the runner allocates; {} for a runner with slot state."""
        return self.memory.pool_pages if isinstance(self.memory, PagedMemory) else {}

    @property
    def kv_pool_bytes(self) -> int:
        return self.memory.pool_bytes if isinstance(self.memory, PagedMemory) else 0

    def step_stats(self) -> dict[str, Any]:
        """The step record's memory columns since the previous read (`PagedMemory.step_stats`);
        without pages, the same columns as None."""
        return self.memory.step_stats()

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
                phase="prefill" if s.num_prefilled < s.prefill_len else "decode",
                prompt_len=s.prefill_len,  # what it prefills (after a preemption: + generated)
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
        self.memory.check_fits(rid, self._max_context(request))
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
            seq = self._preempted.pop(request_id, None)
        else:
            seq = self._running[slot]
            self._release(slot, self._step_id)
        self._known.discard(request_id)
        self._done[request_id] = "cancelled"
        if seq is None:
            return [RequestEvent("cancelled", request_id, slot, "cancelled", ())]
        return [_event("cancelled", seq, slot, "cancelled")]

    # -- the step --------------------------------------------------------------------------

    def schedule(self, step_id: int | None = None) -> StepPlan | None:
        """Admit what fits, then plan the next step; None when nothing is running. `step_id`:
        the engine's id of the step (increasing; default: one more than the previous one),
        the fence of whatever the step's commit releases. Paged: every planned segment has
        its pages when this returns (preempting the newest requests where a decode row cannot
        get one)."""
        self._pending = None
        self._admit()
        while True:
            if not self._running:
                return None
            plan = self._plan()
            order = self._by_admission()
            fitted = self.memory.fit(plan, order, self._step_id)
            if fitted is None and not plan.decode_groups and len(plan.prefill_chunks) < len(self._running):
                # prefill-first, and no chunk can get a page: the decode rows it held back run
                fitted = self.memory.fit(self._plan("decode-first"), order, self._step_id)
            if fitted is not None:
                plan = fitted
                break
            self._preempt(next(reversed(order)))  # the newest
        if step_id is None:
            step_id = 0 if self._step_id is None else self._step_id + 1
        self._step_id = step_id
        self._pending = plan
        return plan

    def retire(self, step_id: int) -> None:
        """The device is done with step `step_id` (and every earlier one): pages it could still
        touch are released (paged; nothing otherwise)."""
        self.memory.retire(step_id)

    def _plan(self, policy: str | None = None) -> StepPlan:
        policy = policy or self.config.policy
        views = self.views()
        prefilling = any(v.phase == "prefill" for v in views)
        decode_rows = 0
        if prefilling and policy == "decode-first":
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
            policy=policy,
            chunk_reason=reason,
            fuse=self._fuse,
        )
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
                token = _need(sampled, slot)
                s = self._running[slot]
                self.memory.commit(s.request.request_id, s.output_ids[-1:])  # the fed token's KV
                events += self._append(slot, token)
        for chunk in plan.prefill_chunks:
            s = self._running[chunk.slot_id]
            self.memory.commit(s.request.request_id, s.prefill_ids[chunk.start : chunk.start + chunk.length])
            s.num_prefilled += chunk.length
            if s.num_prefilled == s.prefill_len:
                events += self._append(chunk.slot_id, _need(sampled, chunk.slot_id))
        return events

    # -- internals -------------------------------------------------------------------------

    def _max_context(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.max_tokens, self.capacity)

    def _by_admission(self) -> dict[int, Hashable]:
        """Slot id -> request id of every running request, oldest admission first."""
        seqs = sorted(self._running.values(), key=lambda s: s.admitted)
        return {s.slot_id: s.request.request_id for s in seqs}

    def _admit(self) -> None:
        """Admit from the head of the queue (FIFO, no overtaking) while a slot is free and the
        memory takes it. A preempted request prefills its prompt and the tokens it had generated."""
        while self._waiting and self.slots.can_allocate():
            request = self._waiting[0]
            rid = request.request_id
            prev = self._preempted.get(rid)
            tokens = request.prompt_ids + tuple(prev.output_ids) if prev else request.prompt_ids
            cached = self.memory.admit(rid, tokens, self._max_context(request))
            if cached is None:
                return
            self._waiting.popleft()
            slot = self.slots.allocate(rid)
            if prev is None:
                s = _Sequence(request, slot, self._max_context(request), cached_tokens=cached)
            else:
                s = self._preempted.pop(rid)
                s.slot_id = slot
                s.recomputed_tokens += len(tokens) - cached
            s.prefill_ids, s.num_prefilled, s.admitted = tokens, cached, next(self._admissions)
            self._running[slot] = s

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
        self._release(slot, self._step_id)
        self._known.discard(rid)
        self._done[rid] = "finished"
        return [_event("finished", s, slot, reason)]

    def _release(self, slot: int, fence: int | None, *, preempted: bool = False) -> None:
        s = self._running.pop(slot)
        self.slots.free(slot)
        self.memory.release(s.request.request_id, fence, preempted=preempted)

    def _decode_segment(self, slot: int) -> Segment:
        s = self._running[slot]
        return Segment(slot, s.request.request_id, (s.output_ids[-1],), s.context_len, True,
                       *self.memory.segment_fields(s.request.request_id))

    def _prefill_segment(self, chunk: PrefillChunk) -> Segment:
        s = self._running[chunk.slot_id]
        end = chunk.start + chunk.length
        tokens = s.prefill_ids[chunk.start : end]
        return Segment(chunk.slot_id, s.request.request_id, tokens, chunk.start, end == s.prefill_len,
                       *self.memory.segment_fields(s.request.request_id))

    def _preempt(self, slot: int) -> None:
        """Preemption by recompute: free the pages, back to the front of the queue."""
        s = self._running[slot]
        self._release(slot, self._step_id, preempted=True)
        s.num_preemptions += 1
        s.num_prefilled = 0
        self._preempted[s.request.request_id] = s
        self._waiting.appendleft(s.request)

    def _check_pending(self, plan: StepPlan) -> None:
        if plan is not self._pending:
            raise RuntimeError(
                "plan is not the pending one: it was committed, replaced by a later schedule(), "
                "or discarded by cancel(); call schedule() again"
            )


def _event(kind: str, s: _Sequence, slot: int | None, reason: str) -> RequestEvent:
    return RequestEvent(kind, s.request.request_id, slot, reason, tuple(s.output_ids), s.cached_tokens,
                        s.num_preemptions, s.recomputed_tokens)


def _need(sampled: Mapping[int, int], slot: int) -> int:
    if slot not in sampled:
        raise ValueError(f"no sampled token for slot {slot}, which the plan asked to sample")
    return sampled[slot]
