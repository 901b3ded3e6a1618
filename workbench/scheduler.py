"""Scheduler: the request queue, admission into slots, and the per-step plan.

One engine step is `plan = schedule()` -> run `forwards(plan)` on the device -> `commit(plan,
sampled)`. The scheduler owns every request's bookkeeping (prompt progress, generated tokens,
its slot and its memory reservation); the runner owns the device state and learns from the
events that `commit` and `cancel` return which slots to reset. Plain Python: no torch.

Memory has two forms, chosen by the runner (`RunnerInfo.paged`):

* Reserved (a runner with per-slot contiguous state): a request is admitted when a slot is free
  and the budget can reserve, on top of the fixed bytes and the caches already reserved, its full
  cache (prompt + max_tokens, capped at the slot capacity) plus one activation row per slot in
  use. Nothing grows past its reservation, so admission is never undone; the prefill chunk gets
  what the reservations leave.
* Paged (the runner reads KV through block tables): one page pool per KV group, sized once
  (`EngineConfig.kv_pool_tokens` positions, else what the budget leaves after the weights and a
  chunk's activations, at most every slot's full context; a sliding group's pool is capped at
  twice what every slot's window needs), and a `workbench.state.PageAllocator` over it, owned
  here. A request whose largest state can never fit the pool is refused at `add`. A request is
  admitted when a slot is free and the pages for its prompt plus `admission_headroom_tokens` are
  available; its prompt's cached prefix (prefix cache) is taken by refcount and its prefill
  starts after it.
  Each step, before anything runs, every planned segment gets its pages (`append`), oldest
  admission first; a prefill chunk that cannot get them all shrinks (chunk invariance makes any
  chunking exact) or waits a step. When a decode row cannot get a page, the most recently
  admitted running request is preempted: its pages are freed, it goes back to the front of the
  queue and is later re-prefilled with its prompt and the tokens it had generated. The last of
  those re-prefilled rows samples its next token, so no committed token is drawn twice (a seeded
  generator is advanced once per committed token, preempted or not), and chunk invariance makes
  the recomputed KV, hence every later token and logit, bitwise what it would have been.
  After each step the written tokens are committed (full pages join the prefix cache).
  Step ids fence every release (`PageAllocator.free(fence=)`); the engine retires a step once
  the device is done with it (`retire`).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Mapping, Protocol

from .engine_config import EngineConfig
from .errors import WorkbenchError
from .planner import BatchPlanner, ChunkSizer, PrefillChunk, SlotView, StepPlan, format_bytes
from .slots import SlotTable
from .state import PageAllocator, PageCopy


class RunnerInfo(Protocol):
    """What the scheduler needs to know about the runner (the model on its device).

    Optional: `supports_fused_step: bool` (default True), whether decode rows and prefill
    chunks may share one forward; `paged: bool` (default False), whether it reads KV through
    block tables (then the scheduler owns a PageAllocator, every Segment carries its
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
    reserved_bytes: int
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
        self.paged = bool(getattr(runner_info, "paged", False))
        self.allocator: PageAllocator | None = None
        self._preempted: dict[Hashable, _Sequence] = {}  # waiting again after a preemption
        self._copies: dict[int, tuple[PageCopy, ...]] = {}  # slot -> copies for the pending plan
        self._step_id: int | None = None  # the newest step handed out (its fence), None before any
        self._num_preemptions = 0  # since the previous step_stats()
        self.kv_pool_pages: dict[str, int] = {}
        self.kv_pool_bytes = 0
        if self.paged:
            self._init_pool()

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def reserved_cache_bytes(self) -> int:
        if self.paged:  # the pool is allocated once, whole
            return self.kv_pool_bytes
        return sum(s.reserved_bytes for s in self._running.values())

    @property
    def kv_bytes_in_use(self) -> int:
        """Paged: bytes of the pages held by running requests (0 for a runner with slot state)."""
        if not self.paged:
            return 0
        lay = self.allocator.layout
        return sum(pool.num_used * lay.page_bytes(name) for name, pool in self.allocator.pools.items())

    def step_stats(self) -> dict[str, Any]:
        """Paged: the pool's pages (used, free, cached, allocated and freed since the previous
        read, per group and in total), prefix-hit tokens and preemptions since the previous read.
        Without pages, the same columns as None."""
        keys = ("pages_used", "pages_free", "pages_cached", "pages_allocated", "pages_freed",
                "prefix_hit_tokens", "num_preemptions")
        if not self.paged:
            return dict.fromkeys(keys)
        st = self.allocator.read_stats()
        out: dict[str, Any] = st.record()
        for key in ("used", "free", "cached", "allocated", "freed"):
            out[f"pages_{key}"] = sum(getattr(g, f"num_{key}") for g in st.groups)
        out["num_preemptions"], self._num_preemptions = self._num_preemptions, 0
        return out

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
        if self.paged:
            self._check_fits_pool(request)
        need = self.runner.fixed_bytes + self._cache_bytes(request) + self.runner.bytes_per_prefill_row
        if not self.paged and need > self.budget_bytes:
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
        self._copies = {}
        self._admit()
        while True:
            if not self._running:
                return None
            plan = self._plan()
            if not self.paged:
                break
            fitted = self._fit(plan, self._step_id)
            if fitted is None and not plan.decode_groups and len(plan.prefill_chunks) < len(self._running):
                # prefill-first, and no chunk can get a page: the decode rows it held back run
                fitted = self._fit(self._plan("decode-first"), self._step_id)
            if fitted is not None:
                plan = fitted
                break
            self._preempt(max(self._running, key=lambda slot: self._running[slot].admitted))
        if step_id is None:
            step_id = 0 if self._step_id is None else self._step_id + 1
        self._step_id = step_id
        self._pending = plan
        return plan

    def retire(self, step_id: int) -> None:
        """The device is done with step `step_id` (and every earlier one): pages it could still
        touch are released (paged; nothing otherwise)."""
        if self.paged:
            self.allocator.retire(step_id)

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
                if self.paged:  # the fed token's KV is written
                    self.allocator.commit(self._running[slot].request.request_id, self._running[slot].output_ids[-1:])
                events += self._append(slot, token)
        for chunk in plan.prefill_chunks:
            s = self._running[chunk.slot_id]
            if self.paged:
                self.allocator.commit(s.request.request_id, s.prefill_ids[chunk.start : chunk.start + chunk.length])
            s.num_prefilled += chunk.length
            if s.num_prefilled == s.prefill_len:
                events += self._append(chunk.slot_id, _need(sampled, chunk.slot_id))
        return events

    # -- internals -------------------------------------------------------------------------

    def _cache_bytes(self, request: Request) -> int:
        return self.runner.cache_bytes(self._max_context(request))

    def _max_context(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.max_tokens, self.capacity)

    def _admit(self) -> None:
        """Admit from the head of the queue (FIFO, no overtaking) while a slot and memory allow."""
        if self.paged:
            return self._admit_paged()
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
            self._running[slot] = _Sequence(request, slot, self._max_context(request), cache,
                                            admitted=next(self._admissions))

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

    def _release(self, slot: int, fence: int | None) -> None:
        s = self._running.pop(slot)
        self.slots.free(slot)
        if self.paged:
            self.allocator.free(s.request.request_id, fence)

    def _decode_segment(self, slot: int) -> Segment:
        s = self._running[slot]
        return Segment(slot, s.request.request_id, (s.output_ids[-1],), s.context_len, True,
                       *self._paging(slot))

    def _prefill_segment(self, chunk: PrefillChunk) -> Segment:
        s = self._running[chunk.slot_id]
        end = chunk.start + chunk.length
        tokens = s.prefill_ids[chunk.start : end]
        return Segment(chunk.slot_id, s.request.request_id, tokens, chunk.start, end == s.prefill_len,
                       *self._paging(chunk.slot_id))

    # -- paging ----------------------------------------------------------------------------

    def _paging(self, slot: int) -> tuple:
        if not self.paged:
            return ()
        rid = self._running[slot].request.request_id
        tables = {g: tuple(self.allocator.block_table(rid, g).ids()) for g in self.allocator.layout.group_names}
        return tables, self._copies.get(slot, ())

    @property
    def _chunk_bound(self) -> int:
        """The most positions one prefill append adds (bounds a sliding group's live pages)."""
        return self.config.chunk_size or self.config.chunk_cap

    def _init_pool(self) -> None:
        layout = self.runner.state_layout
        P = layout.page_size
        page_bytes = sum(layout.page_bytes(g) for g in layout.group_names)
        fixed = self.runner.fixed_bytes
        tokens = self.config.kv_pool_tokens
        if tokens is None:
            # what the budget leaves after the weights and a chunk's (plus the decode rows')
            # activations, at most every slot's full context: more would never be used
            rows = self.runner.bytes_per_prefill_row * (self._chunk_bound + self.config.max_concurrency)
            room = self.budget_bytes - fixed - rows
            most = self.config.max_concurrency * -(-self.capacity // P) * P
            tokens = min(max(room, 0) // page_bytes * P, most)
            if tokens < P:
                raise WorkbenchError(
                    f"memory budget {format_bytes(self.budget_bytes)} leaves {format_bytes(max(room, 0))} for the "
                    f"KV pool after the fixed {format_bytes(fixed)} and a chunk's activations: allowed at least "
                    f"one page of {P} positions ({format_bytes(page_bytes)})")
        n = -(-tokens // P)
        # A sliding group never holds more than a window (plus a chunk) of pages a sequence:
        # its pool is capped at twice that for every slot (the rest is room for cached pages).
        self.kv_pool_pages = {
            g.name: min(n, 2 * self.config.max_concurrency * layout.max_live_pages(g.name, self.capacity, self._chunk_bound))
            if g.sliding else n for g in layout.groups}
        self.kv_pool_bytes = sum(k * layout.page_bytes(g) for g, k in self.kv_pool_pages.items())
        need = fixed + self.kv_pool_bytes + self.runner.bytes_per_prefill_row
        if need > self.budget_bytes:
            raise WorkbenchError(
                f"kv_pool_tokens={tokens} takes {format_bytes(self.kv_pool_bytes)}; with the fixed "
                f"{format_bytes(fixed)} and one row it exceeds the memory budget {format_bytes(self.budget_bytes)}")
        self.allocator = PageAllocator(layout, self.kv_pool_pages, prefix_cache=self.config.prefix_cache,
                                       cache_key=self.runner.kv_cache_key)

    def _check_fits_pool(self, request: Request) -> None:
        """Refuse a request whose largest state can never fit the pool, even alone."""
        n = self._max_context(request)
        P = self.allocator.page_size
        for group, need in self.allocator.pages_for_prompt(n, chunk=self._chunk_bound).items():
            have = self.kv_pool_pages[group]
            if need > have:
                raise WorkbenchError(
                    f"request {request.request_id!r} needs {need} pages ({need * P} positions) of KV group "
                    f"{group!r} for {n} tokens but the KV pool holds {have} pages ({have * P} tokens): "
                    f"raise kv_pool_tokens or lower max_tokens")

    def _admit_paged(self) -> None:
        """FIFO admission while a slot is free and the pages for the head's prompt (what it has
        to prefill, less its cached prefix) plus the headroom are available."""
        alloc = self.allocator
        while self._waiting and self.slots.can_allocate():
            request = self._waiting[0]
            rid = request.request_id
            prev = self._preempted.get(rid)
            tokens = request.prompt_ids + tuple(prev.output_ids) if prev else request.prompt_ids
            match = alloc.match(tokens)
            n = min(len(tokens) + self.config.admission_headroom_tokens, self._max_context(request))
            need = alloc.pages_for_prompt(max(n, len(tokens)), match, chunk=self._chunk_bound)
            if not alloc.can_add(match) or any(need[g] > pool.num_available for g, pool in alloc.pools.items()):
                return
            self._waiting.popleft()
            cached = alloc.add(rid, match)
            slot = self.slots.allocate(rid)
            if prev is None:
                s = _Sequence(request, slot, self._max_context(request), 0, cached_tokens=cached)
            else:
                s = self._preempted.pop(rid)
                s.slot_id = slot
                s.recomputed_tokens += len(tokens) - cached
            s.prefill_ids, s.num_prefilled, s.admitted = tokens, cached, next(self._admissions)
            self._running[slot] = s

    def _preempt(self, slot: int) -> None:
        """Preemption by recompute: free the pages, back to the front of the queue."""
        s = self._running[slot]
        self._release(slot, self._step_id)
        s.num_preemptions += 1
        s.num_prefilled = 0
        self._preempted[s.request.request_id] = s
        self._waiting.appendleft(s.request)
        self._num_preemptions += 1

    def _fit(self, plan: StepPlan, fence: int | None) -> StepPlan | None:
        """Give every segment of `plan` its pages, oldest admission first: a decode row its
        next position, a prefill chunk as many of its positions as fit (shrunk, or left for a
        later step). None, with nothing allocated, when a decode row cannot get its page or
        nothing at all could run: the caller preempts and plans again."""
        alloc = self.allocator
        avail = {g: pool.num_available for g, pool in alloc.pools.items()}
        decode = {slot for g in plan.decode_groups for slot in g.slot_ids}
        chunks = {c.slot_id: c for c in plan.prefill_chunks}
        grow: dict[int, int] = {}

        def fits(rid, n):
            need = alloc.pages_needed(rid, n, fence)
            return need if all(need[g] <= avail[g] for g in avail) else None

        for slot in sorted(decode | set(chunks), key=lambda slot: self._running[slot].admitted):
            rid = self._running[slot].request.request_id
            if slot in decode:
                need = fits(rid, 1)
                if need is None:
                    return None
                n = 1
            else:
                n, need = chunks[slot].length, fits(rid, chunks[slot].length)
                if need is None:  # the longest prefix of the chunk that fits (pages grow with n)
                    lo, hi = 0, n - 1
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        lo, hi = (mid, hi) if fits(rid, mid) is not None else (lo, mid - 1)
                    n = lo
                    need = fits(rid, n) if n else None
                    if n == 0:
                        continue
            for g in avail:
                avail[g] -= need[g]
            grow[slot] = n
        if not grow:
            return None
        for slot, n in grow.items():
            copies = alloc.append(self._running[slot].request.request_id, n, fence)
            if copies:
                self._copies[slot] = tuple(copies)
        kept = tuple(replace(c, length=grow[c.slot_id]) for c in plan.prefill_chunks if c.slot_id in grow)
        if kept == plan.prefill_chunks:
            return plan
        return replace(plan, prefill_chunks=kept, fused=plan.fused and bool(kept))

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
