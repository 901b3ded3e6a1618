"""CacheMemory: the memory of the sequences' caches, in the form the runner needs.

The scheduler decides who waits, who runs and who is preempted; the memory form answers what
memory allows: whether the head of the queue fits now, how much of a planned step gets its
memory, and what a sequence hands back. The form is chosen by the runner (`RunnerInfo.paged`):

* `ReservedMemory` (a runner with per-slot contiguous state): a request is admitted when the
  budget can reserve, on top of the fixed bytes and the caches already reserved, its full cache
  (prompt + max_tokens, capped at the slot capacity) plus one activation row per slot in use.
  Nothing grows past its reservation, so every plan fits as planned and admission is never
  undone; the prefill chunk gets what the reservations leave.
* `PagedMemory` (the runner reads KV through block tables): one page pool per KV group, sized
  once: a sliding group's pool holds what every slot's window spans plus a chunk's pages, a
  global group's `EngineConfig.kv_resident_tokens` positions, else what the budget leaves after the
  weights, a chunk's activations and the sliding pools (at most every slot's full context); and
  a `workbench.state.PageAllocator` over them, owned here. A request whose largest state can
  never fit the pool is refused at `add`. A request is admitted when the pages for its prompt
  plus `admission_headroom_tokens` are available; its prompt's cached prefix (prefix cache) is taken by refcount and its prefill
  starts after it.
  Each step, before anything runs, every planned segment gets its pages (`append`), oldest
  admission first; a prefill chunk that cannot get them all shrinks (chunk invariance makes any
  chunking exact) or waits a step; a verify's draft rows shrink to what fits (to none: then it
  decodes); a decode row that cannot get a page fails the fit, and the scheduler preempts.
  A verify's rejected rows are truncated at commit (`truncate`). After each step the written tokens are committed (full pages join the
  prefix cache). Step ids fence every release (`PageAllocator.free(fence=)`); the engine
  retires a step once the device is done with it (`retire`).

Sequences are named by their request id. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Protocol, Sequence

from .engine_config import EngineConfig
from .errors import WorkbenchError
from .planner import StepPlan, format_bytes
from .spec.config import MAX_PATHS
from .state import PageAllocator, PageCopy, PageMove

if TYPE_CHECKING:
    from .scheduler import RunnerInfo

# the step record's memory columns; a form without pages reports them as None
STEP_STAT_KEYS = ("pages_used", "pages_free", "pages_cached", "pages_allocated", "pages_freed",
                  "prefix_hit_tokens", "num_preemptions")
# host backing's columns (PagedMemory with a host store; None without one): pages and bytes
# moved to the host store and back, sequences paged out and in, held on the host now
RESIDENCY_STAT_KEYS = ("pages_out", "pages_in", "bytes_out", "bytes_in", "swaps_out", "swaps_in",
                       "paged_out_seqs", "host_pages_used")


class CacheMemory(Protocol):
    """What the scheduler asks of a memory form."""

    @property
    def reserved_bytes(self) -> int:
        """Cache bytes set aside now (what the chunk sizer subtracts from the budget)."""

    @property
    def bytes_in_use(self) -> int:
        """Cache bytes the running sequences hold (0 when that is not tracked)."""

    def check_fits(self, seq_id: Hashable, max_context: int) -> None:
        """Raise when a request of `max_context` tokens could never run, even alone (at `add`)."""

    def admit(self, seq_id: Hashable, token_ids: Sequence[int], max_context: int) -> int | None:
        """The tokens it prefills before its cached prefix: admitted, or None (not now)."""

    def fit(self, plan: StepPlan, seq_ids: Mapping[int, Hashable], fence: int | None) -> StepPlan | None:
        """Give every segment of `plan` its memory (`seq_ids`: slot -> sequence of every
        running slot, oldest admission first): the plan, shrunk where a prefill chunk got part,
        or None, with nothing taken, when the scheduler has to preempt."""

    def segment_fields(self, seq_id: Hashable) -> tuple:
        """The trailing fields of the sequence's `Segment` (block tables, copies); () for none."""

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The step wrote `token_ids` (the next positions of the sequence)."""

    def truncate(self, seq_id: Hashable, new_len: int, fence: int | None) -> None:
        """Drop the sequence's positions from `new_len` on (a verify's rejected draft rows),
        whose pages steps up to `fence` may still touch."""

    def release(self, seq_id: Hashable, fence: int | None, *, preempted: bool = False) -> None:
        """The sequence finished, was cancelled or was preempted: hand back its memory, which
        steps up to `fence` may still touch."""

    def retire(self, step_id: int) -> None:
        """The device is done with step `step_id` and every earlier one."""

    def step_stats(self) -> dict[str, Any]:
        """The step record's memory columns (`STEP_STAT_KEYS`, maybe more), counted since the
        previous read."""


class ReservedMemory:
    """Each sequence reserves its full cache at admission (see the module docstring)."""

    def __init__(self, runner: RunnerInfo, budget_bytes: int):
        self.runner = runner
        self.budget_bytes = budget_bytes
        self._reserved: dict[Hashable, int] = {}  # sequence -> its cache bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    @property
    def bytes_in_use(self) -> int:
        return 0

    def check_fits(self, seq_id: Hashable, max_context: int) -> None:
        need = self.runner.fixed_bytes + self.runner.cache_bytes(max_context) + self.runner.bytes_per_prefill_row
        if need > self.budget_bytes:
            raise WorkbenchError(
                f"request {seq_id!r} needs {format_bytes(need)} alone but the memory budget is "
                f"{format_bytes(self.budget_bytes)}"
            )

    def admit(self, seq_id: Hashable, token_ids: Sequence[int], max_context: int) -> int | None:
        cache = self.runner.cache_bytes(max_context)
        need = (
            self.runner.fixed_bytes
            + self.reserved_bytes
            + cache
            + self.runner.bytes_per_prefill_row * (len(self._reserved) + 1)
        )
        if need > self.budget_bytes:
            return None
        self._reserved[seq_id] = cache
        return 0

    def fit(self, plan: StepPlan, seq_ids: Mapping[int, Hashable], fence: int | None) -> StepPlan:
        # every sequence holds its whole reservation; token trees need forks of paged state
        return replace(plan, branches={}) if plan.branches else plan

    def segment_fields(self, seq_id: Hashable) -> tuple:
        return ()

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        pass

    def truncate(self, seq_id: Hashable, new_len: int, fence: int | None) -> None:
        pass  # (positions past a slot's length are overwritten before anything reads them)

    def release(self, seq_id: Hashable, fence: int | None, *, preempted: bool = False) -> None:
        if preempted:
            raise RuntimeError(f"sequence {seq_id!r} preempted: reserved memory fits every plan")
        del self._reserved[seq_id]

    def retire(self, step_id: int) -> None:
        pass

    def step_stats(self) -> dict[str, Any]:
        return dict.fromkeys(STEP_STAT_KEYS)


class PagedMemory:
    """One page pool per KV group and the allocator over it (see the module docstring).

    `pool_pages` (group -> pages) is what the runner allocates (`init_kv_pool`)."""

    def __init__(self, config: EngineConfig, runner: RunnerInfo, budget_bytes: int, capacity: int):
        """`capacity`: the most context tokens a sequence holds."""
        self.config = config
        self.capacity = capacity
        # the most positions one prefill append adds (bounds a sliding group's live pages)
        self.chunk_bound = config.chunk_size or config.chunk_cap
        self._copies: dict[Hashable, tuple[PageCopy, ...]] = {}  # sequence -> copies for the fitted plan
        self._branches: dict[Hashable, list[Hashable]] = {}  # token trees: sequence -> its paths' forks
        self._num_preemptions = 0  # since the previous step_stats()
        layout = runner.state_layout
        P = layout.page_size
        fixed = runner.fixed_bytes
        # A sliding group needs, for every slot, the pages its window spans in decode, and for the
        # step's prefill rows (at most a chunk, however they are split) a chunk's pages more: its
        # pool is that, never more than the global pools' positions. The global groups take the
        # rest of the memory (they grow with the context). Pools are per group (allocator.py says
        # why), so a pool sized for more sliding pages than the slots can use would be memory the
        # global groups never get: the measured capacity cost of sizing every group alike.
        chunk_pages = -(-self.chunk_bound // P) + 1
        # token trees: each alternative path's fork takes a copy of the partial last page and the
        # pages its rows reach, in every group (a sliding group's pool is sized tight: these too)
        spec = config.speculation
        fork_pages = 0
        if spec is not None and spec.tree is not None:
            alternatives = min(MAX_PATHS, spec.tree) - 1
            fork_pages = config.max_concurrency * alternatives * (1 + -(-(spec.k + 1) // P))
        sliding = {g.name: config.max_concurrency * layout.max_live_pages(g.name, capacity) + chunk_pages + fork_pages
                   for g in layout.groups if g.sliding}
        tokens = config.kv_resident_tokens
        if tokens is None:
            # what the budget leaves after the weights and a chunk's (plus the decode rows')
            # activations, at most every slot's full context: more would never be used
            rows = runner.bytes_per_prefill_row * (self.chunk_bound + config.max_concurrency)
            room = max(budget_bytes - fixed - rows, 0)
            most = config.max_concurrency * -(-capacity // P) + fork_pages
            global_page_bytes = sum(layout.page_bytes(g.name) for g in layout.groups if not g.sliding)
            # the sliding pools first, at most half the room (short of that they shrink alike)
            side = sum(k * layout.page_bytes(g) for g, k in sliding.items())
            scale = min(1.0, room / 2 / side) if side else 1.0
            sliding = {g: max(1, int(k * scale)) for g, k in sliding.items()}
            side = sum(k * layout.page_bytes(g) for g, k in sliding.items())
            n = min((room - side) // global_page_bytes, most) if global_page_bytes else most
            tokens = n * P
            if n < 1:
                raise WorkbenchError(
                    f"memory budget {format_bytes(budget_bytes)} leaves {format_bytes(room)} for the "
                    f"KV pool after the fixed {format_bytes(fixed)} and a chunk's activations: allowed at least "
                    f"one page of {P} positions in every KV group")
        n = -(-tokens // P)
        self.pool_pages: dict[str, int] = {g.name: min(n, sliding[g.name]) if g.sliding else n for g in layout.groups}
        self.pool_bytes = sum(k * layout.page_bytes(g) for g, k in self.pool_pages.items())
        need = fixed + self.pool_bytes + runner.bytes_per_prefill_row
        if need > budget_bytes:
            raise WorkbenchError(
                f"kv_resident_tokens={tokens} takes {format_bytes(self.pool_bytes)}; with the fixed "
                f"{format_bytes(fixed)} and one row it exceeds the memory budget {format_bytes(budget_bytes)}")
        # the host store (host backing): a global group's kv_host_tokens positions, a sliding
        # group's what every slot's window spans (a paged-out sequence holds at most that)
        self.host_pages: dict[str, int] = {}
        if config.kv_host_tokens is not None:
            h = -(-config.kv_host_tokens // P)
            self.host_pages = {g.name: config.max_concurrency * layout.max_live_pages(g.name, capacity)
                               if g.sliding else h for g in layout.groups}
        self._moves: list[PageMove] = []  # this step's page-outs and page-ins, in order
        self._targets: dict[Hashable, int] = {}  # host backing: admitted sequence -> its admission target
        # admitted before their pages were free (admit_waiting): sequence -> (tokens, admission target)
        self._waiting: dict[Hashable, tuple] = {}
        self._swaps = [0, 0]  # sequences paged out, paged in since the previous step_stats()
        self._bytes = [0, 0]  # bytes paged out, paged in since then
        # eviction="scored": cached prefix pages leave by the attention mass they received, which
        # the runner measures (take_page_mass); "lru": the least recently used first
        self.allocator = PageAllocator(layout, self.pool_pages, prefix_cache=config.prefix_cache,
                                       cache_key=runner.kv_cache_key,
                                       num_host_pages=self.host_pages or None,
                                       mass_reader=runner.take_page_mass if config.eviction == "scored" else None)

    @property
    def reserved_bytes(self) -> int:
        return self.pool_bytes  # the pool is allocated once, whole

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the pages held by running sequences."""
        lay = self.allocator.layout
        return sum(pool.num_used * lay.page_bytes(name) for name, pool in self.allocator.pools.items())

    def check_fits(self, seq_id: Hashable, max_context: int) -> None:
        """Refuse a request whose largest state can never fit the pool, even alone."""
        n = max_context
        P = self.allocator.page_size
        for group, need in self.allocator.pages_for_prompt(n, chunk=self.chunk_bound).items():
            have = self.pool_pages[group]
            if need > have:
                raise WorkbenchError(
                    f"request {seq_id!r} needs {need} pages ({need * P} positions) of KV group "
                    f"{group!r} for {n} tokens but the KV pool holds {have} pages ({have * P} tokens): "
                    f"raise kv_resident_tokens or lower max_tokens")
        # host backing: it must be able to page out alone (a sliding group's store holds every
        # slot's window, so only a global group's can be short)
        for group, have in self.host_pages.items():
            need = self.allocator.layout.max_live_pages(group, n)
            if need > have:
                raise WorkbenchError(
                    f"request {seq_id!r} needs {need} host pages ({need * P} positions) of KV group {group!r} "
                    f"for {n} tokens but the host store holds {have}: allowed kv_host_tokens >= {need * P}, "
                    f"or lower max_tokens")

    def admit(self, seq_id: Hashable, token_ids: Sequence[int], max_context: int) -> int | None:
        """Admitted when the pages for `token_ids` (what it has to prefill, less its cached
        prefix) plus the headroom are available. With host backing, beyond those promised too:
        what the admitted sequences still need to reach their own prompt plus headroom (they
        take their pages as they prefill, so without this every slot would be admitted against
        the same free pages, and those that get none in `fit` would wait without ever turning
        over; host backing admits them waiting instead, `admit_waiting`). (Without host backing
        the promise was measured and lost: scripts/capacity.py's mean concurrency fell from 4.18
        to 3.48 on tests/test_capacity_script.py's workload, a promise holding pages a later
        step frees; there a request that gets no pages simply waits.)"""
        alloc = self.allocator
        match = alloc.match(token_ids)
        target = self._target(token_ids, max_context)
        need = alloc.pages_for_prompt(target, match, chunk=self.chunk_bound)
        promised = self._promised() if self.has_host else dict.fromkeys(alloc.pools, 0)
        if not alloc.can_add(match) or any(need[g] + promised[g] > pool.num_available
                                           for g, pool in alloc.pools.items()):
            return None
        cached = alloc.add(seq_id, match)
        if self.has_host:
            self._targets[seq_id] = target
        return cached

    def _target(self, token_ids: Sequence[int], max_context: int) -> int:
        """The positions admission counts for a sequence: its prefill plus the headroom, at most
        its context (never less than the prefill)."""
        return max(min(len(token_ids) + self.config.admission_headroom_tokens, max_context), len(token_ids))

    def _promised(self, exclude: set = frozenset()) -> dict[str, int]:
        """Group -> pages the resident admitted sequences (but `exclude`) will still take to
        reach their admission target (prompt plus headroom)."""
        alloc = self.allocator
        out = dict.fromkeys(alloc.pools, 0)
        for seq_id, target in self._targets.items():
            if seq_id in exclude:
                continue
            seq = alloc.sequence(seq_id)
            left = target - seq.length
            if left > 0 and seq.resident:  # (a sliding group's share: at most its window and a chunk)
                for g, k in alloc.pages_needed(seq_id, left).items():
                    live = alloc.layout.max_live_pages(g, target, self.chunk_bound)
                    out[g] += max(0, min(k, live))
        return out

    def fit(self, plan: StepPlan, seq_ids: Mapping[int, Hashable], fence: int | None) -> StepPlan | None:
        """A decode row gets its next position, a prefill chunk as many of its positions as fit
        (shrunk, or left for a later step). None, with nothing allocated, when a decode row
        cannot get its page or nothing at all could run."""
        alloc = self.allocator
        self._copies = {}
        avail = {g: pool.num_available for g, pool in alloc.pools.items()}
        decode = {slot for g in plan.decode_groups for slot in g.slot_ids}
        chunks = {c.slot_id: c for c in plan.prefill_chunks}
        grow: dict[int, int] = {}

        def fits(rid, n):
            need = alloc.pages_needed(rid, n, fence)
            return need if all(need[g] <= avail[g] for g in avail) else None

        drafts = dict(plan.drafts)
        for slot, rid in seq_ids.items():  # oldest admission first
            if slot in decode:
                # a verify's rows where they fit; short of pages its draft shrinks, to none
                n = 1 + len(drafts.get(slot, ()))
                need = fits(rid, n)
                while need is None and n > 1:
                    n -= 1
                    need = fits(rid, n)
                if need is None:
                    return None
                if slot in drafts:
                    drafts[slot] = drafts[slot][: n - 1]
                    if n == 1:
                        del drafts[slot]
            elif slot in chunks:
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
            else:
                continue
            for g in avail:
                avail[g] -= need[g]
            grow[slot] = n
        if not grow:
            return None
        # token trees: each alternative path of a slot whose draft kept its rows, where its fork
        # fits in what the step's own rows left (oldest admission first; a path is optional)
        branches = {}
        P = alloc.page_size
        for slot, rid in seq_ids.items():
            if slot not in plan.branches or slot not in drafts or grow.get(slot) != 1 + len(drafts[slot]):
                continue  # (no tree, or its draft was cut for pages)
            seq, ok = alloc.sequence(rid), []
            L = seq.length
            if L != seq.num_committed:  # (positions a discarded plan appended: no tree this step)
                continue
            for path in plan.branches[slot]:
                need = -(-(L + 1 + len(path)) // P) - L // P  # the partial page's copy and the new pages
                if not alloc.can_fork(rid, L) or any(need > avail[g] for g in avail):
                    break
                for g in avail:
                    avail[g] -= need
                ok.append(path)
            if ok:
                branches[slot] = tuple(ok)
        # the forks first: each copies the partial last page as the context left it, before the
        # step's own append may move that page (copy-on-write) or its rows are written
        for slot, paths in branches.items():
            rid = seq_ids[slot]
            L = alloc.sequence(rid).length  # (no append has run yet: the length checked above)
            for b, path in enumerate(paths, 1):
                child = _branch_id(rid, b)
                copies = alloc.fork(rid, child, L)
                copies += alloc.append(child, 1 + len(path), fence)
                self._copies[child] = tuple(copies)
                self._branches.setdefault(rid, []).append(child)
        for slot, n in grow.items():
            copies = alloc.append(seq_ids[slot], n, fence)
            if copies:
                self._copies[seq_ids[slot]] = tuple(copies)
        kept = tuple(replace(c, length=grow[c.slot_id]) for c in plan.prefill_chunks if c.slot_id in grow)
        if kept == plan.prefill_chunks and drafts == plan.drafts and branches == plan.branches:
            return plan
        return replace(plan, prefill_chunks=kept, fused=plan.fused and bool(kept), drafts=drafts, branches=branches)

    # -- token trees: each alternative path's fork (speculator.py) ------------------------------

    def branch_fields(self, seq_id: Hashable, b: int) -> tuple:
        """Segment fields (block tables, copies) of path b >= 1 of `seq_id`'s tree this step."""
        return self.segment_fields(_branch_id(seq_id, b))

    def settle_branches(self, seq_id: Hashable, winner: int, fence: int | None) -> None:
        """After the verify: path `winner`'s fork becomes the sequence's pages (0: the
        sequence's own stay), and every other fork is freed under `fence`."""
        for child in self._branches.pop(seq_id, ()):
            if child == _branch_id(seq_id, winner):
                self.allocator.adopt(seq_id, child, fence)
            else:
                self.allocator.free(child, fence)

    def drop_branches(self, fence: int | None) -> None:
        """Free every fork still held (a plan discarded before its commit)."""
        for rid in list(self._branches):
            self.settle_branches(rid, 0, fence)

    def segment_fields(self, seq_id: Hashable) -> tuple:
        tables = {g: tuple(self.allocator.block_table(seq_id, g).ids()) for g in self.allocator.layout.group_names}
        return tables, self._copies.get(seq_id, ())

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self.allocator.commit(seq_id, token_ids)

    def truncate(self, seq_id: Hashable, new_len: int, fence: int | None) -> None:
        self.allocator.truncate(seq_id, new_len, fence)

    def release(self, seq_id: Hashable, fence: int | None, *, preempted: bool = False) -> None:
        self.settle_branches(seq_id, 0, fence)
        if self._waiting.pop(seq_id, None) is None:  # (one admitted waiting holds nothing)
            self.allocator.free(seq_id, fence)
        self._targets.pop(seq_id, None)
        if preempted:
            self._num_preemptions += 1

    def retire(self, step_id: int) -> None:
        self.allocator.retire(step_id)

    # -- host backing (workbench/state/host.py) ---------------------------------------------

    @property
    def has_host(self) -> bool:
        return bool(self.host_pages)

    def can_swap_out(self, seq_id: Hashable) -> bool:
        return self.has_host and self.allocator.can_swap_out(seq_id)

    def swap_out(self, seq_id: Hashable, fence: int | None) -> None:
        """Page the sequence out: its private pages to the host store (the moves queue for the
        step), its device pages released under `fence`."""
        self._queue(self.allocator.swap_out(seq_id, fence), 0)

    def admit_waiting(self, seq_id: Hashable, token_ids: Sequence[int], max_context: int) -> None:
        """Host backing: a request takes a slot before the pages for its prompt are free. It
        holds nothing while it waits (not even a prefix hit: waiting requests holding pages
        could hold the whole pool between them), and joins the allocator at `swap_in`."""
        self._waiting[seq_id] = (tuple(token_ids), self._target(token_ids, max_context))

    def page_in_fits(self, seq_id: Hashable, victims: Sequence[Hashable] = (), spare: bool = True) -> bool:
        """Whether the sequence's pages (`page_in_need`) plus what the resident sequences are
        still promised (as at admission) fit the available pages, once `victims` are paged out
        (their private pages back, their promises void), with (`spare`) a page to grow by in
        every group left over, so that its first step after the page-in can run beside the
        resident ones."""
        alloc = self.allocator
        need, promised = self.page_in_need(seq_id), self._promised(exclude=set(victims))
        free = {g: pool.num_available for g, pool in alloc.pools.items()}
        for v in victims:
            for g, k in alloc.pages_to_swap_out(v).items():
                free[g] += k
        return all(need[g] + promised[g] + spare <= free[g] for g in free)

    def page_in_need(self, seq_id: Hashable) -> dict[str, int]:
        """Group -> the available pages paging the sequence in takes: its host pages, or for one
        admitted waiting (`admit_waiting`) what admission would have taken, its prompt's plus
        the headroom."""
        alloc = self.allocator
        if seq_id in self._waiting:
            tokens, n = self._waiting[seq_id]
            return alloc.pages_for_prompt(n, alloc.match(tokens), chunk=self.chunk_bound)
        return alloc.pages_to_swap_in(seq_id)

    def swap_in(self, seq_id: Hashable) -> int | None:
        """Page the sequence in; for one admitted waiting, add it (with its prefix hit now) and
        return the tokens its prefill skips (None for a sequence paged in)."""
        if seq_id in self._waiting:
            tokens, target = self._waiting.pop(seq_id)
            self._targets[seq_id] = target
            return self.allocator.add(seq_id, self.allocator.match(tokens))
        self._queue(self.allocator.swap_in(seq_id), 1)
        return None

    def _queue(self, moves: list[PageMove], way: int) -> None:
        """Queue a sequence's moves for the step and count them (way 0: out, 1: in)."""
        self._moves += moves
        self._swaps[way] += 1
        self._bytes[way] += sum(self.allocator.layout.page_bytes(m.group) for m in moves)

    @property
    def num_paged_out(self) -> int:
        """Sequences paged out, and admitted ones waiting for their first pages."""
        return self.allocator.num_paged_out + len(self._waiting)

    def take_moves(self) -> tuple[PageMove, ...]:
        """The page moves queued since the previous call, in the order they must run."""
        out, self._moves = tuple(self._moves), []
        return out

    def step_stats(self) -> dict[str, Any]:
        """The pool's pages (used, free, cached, allocated and freed since the previous read, per
        group and in total), prefix-hit tokens and preemptions since the previous read."""
        st = self.allocator.read_stats()
        out: dict[str, Any] = st.record()
        for key in ("used", "free", "cached", "allocated", "freed"):
            out[f"pages_{key}"] = sum(getattr(g, f"num_{key}") for g in st.groups)
        out["num_preemptions"], self._num_preemptions = self._num_preemptions, 0
        if not self.has_host:
            out.update(dict.fromkeys(RESIDENCY_STAT_KEYS))
            return out
        out["swaps_out"], out["swaps_in"] = self._swaps
        out["bytes_out"], out["bytes_in"] = self._bytes
        self._swaps, self._bytes = [0, 0], [0, 0]
        out["paged_out_seqs"] = self.num_paged_out
        return out


def _branch_id(seq_id: Hashable, b: int) -> tuple:
    """The allocator's id of path b's fork of `seq_id` (token trees)."""
    return ("tree-path", seq_id, b)
