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

Host backing (paged, `EngineConfig.kv_host_tokens`): a preempted request is paged out instead,
when `preemption="swap"` and the host store has room: its private pages are bit-copied to the
host store, it keeps its slot, and it waits in the paged-out queue (FIFO). Each step, before
anything is planned, the head of that queue is paged back in when its pages (and one more in
every group) are available; when they are not, resident requests that have run at least
`residency_quantum` steps since their own page-in are paged out for it, the one paged in
longest ago first (either `eviction`: that one orders the prefix cache's pages), but only when that makes it fit (decoding ones only: each turn then gains every request at least a
token, even recomputed). So the resident set turns over every quantum and every admitted
request makes progress, waiting about a quantum per turn: the wait is bounded
(tests/test_residency.py asserts it). Only resident requests are
planned; while any request is paged out no new one is admitted (they would take the pages it
waits for). A step's page moves (`page_moves`) run before its forwards, in order; the copies
are whole pages, so a request paged out and in computes bitwise what it would have resident.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Hashable, Mapping, Protocol, Sequence

from .engine_config import EngineConfig
from .errors import WorkbenchError
from .memory import CacheMemory, PagedMemory, ReservedMemory
from .planner import BatchPlanner, ChunkSizer, PrefillChunk, SlotView, StepPlan, format_bytes
from .slots import SlotTable
from .spec.config import MAX_PATHS
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
    samples: bool  # whether the engine samples this segment's last row (rows, see `scored`)
    # paged runners: KV group -> the sequence's page ids by logical page (-1: a dropped page),
    # covering start_pos + len(token_ids) positions; None for a runner with slot state
    block_tables: Mapping[str, tuple[int, ...]] | None = None
    copies: tuple[PageCopy, ...] = ()  # page copies to run before this forward (copy-on-write)
    # sampled segments: how many of the last rows are scored (1: the last; a speculative
    # verify scores every row, 1 + its draft tokens). The runner answers a segment of more
    # than one scored row with logits [scored, vocab], or a tuple of greedy tokens.
    scored: int = 1

    @property
    def num_scored(self) -> int:
        return self.scored if self.samples else 0


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
    num_swaps: int = 0  # times paged out to the host store (host backing)
    max_wait_steps: int = 0  # the most steps in a row it was admitted and not run (after its first)


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
    num_swaps: int = 0
    paged_in_at: int = 0  # the step it was admitted or last paged in at
    last_run: int | None = None  # the last step it ran in
    max_wait_steps: int = 0

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
        # plans scheduled and not yet committed, oldest first: one, or one per half of the slots
        # while the engine pipelines (schedule(slots=...))
        self._pending: list[StepPlan] = []
        self._admissions = itertools.count()
        self._preempted: dict[Hashable, _Sequence] = {}  # waiting again after a preemption
        self._step_id: int | None = None  # the newest step handed out (its fence), None before any
        self._paged_out: deque[int] = deque()  # slots of paged-out requests, in page-out order
        self._arriving: set[int] = set()  # slots paged in by this schedule(): they run from the next step
        self._moves = ()  # the pending plan's page moves
        self._drafts: Mapping[Hashable, Sequence[int]] = {}  # this schedule()'s drafts, by request id
        self._branch_paths: Mapping[Hashable, Sequence[Sequence[int]]] = {}  # and token trees' other paths
        self.paged = bool(getattr(runner_info, "paged", False))
        self.memory: CacheMemory = (
            PagedMemory(config, runner_info, self.budget_bytes, self.capacity) if self.paged
            else ReservedMemory(runner_info, self.budget_bytes)
        )
        # host backing on (kv_host_tokens): a request is admitted into a free slot before its pages
        # are, and the resident set turns over (whether an evicted request is paged out or
        # recomputed is `preemption`'s)
        self._residency = self.paged and config.kv_host_tokens is not None

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
    def kv_host_pages(self) -> dict[str, int]:
        """Paged with host backing: host pages per KV group, what the runner allocates; {} without."""
        return self.memory.host_pages if isinstance(self.memory, PagedMemory) else {}

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

    @property
    def num_paged_out(self) -> int:
        return len(self._paged_out)

    def views(self) -> list[SlotView]:
        """One view per resident slot in use (paged-out ones wait), ascending slot id, with the
        runner's batch verdict."""
        out = []
        # a request paged in this step runs from the next one, while others can run now: its
        # page-ins then overlap this step's forward (the runner orders them; see page_moves)
        wait = self._arriving if len(self._running) - len(self._paged_out) > len(self._arriving) else ()
        for slot, s in sorted(self._running.items()):
            if self._paged_out and slot in self._paged_out or slot in wait:
                continue
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
        if self._waiting or plan.prefill_chunks or plan.drafts or len(plan.forwards()) != 1:
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
        if self._pending and self.paged:  # (its token trees' forks go with it)
            self.memory.drop_branches(self._step_id)
        self._pending = []
        slot = self.slots.slot_of(request_id)
        if slot is None:
            self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
            seq = self._preempted.pop(request_id, None)
        else:
            seq = self._running[slot]
            self._release(slot, self._step_id)
            if slot in self._paged_out:
                self._paged_out.remove(slot)
        self._known.discard(request_id)
        self._done[request_id] = "cancelled"
        if seq is None:
            return [RequestEvent("cancelled", request_id, slot, "cancelled", ())]
        return [_event("cancelled", seq, slot, "cancelled")]

    # -- the step --------------------------------------------------------------------------

    def schedule(self, step_id: int | None = None,
                 drafts: Mapping[Hashable, Sequence[int]] | None = None,
                 branches: Mapping[Hashable, Sequence[Sequence[int]]] | None = None,
                 slots: Collection[int] | None = None) -> StepPlan | None:
        """Admit what fits, then plan the next step; None when nothing is running. `step_id`:
        the engine's id of the step (increasing; default: one more than the previous one),
        the fence of whatever the step's commit releases. Paged: every planned segment has
        its pages when this returns (preempting the newest requests where a decode row cannot
        get one). `drafts` (speculation): request id -> draft tokens to verify after its next
        token; a decoding request's draft is cut to what it may still emit (`draft_room`) and,
        where pages are short, to what fits (`plan.drafts` holds what is verified). `branches`
        (token trees): request id -> alternative paths beside its draft, each cut alike, kept
        where their forks' pages fit (`plan.branches`).

        `slots` (the engine's pipeline, engine.py): plan only these decoding slots, beside plans
        still pending for the others (their steps in flight; each is committed on its own).
        Such a plan admits nothing, pages nothing in or out and preempts nothing: it is None
        when one of its rows cannot get its page (the engine then finishes what is in flight
        and plans the whole step), and it carries no token trees."""
        if slots is not None:
            return self._schedule_part(step_id, drafts or {}, frozenset(slots))
        if self._pending and self.paged:  # (a plan discarded before its commit)
            self.memory.drop_branches(self._step_id)
        self._pending = []
        self._drafts = drafts or {}
        self._branch_paths = branches or {}
        if step_id is None:
            step_id = 0 if self._step_id is None else self._step_id + 1
        self._arriving = set()
        if self._paged_out:
            self._page_in(step_id)
        if not self._paged_out or self._residency:
            self._admit(step_id)
        while True:
            if not self._running or len(self._paged_out) == len(self._running):
                self._moves = ()
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
        for slot in plan.slot_ids():
            s = self._running[slot]
            if s.last_run is not None:
                s.max_wait_steps = max(s.max_wait_steps, step_id - s.last_run - 1)
            s.last_run = step_id
        self._step_id = step_id
        self._pending = [plan]
        self._moves = self.memory.take_moves() if self.paged else ()
        return plan

    def _schedule_part(self, step_id: int | None, drafts: Mapping[Hashable, Sequence[int]],
                       slots: frozenset[int]) -> StepPlan | None:
        """`schedule(slots=...)`: a plan of these decoding slots alone (see there)."""
        if self._paged_out or any(slot not in self._running for slot in slots):
            raise RuntimeError(f"a plan of slots {sorted(slots)}: allowed running, resident slots only")
        if any(slot in p.slot_ids() for p in self._pending for slot in slots):
            raise RuntimeError(f"a plan of slots {sorted(slots)} while one of them is pending: commit it first")
        if step_id is None:
            step_id = 0 if self._step_id is None else self._step_id + 1
        self._drafts, self._branch_paths = drafts, {}
        plan = self._plan("decode-first", slots)
        if plan.prefill_chunks or not plan.decode_groups:
            raise RuntimeError(f"a plan of slots {sorted(slots)}: allowed decoding slots only")
        order = {slot: rid for slot, rid in self._by_admission().items() if slot in slots}
        plan = self.memory.fit(plan, order, self._step_id)
        if plan is None:
            return None
        for slot in plan.slot_ids():  # (a slot of a part runs every other step: it waits for none)
            self._running[slot].last_run = step_id
        self._step_id = step_id
        self._pending.append(plan)
        self._moves = ()
        return plan

    def steady(self) -> bool:
        """Whether every admitted request is resident and decoding and none waits for a free
        slot: the state in which the engine may plan its slots in parts (`schedule(slots=...)`)."""
        return (not self._paged_out and not (self._waiting and self.slots.can_allocate())
                and all(s.num_prefilled == s.prefill_len for s in self._running.values()))

    def page_moves(self, plan: StepPlan) -> tuple:
        """The plan's page moves (host backing: page-outs and page-ins, `PageMove`s), to run in
        order before its forwards; () for none. The plan's own segments may read or write pages
        that these moves touch (a page a page-out freed, taken by a segment's growth; a request
        paged in with nothing else to run): a runner whose moves run asynchronously must order
        such a forward after them (TritonRunner does; the torch runner's moves are synchronous)."""
        self._check_pending(plan)
        return self._moves if plan is self._pending[-1] else ()

    def _page_in(self, step_id: int) -> None:
        """Page the paged-out requests back in, oldest page-out first, while they fit; for the
        head, page out resident requests whose quantum has run, paged in longest ago first,
        when that makes it fit (see the module docstring)."""
        mem = self.memory
        while self._paged_out:
            head = self._running[self._paged_out[0]]
            rid = head.request.request_id
            alone = len(self._paged_out) == len(self._running)
            if not mem.page_in_fits(rid, spare=not alone):
                quantum = self.config.residency_quantum
                # (decoding ones only: one evicted mid-prefill may not have gained a token this
                # turn, and under recompute it would lose the turn's work again and again)
                old = sorted((s for slot, s in self._running.items() if slot not in self._paged_out
                              and s.num_prefilled == s.prefill_len and step_id - s.paged_in_at >= quantum),
                             key=lambda s: (s.paged_in_at, s.admitted))
                if not self._would_fit(rid, old):
                    return
                for s in old:
                    self._preempt(s.slot_id)
                    if mem.page_in_fits(rid):
                        break
                if not mem.page_in_fits(rid):
                    return
            cached = mem.swap_in(rid)
            if cached is not None:  # admitted waiting: its prefill starts after its prefix hit
                head.num_prefilled = cached
                if head.num_preemptions:
                    head.recomputed_tokens -= cached
                else:
                    head.cached_tokens = cached
            self._paged_out.popleft()
            self._arriving.add(head.slot_id)
            head.paged_in_at = step_id

    def _would_fit(self, rid: Hashable, victims: Sequence[_Sequence]) -> bool:
        """Whether paging out (or, without host room, recomputing) every one of `victims` would
        leave the pages `rid` needs to page in (the device pages only they hold come free)."""
        if any(pool.quarantine.is_pending(self._step_id) for pool in self.allocator.pools.values()):
            return False  # (what they free stays fenced until the step in flight retires)
        return self.memory.page_in_fits(rid, [s.request.request_id for s in victims])

    def _preempt(self, slot: int) -> None:
        """Make room (a decode row could not get a page, or a paged-out request waits): page the
        request out where the host store has room and preemption is "swap", else recompute it."""
        s = self._running[slot]
        rid = s.request.request_id
        if self.config.preemption == "swap" and self.memory.can_swap_out(rid):
            self.memory.swap_out(rid, self._step_id)
            s.num_swaps += 1
            self._paged_out.append(slot)
        else:
            self._recompute(slot)

    def retire(self, step_id: int) -> None:
        """The device is done with step `step_id` (and every earlier one): pages it could still
        touch are released (paged; nothing otherwise)."""
        self.memory.retire(step_id)

    def _plan(self, policy: str | None = None, slots: frozenset[int] | None = None) -> StepPlan:
        policy = policy or self.config.policy
        views = self.views()
        if slots is not None:
            views = [v for v in views if v.slot_id in slots]
        drafts = {}
        if self._drafts:
            for v in views:
                d = self._drafts.get(v.request_id) if v.phase == "decode" else None
                room = self.draft_room(v.slot_id) if d else 0
                if room:
                    drafts[v.slot_id] = tuple(int(t) for t in d[:room])
        prefilling = any(v.phase == "prefill" for v in views)
        decode_rows = 0
        if prefilling and policy == "decode-first":  # (a verify's rows share the step too)
            decode_rows = sum(1 for v in views if v.phase == "decode") + sum(map(len, drafts.values()))
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
            drafts=drafts,
        )
        branches = {}
        for slot, d in plan.drafts.items():
            room = self.draft_room(slot)
            kept = [d]
            for p in self._branch_paths.get(self._running[slot].request.request_id, ()):
                p = tuple(int(t) for t in p[:room])
                if p and not any(q[: len(p)] == p for q in kept):  # (cut, it may verify nothing new)
                    kept.append(p)
            if len(kept) > 1:
                branches[slot] = tuple(kept[1:])
        return replace(plan, branches=branches) if branches else plan

    def draft_room(self, slot: int) -> int:
        """The most draft tokens slot `slot` may verify in a step: a burst emits at most one
        token more than its draft, and never past max_tokens or the context reserved."""
        s = self._running[slot]
        n = len(s.output_ids)
        return max(0, min(s.request.max_tokens - n, s.max_context - s.prompt_len - n) - 1)

    def num_taken(self, slot: int, tokens: Sequence[int]) -> int:
        """How many of `tokens`, emitted in order by slot `slot`'s next commit, it takes: up to
        and including the first that finishes it (a stop token, max_tokens, the context)."""
        s = self._running[slot]
        n = len(s.output_ids)
        for i, tok in enumerate(tokens):
            if self._finish_reason(s, tok, n + i + 1) is not None:
                return i + 1
        return len(tokens)

    def forwards(self, plan: StepPlan) -> list[list[Segment]]:
        """The plan's forward calls as segments (decode rows first, then prefill chunks)."""
        self._check_pending(plan)
        out = []
        for fwd in plan.forwards():
            segs = []
            for slot in fwd.decode_slot_ids:
                segs.append(self._decode_segment(slot, plan.drafts.get(slot, ())))
                segs += [self._branch_segment(slot, b, path) for b, path in enumerate(plan.branches.get(slot, ()), 1)]
            segs += [self._prefill_segment(c) for c in fwd.prefill_chunks]
            out.append(segs)
        return out

    def commit(self, plan: StepPlan, sampled: Mapping[int, int],
               paths: Mapping[int, int] | None = None) -> list[RequestEvent]:
        """Advance the bookkeeping by the step's results: `sampled` maps slot id -> the token
        sampled from that slot's last row (needed for decode rows and final prefill chunks),
        or for a slot that verified a draft (`plan.drafts`) the tokens its burst emits.
        `paths` (token trees): slot -> the path its burst followed (0: its draft, b >= 1:
        `plan.branches[slot][b - 1]`, whose fork then becomes the slot's pages)."""
        self._check_pending(plan)
        self._pending = [p for p in self._pending if p is not plan]
        paths = paths or {}
        events = []
        for group in plan.decode_groups:
            for slot in group.slot_ids:
                token = _need(sampled, slot)
                s = self._running[slot]
                draft = plan.drafts.get(slot, ())
                if not draft:
                    self.memory.commit(s.request.request_id, s.output_ids[-1:])  # the fed token's KV
                    events += self._append(slot, token)
                    continue
                b = paths.get(slot, 0)
                if slot in plan.branches:
                    if not 0 <= b <= len(plan.branches[slot]):
                        raise ValueError(f"slot {slot}: path {b} of a tree of {1 + len(plan.branches[slot])} "
                                         f"(allowed 0..{len(plan.branches[slot])})")
                    self.memory.settle_branches(s.request.request_id, b, self._step_id)
                    draft = plan.branches[slot][b - 1] if b else draft
                elif b:
                    raise ValueError(f"slot {slot}: path {b} but the plan verified no tree for it (allowed 0)")
                events += self._commit_burst(slot, draft, list(token))
        for chunk in plan.prefill_chunks:
            s = self._running[chunk.slot_id]
            self.memory.commit(s.request.request_id, s.prefill_ids[chunk.start : chunk.start + chunk.length])
            s.num_prefilled += chunk.length
            if s.num_prefilled == s.prefill_len:
                events += self._append(chunk.slot_id, _need(sampled, chunk.slot_id))
        return events

    def _commit_burst(self, slot: int, draft: tuple[int, ...], tokens: list[int]) -> list[RequestEvent]:
        """A verified draft: `tokens` are what the burst emits, each draft token kept followed by
        the target's own token (so all but the last equal the draft's first ones). The KV of
        the fed token and of the kept draft tokens is committed, the rejected positions'
        pages truncated; the tokens are appended in order until one finishes the request."""
        s = self._running[slot]
        rid = s.request.request_id
        kept = len(tokens) - 1
        if not tokens or kept > len(draft) or tuple(tokens[:kept]) != draft[:kept]:
            raise ValueError(f"slot {slot}: a burst of {tokens} does not follow its draft {list(draft)} "
                             f"(allowed: the kept draft tokens, then one more)")
        start = s.context_len
        if kept < len(draft):
            self.memory.truncate(rid, start + kept + 1, self._step_id)
        self.memory.commit(rid, (s.output_ids[-1],) + draft[:kept])
        events: list[RequestEvent] = []
        for tok in tokens:
            events += self._append(slot, tok)
            if events:
                break
        return events

    # -- internals -------------------------------------------------------------------------

    def _max_context(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.max_tokens, self.capacity)

    def _by_admission(self) -> dict[int, Hashable]:
        """Slot id -> request id of every resident running request, oldest admission first."""
        seqs = sorted((s for s in self._running.values() if s.slot_id not in self._paged_out), key=lambda s: s.admitted)
        return {s.slot_id: s.request.request_id for s in seqs}

    def _admit(self, step_id: int) -> None:
        """Admit from the head of the queue (FIFO, no overtaking) while a slot is free and the
        memory takes it. A preempted request prefills its prompt and the tokens it had generated."""
        while self._waiting and self.slots.can_allocate():
            request = self._waiting[0]
            rid = request.request_id
            prev = self._preempted.get(rid)
            tokens = request.prompt_ids + tuple(prev.output_ids) if prev else request.prompt_ids
            # (while requests wait paged out, a new one waits behind them: it would take their pages)
            cached = None if self._paged_out else self.memory.admit(rid, tokens, self._max_context(request))
            waits = cached is None and self._residency
            if waits:  # host backing: it takes a slot now and waits for its pages paged out
                self.memory.admit_waiting(rid, tokens, self._max_context(request))
                cached = 0  # (its prefix hit is taken when it is paged in: _page_in)
            if cached is None:
                return
            self._waiting.popleft()
            slot = self.slots.allocate(rid)
            if waits:
                self._paged_out.append(slot)
            if prev is None:
                s = _Sequence(request, slot, self._max_context(request), cached_tokens=cached)
            else:
                s = self._preempted.pop(rid)
                s.slot_id = slot
                s.recomputed_tokens += len(tokens) - cached
            s.prefill_ids, s.num_prefilled, s.admitted = tokens, cached, next(self._admissions)
            s.paged_in_at, s.last_run = step_id, step_id - 1
            self._running[slot] = s

    @staticmethod
    def _finish_reason(s: _Sequence, token: int, num_output: int) -> str | None:
        """Why `token`, the request's `num_output`-th, finishes it; None when it does not."""
        if token in s.request.stop_ids:
            return "eos"
        if num_output >= s.request.max_tokens:
            return "max_tokens"
        if s.prompt_len + num_output >= s.max_context:
            return "max_context"
        return None

    def _append(self, slot: int, token: int) -> list[RequestEvent]:
        s = self._running[slot]
        s.output_ids.append(int(token))
        reason = self._finish_reason(s, token, len(s.output_ids))
        if reason is None:
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

    def _decode_segment(self, slot: int, draft: tuple[int, ...] = ()) -> Segment:
        s = self._running[slot]
        return Segment(slot, s.request.request_id, (s.output_ids[-1],) + draft, s.context_len, True,
                       *self.memory.segment_fields(s.request.request_id), scored=1 + len(draft))

    def _branch_segment(self, slot: int, b: int, path: tuple[int, ...]) -> Segment:
        """Token trees: path b's rows (the fed token, then the path), on its fork of the slot's
        pages, under its own id `branch_slot(slot, b)`."""
        s = self._running[slot]
        rid = s.request.request_id
        return Segment(branch_slot(slot, b), rid, (s.output_ids[-1],) + path, s.context_len, True,
                       *self.memory.branch_fields(rid, b), scored=1 + len(path))

    def _prefill_segment(self, chunk: PrefillChunk) -> Segment:
        s = self._running[chunk.slot_id]
        end = chunk.start + chunk.length
        tokens = s.prefill_ids[chunk.start : end]
        return Segment(chunk.slot_id, s.request.request_id, tokens, chunk.start, end == s.prefill_len,
                       *self.memory.segment_fields(s.request.request_id))

    def _recompute(self, slot: int) -> None:
        """Preemption by recompute: free the pages, back to the front of the queue."""
        s = self._running[slot]
        self._release(slot, self._step_id, preempted=True)
        s.num_preemptions += 1
        s.num_prefilled = 0
        self._preempted[s.request.request_id] = s
        self._waiting.appendleft(s.request)

    def _check_pending(self, plan: StepPlan) -> None:
        if not any(plan is p for p in self._pending):
            raise RuntimeError(
                "plan is not the pending one: it was committed, replaced by a later schedule(), "
                "or discarded by cancel(); call schedule() again"
            )


def branch_slot(slot: int, b: int) -> int:
    """The id a tree's path b >= 1 of slot `slot` runs under (negative: no real slot has it);
    `branch_of` inverts it."""
    return -(slot * MAX_PATHS + b)


def branch_of(vslot: int) -> tuple[int, int]:
    """(slot, path) of a `branch_slot` id."""
    return divmod(-vslot, MAX_PATHS)


def _event(kind: str, s: _Sequence, slot: int | None, reason: str) -> RequestEvent:
    return RequestEvent(kind, s.request.request_id, slot, reason, tuple(s.output_ids), s.cached_tokens,
                        s.num_preemptions, s.recomputed_tokens, s.num_swaps, s.max_wait_steps)


def _need(sampled: Mapping[int, int], slot: int) -> int:
    if slot not in sampled:
        raise ValueError(f"no sampled token for slot {slot}, which the plan asked to sample")
    return sampled[slot]
