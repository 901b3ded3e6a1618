"""PageAllocator: page ids, refcounts and every sequence's block tables, for all KV groups.

Operations come in `can_x()` / `x()` pairs; an `x()` that cannot be done raises WorkbenchError
before it changes anything, so a refusal never leaves half an operation behind.

* `add(seq, match)`: a new sequence, starting from a prefix-cache hit (or empty);
* `append(seq, n)`: room for n more positions (pages allocated as the sequence grows);
* `commit(seq, token_ids)`: those tokens' KV is written; full pages join the prefix cache;
* `truncate(seq, new_len)`: drop positions past new_len (speculation's rollback);
* `fork(parent, child, n)`: the child shares the parent's first n positions;
* `adopt(parent, child)`: the parent takes the child's pages and tokens (token trees: the
  winning path's fork becomes the sequence), and the child is gone;
* `free(seq)`: the sequence is finished, cancelled or preempted;
* `swap_out(seq)` / `swap_in(seq)`: its private pages to the host store and back (host.py).

Writes never touch a read-only page (shared, or hashed into the prefix cache): appending into
one first copies it to a private page and returns a `PageCopy` the runner must run before
the step (copy-on-write). Fork shares full pages by refcount and gives the child a private
copy of a partial last page (a `PageCopy` too), so after a fork each sequence writes only its
own pages and the pair never need to coordinate.

Sliding groups. A query at q sees keys k with 0 <= q - k < window (attention.py's mask). An
`append(n)` at length L sets the sequence's floor to max(floor, L - max_rollback) (its first
query is at L) and frees, in each sliding group, the pages dead for every query >= floor
(`StateLayout.first_live_page`). A dropped page becomes a hole (None) and never comes back, so
`truncate` and `fork` may go down only to `min_length(seq)`: the least length whose queries
still find every page they see. That is always <= the last append's start minus max_rollback:
with max_rollback = 0 (the default) speculation can roll back everything its last append
added, which is what verify-then-accept needs; a larger max_rollback keeps that many more
positions' pages. Without sliding groups nothing is dropped and any length >= 0 is allowed.
A prefix hit starts a sequence with floor = its cached length (the first query is there).

Memory per group. Each KV group has its own PagePool, sized by the engine, with its own page
bytes (`StateLayout.page_bytes`): Gemma 3's sliding group holds 15 layers a page and the global
group 3, and the sliding group's need is bounded per sequence (`StateLayout.max_live_pages`)
while the global group's grows with the context. Separate pools let each group's tensor be a
plain [pages, layers, ...] array and be sized to its own bound; one shared id space would need
one page size in bytes for all groups. The cost: memory is not fungible between groups, so
admission asks every group (`pages_needed`, `pages_for_prompt`).

Prefix cache (per group pool, one chain of hashes for all). Only full, committed pages are
hashed. `match` finds the longest run of cached pages usable from the prompt's start, and
always leaves at least one prompt token to compute (the last prompt token must run to give
the logits), so a hit is at most floor((len - 1) / P) pages. For a sliding group a hit at h
tokens needs only the pages that the query at h can see; earlier ones may be evicted.

Pending-write protection. Every call that can release pages takes `fence`: the newest
launched step that may still touch this sequence's pages (None when none is in flight).
Pages whose refcount falls to 0 under a pending fence are quarantined until `retire(step)`.

Host backing (`num_host_pages`). `swap_out` moves each page only this sequence holds to a host
page (a `PageMove`; the device page is released under the fence like a freed one, and a hashed
one stays cached), and leaves shared pages on the device, held by reference. A paged-out
sequence cannot grow, shrink, fork or commit until `swap_in` gives it fresh device pages
(consecutive where they can be) and the moves back. `free` of a paged-out sequence hands back
its host pages too.

Allocation is deterministic, so the same calls give the same page ids, and keeps each table's
pages consecutive where it can (pages.py: a sequence's next page is the one after its last,
a first page goes where the sequence has room to grow, then LRU eviction). Plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import WorkbenchError
from .block_table import BlockTable
from .host import HostPool, PageMove
from .layout import StateLayout
from .pages import GroupStats, PageCopy, PagePool
from .prefix_cache import PrefixMatch, check_prefix, find_prefix, page_hash, root_hash
from .sequence import SequenceState
from .state_slots import SlotCopy, StateSlots


@dataclass(frozen=True)
class AllocatorStats:
    groups: tuple[GroupStats, ...]
    num_sequences: int
    prefix_hit_tokens: int  # prompt tokens served from the cache since the previous read
    num_state_used: int = 0
    num_state_free: int = 0
    num_state_quarantined: int = 0
    pages_out: int = 0  # pages moved to the host store since the previous read
    pages_in: int = 0  # pages moved back to the device since the previous read
    host_used: int = 0  # host pages held now, all groups

    def record(self) -> dict[str, int]:
        """Flat columns for a telemetry step record, e.g. pages_used_global."""
        out: dict[str, int] = {"num_sequences": self.num_sequences, "prefix_hit_tokens": self.prefix_hit_tokens}
        for g in self.groups:
            for key in ("used", "free", "cached", "quarantined", "allocated", "freed", "evicted"):
                out[f"pages_{key}_{g.group}"] = getattr(g, f"num_{key}")
        out.update(state_used=self.num_state_used, state_free=self.num_state_free,
                   state_quarantined=self.num_state_quarantined, pages_out=self.pages_out,
                   pages_in=self.pages_in, host_pages_used=self.host_used)
        return out


@dataclass(frozen=True)
class _GrowPlan:
    floor: int
    drops: dict[str, int]  # group -> first live page after the append
    net: dict[str, int]  # group -> pages the append takes from the available ones
    cow: dict[str, bool]


class PageAllocator:
    def __init__(
        self,
        layout: StateLayout,
        num_pages: Mapping[str, int],
        *,
        prefix_cache: bool = True,
        cache_key: bytes = b"",
        max_rollback: int = 0,
        num_state_slots: int = 0,
        state_versions: int = 1,
        num_host_pages: Mapping[str, int] | None = None,
        mass_reader=None,
    ):
        """`num_pages`: pages per KV group. `cache_key`: model identity + KV dtype
        (prefix_cache.cache_key). `num_state_slots`: sequences that can hold per-sequence state
        (needed when the layout has `seq_state`). `num_host_pages`: host pages per KV group
        (host backing; None: no host store, `swap_out` is refused)."""
        names = set(layout.group_names)
        if set(num_pages) != names:
            raise WorkbenchError(f"num_pages names groups {sorted(num_pages)}: allowed exactly {sorted(names)}")
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
            raise WorkbenchError(f"max_rollback={max_rollback!r} is out of range: allowed an integer >= 0")
        if layout.seq_state and num_state_slots < 1:
            raise WorkbenchError(f"num_state_slots={num_state_slots!r}: the layout has per-sequence state, allowed >= 1")
        self.layout = layout
        self.page_size = layout.page_size
        # mass_reader: scored eviction of cached pages (pages.py), else LRU
        self.pools = {name: PagePool(name, num_pages[name], mass_reader) for name in layout.group_names}
        self.prefix_cache = bool(prefix_cache)
        self.max_rollback = max_rollback
        self.root = root_hash(bytes(cache_key), layout.page_size)
        self.state = StateSlots(num_state_slots, state_versions) if layout.seq_state else None
        self._seqs: dict[Hashable, SequenceState] = {}
        self._hit_tokens = 0
        self.host: dict[str, HostPool] = {}
        if num_host_pages is not None:
            if set(num_host_pages) != names:
                raise WorkbenchError(f"num_host_pages names groups {sorted(num_host_pages)}: allowed exactly {sorted(names)}")
            self.host = {name: HostPool(name, num_host_pages[name]) for name in layout.group_names}
        self._moved = [0, 0]  # pages out, pages in since the previous read_stats()

    # -- queries ---------------------------------------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_paged_out(self) -> int:
        return sum(1 for s in self._seqs.values() if not s.resident)

    def sequence(self, seq_id: Hashable) -> SequenceState:
        if seq_id not in self._seqs:
            raise WorkbenchError(f"unknown sequence {seq_id!r}")
        return self._seqs[seq_id]

    def block_table(self, seq_id: Hashable, group: str) -> BlockTable:
        self.layout.group(group)
        return self.sequence(seq_id).tables[group]

    def min_length(self, seq_id: Hashable) -> int:
        """The least length `truncate` and `fork` accept: below it, a query would need a page
        that a sliding group has dropped."""
        seq, P, low = self.sequence(seq_id), self.page_size, 0
        for g in self.layout.groups:
            if g.sliding:
                t = seq.tables[g.name]
                first = next((i for i in range(len(t)) if t[i] is not None), len(t))
                if first:
                    low = max(low, first * P + g.window - 1)
        return low

    def state_slots(self, seq_id: Hashable) -> tuple[int, ...]:
        """The sequence's state slot ids by version (StateSlots.slots); () without state."""
        self.sequence(seq_id)
        return self.state.slots(seq_id) if self.state is not None else ()

    # -- the prefix cache ------------------------------------------------------------------

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `token_ids` that `add` can start from (see the module
        docstring); an empty match when the prefix cache is off. Changes nothing."""
        if not self.prefix_cache:
            return PrefixMatch()
        return find_prefix(self.layout, self.pools, self.root, token_ids)

    # -- add -------------------------------------------------------------------------------

    def can_add(self, match: PrefixMatch | None = None) -> bool:
        """Whether `add` can take a new sequence now (a state slot, when the layout has state;
        a hit's pages are already cached, so they need no free page)."""
        return self.state is None or self.state.can_allocate()

    def add(self, seq_id: Hashable, match: PrefixMatch | None = None) -> int:
        """A new sequence holding `match`'s pages (read-only, by refcount); returns its length,
        the prompt tokens whose prefill is skipped. `match` must come from `match()` with no
        allocating call in between (else it may be stale, which raises)."""
        if seq_id is None:
            raise WorkbenchError("seq_id=None is not allowed: give each sequence an id")
        if seq_id in self._seqs:
            raise WorkbenchError(f"sequence {seq_id!r} already exists")
        if not self.can_add(match):
            raise WorkbenchError(f"no free state slot for sequence {seq_id!r}: all {self.state.num_seqs} in use")
        match = match or PrefixMatch()
        if match.num_tokens:
            check_prefix(self.pools, match, self.page_size)
        tables = {}
        for name, pool in self.pools.items():
            entries = list(match.pages.get(name, ()))
            for page in entries:
                if page is not None:
                    pool.incref(page)
            tables[name] = BlockTable(self.page_size, entries)
        n = match.num_tokens
        seq = SequenceState(seq_id, tables, n, n, list(match.token_ids), list(match.hashes))
        if self.state is not None:
            self.state.allocate(seq_id)
            seq.has_state = True
        self._seqs[seq_id] = seq
        self._hit_tokens += n
        return n

    # -- append ----------------------------------------------------------------------------

    def pages_needed(self, seq_id: Hashable, n: int, fence: int | None = None) -> dict[str, int]:
        """Group -> how many available pages `append(seq_id, n, fence)` takes (net of the pages
        its sliding drops free at once; may be negative)."""
        return dict(self._plan_append(self.sequence(seq_id), n, fence).net)

    def can_append(self, seq_id: Hashable, n: int, fence: int | None = None) -> bool:
        plan = self._plan_append(self.sequence(seq_id), n, fence)
        return all(plan.net[name] <= pool.num_available for name, pool in self.pools.items())

    def append(self, seq_id: Hashable, n: int, fence: int | None = None) -> list[PageCopy]:
        """Room for positions [length, length + n): returns the copies to run first."""
        seq = self.sequence(seq_id)
        plan = self._plan_append(seq, n, fence)
        for name, pool in self.pools.items():
            if plan.net[name] > pool.num_available:
                raise WorkbenchError(
                    f"sequence {seq_id!r} cannot grow by {n} positions: group {name!r} needs "
                    f"{plan.net[name]} pages, {pool.num_available} available"
                )
        P, L = self.page_size, seq.length
        seq.floor = plan.floor
        copies, old = [], []
        for name, pool in self.pools.items():
            table = seq.tables[name]
            for page in table.drop_below(plan.drops[name]):
                pool.decref(page, fence)
            new = self.layout.num_pages(L + n) - len(table)
            if plan.cow[name]:  # (the page of L is the table's last: its copy continues the one before)
                dst = pool.allocate(after=table[L // P - 1] if L // P else None, want=1 + new)
                old.append((pool, table.replace(L // P, dst)))
                copies.append(PageCopy(name, old[-1][1], dst, L % P))
            for k in range(new):
                table.append(pool.allocate(after=table[-1] if len(table) else None, want=new - k))
        for pool, page in old:  # after allocating, so the copy source cannot be reused here
            pool.decref(page, fence)
        seq.length = L + n
        return copies

    def _plan_append(self, seq: SequenceState, n: int, fence: int | None) -> _GrowPlan:
        self._check_resident(seq, "grow")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WorkbenchError(f"n={n!r} positions is out of range: allowed an integer >= 1")
        P, L = self.page_size, seq.length
        floor = max(seq.floor, L - self.max_rollback)
        drops, net, cow = {}, {}, {}
        for name, pool in self.pools.items():
            table = seq.tables[name]
            lo = self.layout.first_live_page(name, floor)
            pending = pool.quarantine.is_pending(fence)
            freed = 0 if pending else sum(1 for i in range(min(lo, len(table)))
                                          if table[i] is not None and pool.refcount[table[i]] == 1)
            cow[name] = bool(L % P) and pool.is_read_only(table[L // P])
            drops[name] = lo
            net[name] = int(cow[name]) + self.layout.num_pages(L + n) - len(table) - freed
        return _GrowPlan(floor, drops, net, cow)

    # -- commit ----------------------------------------------------------------------------

    def commit(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Tokens whose KV is now written, in order after the committed ones. Each page they
        fill is hashed and, if no page holds that hash yet, joins the prefix cache."""
        seq = self.sequence(seq_id)
        self._check_resident(seq, "commit")
        token_ids = list(token_ids)
        if seq.num_committed + len(token_ids) > seq.length:
            raise WorkbenchError(
                f"sequence {seq_id!r} commits {len(token_ids)} tokens past its {seq.num_committed} committed: "
                f"allowed up to its length {seq.length}"
            )
        seq.token_ids += token_ids
        if not self.prefix_cache:
            return
        P = self.page_size
        while (len(seq.hashes) + 1) * P <= seq.num_committed:
            i = len(seq.hashes)
            h = page_hash(seq.hashes[-1] if i else self.root, seq.token_ids[i * P : (i + 1) * P])
            seq.hashes.append(h)
            for name, pool in self.pools.items():
                page = seq.tables[name][i]
                if page is None:
                    continue
                known = pool.cache.hash_of(page)
                if known is None:
                    pool.cache.register(page, h)
                elif known != h:
                    raise WorkbenchError(
                        f"sequence {seq_id!r} commits tokens for page {i} that differ from its cached content"
                    )

    # -- truncate, fork, free --------------------------------------------------------------

    def truncate(self, seq_id: Hashable, new_len: int, fence: int | None = None) -> None:
        """Drop positions new_len.. (their pages, and their committed tokens)."""
        seq = self.sequence(seq_id)
        self._check_resident(seq, "truncate")
        low = self.min_length(seq_id)
        if isinstance(new_len, bool) or not isinstance(new_len, int) or not low <= new_len <= seq.length:
            raise WorkbenchError(f"truncate to new_len={new_len!r} is out of range: allowed {low}..{seq.length}")
        keep = self.layout.num_pages(new_len)
        for name, pool in self.pools.items():
            for page in seq.tables[name].truncate(keep):
                pool.decref(page, fence)
        seq.length = new_len
        seq.floor = min(seq.floor, new_len)
        del seq.token_ids[new_len:]
        del seq.hashes[seq.num_committed // self.page_size :]

    def can_fork(self, parent_id: Hashable, num_tokens: int) -> bool:
        self.sequence(parent_id)
        partial = num_tokens % self.page_size != 0
        return (not partial or all(p.num_available >= 1 for p in self.pools.values())) and (
            self.state is None or self.state.can_allocate())

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> list[PageCopy | SlotCopy]:
        """A new sequence `child_id` whose first `num_tokens` positions are the parent's: full
        pages shared by refcount, a partial last page copied. Returns the copies to run."""
        parent = self.sequence(parent_id)
        self._check_resident(parent, "fork")
        if child_id is None or child_id in self._seqs:
            raise WorkbenchError(f"sequence {child_id!r} already exists or is not a valid id")
        low = self.min_length(parent_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not low <= num_tokens <= parent.length:
            raise WorkbenchError(f"fork at num_tokens={num_tokens!r} is out of range: allowed {low}..{parent.length}")
        if not self.can_fork(parent_id, num_tokens):
            raise WorkbenchError(f"cannot fork {parent_id!r}: no free page for its partial last page or no state slot")
        P = self.page_size
        full, rest = divmod(num_tokens, P)
        copies: list[PageCopy | SlotCopy] = []
        tables = {}
        for name, pool in self.pools.items():
            src = parent.tables[name]
            lo = self.layout.first_live_page(name, num_tokens)
            entries: list[int | None] = [None] * lo + [src[i] for i in range(lo, full)]
            for page in entries[lo:]:
                pool.incref(page)
            if rest:
                entries.append(pool.allocate(after=entries[-1] if entries else None))
                copies.append(PageCopy(name, src[full], entries[-1], rest))
            tables[name] = BlockTable(P, entries)
        tokens = parent.token_ids[:num_tokens]
        child = SequenceState(child_id, tables, num_tokens, num_tokens, tokens, parent.hashes[: len(tokens) // P])
        if self.state is not None:
            self.state.allocate(child_id)
            child.has_state = True
            copies.append(SlotCopy(self.state.slots(parent_id)[0], self.state.slots(child_id)[0]))
        self._seqs[child_id] = child
        return copies

    def adopt(self, parent_id: Hashable, child_id: Hashable, fence: int | None = None) -> None:
        """`parent_id` becomes what `child_id` is (its tables, length, floor, tokens, hashes),
        its own pages released under `fence`; `child_id` is gone. The two must agree on the
        committed tokens they share (a fork and its parent do)."""
        parent, child = self.sequence(parent_id), self.sequence(child_id)
        self._check_resident(parent, "adopt")
        self._check_resident(child, "be adopted")
        if parent.has_state or child.has_state:
            raise WorkbenchError(f"adopt {child_id!r} into {parent_id!r}: sequences with state slots are not "
                                 f"adopted (allowed: a layout without per-sequence state)")
        n = min(parent.num_committed, child.num_committed)
        if parent.token_ids[:n] != child.token_ids[:n]:
            raise WorkbenchError(f"adopt {child_id!r} into {parent_id!r}: their committed tokens differ")
        for name, pool in self.pools.items():
            for page in parent.tables[name].truncate(0):
                pool.decref(page, fence)
        parent.tables, parent.length, parent.floor = child.tables, child.length, child.floor
        parent.token_ids, parent.hashes = child.token_ids, child.hashes
        del self._seqs[child_id]

    def free(self, seq_id: Hashable, fence: int | None = None) -> None:
        """Hand back every page of a finished, cancelled or preempted sequence. Hashed pages stay
        cached; they enter the LRU deepest page first, so a chain is evicted from its tail."""
        seq = self.sequence(seq_id)
        for name, pool in self.pools.items():
            for page in seq.tables[name].truncate(0):
                pool.decref(page, fence)
        for name, pages in seq.host.items():
            for h in pages.values():
                self.host[name].free(h)
        seq.host = {}
        if seq.has_state:
            self.state.free(seq_id, fence)
        del self._seqs[seq_id]

    # -- host backing ----------------------------------------------------------------------

    def _check_resident(self, seq: SequenceState, what: str) -> None:
        if not seq.resident:
            raise WorkbenchError(f"sequence {seq.seq_id!r} is paged out: it cannot {what} until swap_in")

    def pages_to_swap_out(self, seq_id: Hashable) -> dict[str, int]:
        """Group -> host pages `swap_out` takes (the pages only this sequence holds)."""
        seq = self.sequence(seq_id)
        return {name: sum(1 for p in seq.tables[name].pages() if pool.refcount[p] == 1)
                for name, pool in self.pools.items()}

    def can_swap_out(self, seq_id: Hashable) -> bool:
        seq = self.sequence(seq_id)
        if not self.host or not seq.resident or seq.has_state:
            return False
        return all(k <= self.host[g].num_free for g, k in self.pages_to_swap_out(seq_id).items())

    def swap_out(self, seq_id: Hashable, fence: int | None = None) -> list[PageMove]:
        """Move the sequence's private pages to the host store: returns the page-outs to run
        (before anything reuses the device pages, which are released under `fence`)."""
        seq = self.sequence(seq_id)
        if not self.host:
            raise WorkbenchError("swap_out needs a host store: allowed with num_host_pages set")
        self._check_resident(seq, "be paged out again")
        if seq.has_state:  # (a hybrid model's recurrent state has no host slots yet: recompute)
            raise WorkbenchError(f"sequence {seq_id!r} holds per-sequence state: allowed to page out KV pages only")
        if not self.can_swap_out(seq_id):
            need = self.pages_to_swap_out(seq_id)
            raise WorkbenchError(f"sequence {seq_id!r} needs host pages {need}, free "
                                 f"{ {g: h.num_free for g, h in self.host.items()} }")
        moves = []
        for name, pool in self.pools.items():
            table, host = seq.tables[name], {}
            for i in range(len(table)):
                page = table[i]
                if page is not None and pool.refcount[page] == 1:
                    host[i] = self.host[name].allocate()
                    moves.append(PageMove(name, page, host[i], True))
                    table.clear(i)
                    pool.decref(page, fence)
            if host:
                seq.host[name] = host
        if not seq.host:  # (every page shared: nothing moved, but it must still swap in to run)
            seq.host = {name: {} for name in self.pools}
        self._moved[0] += len(moves)
        return moves

    def pages_to_swap_in(self, seq_id: Hashable) -> dict[str, int]:
        """Group -> device pages `swap_in` takes (0 for a resident sequence)."""
        seq = self.sequence(seq_id)
        return {name: len(seq.host.get(name, ())) for name in self.pools}

    def can_swap_in(self, seq_id: Hashable) -> bool:
        return all(k <= self.pools[g].num_available for g, k in self.pages_to_swap_in(seq_id).items())

    def swap_in(self, seq_id: Hashable) -> list[PageMove]:
        """Give a paged-out sequence fresh device pages for its host pages: returns the
        page-ins to run before its next forward."""
        seq = self.sequence(seq_id)
        if seq.resident:
            raise WorkbenchError(f"sequence {seq_id!r} is resident: nothing to swap in")
        if not self.can_swap_in(seq_id):
            raise WorkbenchError(f"sequence {seq_id!r} needs device pages {self.pages_to_swap_in(seq_id)}, "
                                 f"available { {g: p.num_available for g, p in self.pools.items()} }")
        moves = []
        for name, host in seq.host.items():
            table, pool = seq.tables[name], self.pools[name]
            left = len(host)
            for i in sorted(host):
                prev = table[i - 1] if i else None
                page = pool.allocate(after=prev, want=left)
                left -= 1
                table.replace(i, page)
                moves.append(PageMove(name, page, host[i], False))
                self.host[name].free(host[i])
        seq.host = {}
        self._moved[1] += len(moves)
        return moves

    def retire(self, step_id: int) -> None:
        """Step `step_id` (and every earlier one) has finished on the device: release what was
        quarantined under it."""
        for pool in self.pools.values():
            pool.retire(step_id)
        if self.state is not None:
            self.state.retire(step_id)

    # -- admission, telemetry, checks ------------------------------------------------------

    def pages_for_prompt(self, num_tokens: int, match: PrefixMatch | None = None, chunk: int | None = None) -> dict[str, int]:
        """Group -> an upper bound on the available pages a new sequence takes to prefill
        `num_tokens` positions in appends of at most `chunk` (default: one append): the hit's
        pages that leave the LRU plus the new pages, at most the pages it holds at once (a
        sliding group's hit pages are among those: counting them beside a full window's new
        pages asked a sliding pool for more than it holds, and a request whose prompt shared a
        cached prefix waited at the head of the queue for ever: tests/test_paged_scheduler.py's
        soak found it). Never more than `max_live_pages`, which `add` checks against the pool,
        so an empty pool always admits."""
        h = match.num_tokens if match else 0
        chunk = chunk or max(1, num_tokens - h)
        out = {}
        for name, pool in self.pools.items():
            hit = [p for p in (match.pages.get(name, ()) if match else ()) if p is not None]
            claimed = sum(1 for p in hit if pool.refcount[p] == 0)
            new = self.layout.num_pages(num_tokens) - h // self.page_size
            live = self.layout.max_live_pages(name, num_tokens, chunk, self.max_rollback)
            out[name] = min(claimed + max(0, new), live)
        return out

    def read_stats(self) -> AllocatorStats:
        """A snapshot per group; counters of what changed restart at zero with each read."""
        hits, self._hit_tokens = self._hit_tokens, 0
        (out, into), self._moved = self._moved, [0, 0]
        st = self.state
        return AllocatorStats(
            tuple(pool.read_stats() for pool in self.pools.values()), len(self._seqs), hits,
            st.num_used if st else 0, st.num_free if st else 0, st.num_quarantined if st else 0,
            out, into, sum(h.num_used for h in self.host.values()))

    def check(self) -> None:
        """Assert every invariant (tests call this after each operation)."""
        P = self.page_size
        for name, pool in self.pools.items():
            pool.check()
            holders: dict[int, set[int]] = {}  # page -> logical indices it is held at
            refs = [0] * pool.num_pages
            host_held = []
            for seq in self._seqs.values():
                t = seq.tables[name]
                on_host = seq.host.get(name, {})
                host_held += on_host.values()
                assert all(t[i] is None for i in on_host), f"{seq.seq_id!r}: a page both on the host and the device"
                present = [t[i] is not None or i in on_host for i in range(len(t))]
                assert len(t) == self.layout.num_pages(seq.length), f"{seq.seq_id!r}: table length"
                lo = self.layout.first_live_page(name, seq.floor)
                first = next((i for i in range(len(t)) if present[i]), len(t))
                assert first <= lo, f"{seq.seq_id!r}: a page a query >= its floor sees is missing"
                assert all(present[first:]), f"{seq.seq_id!r}: a hole after a page"
                assert len(set(t.pages())) == len(t.pages()), f"{seq.seq_id!r}: a page held twice"
                for i, page in enumerate(t.entries):
                    if page is not None:
                        refs[page] += 1
                        holders.setdefault(page, set()).add(i)
                        if i < len(seq.hashes) and pool.cache.hash_of(page) is not None:
                            assert pool.cache.hash_of(page) == seq.hashes[i], "a page's hash is not its prefix's"
            assert refs == pool.refcount, f"group {name!r}: refcounts differ from the block tables"
            if self.host:
                assert len(set(host_held)) == len(host_held), f"group {name!r}: a host page held twice"
                assert len(host_held) == self.host[name].num_used, f"group {name!r}: host pages leaked"
            assert all(len(ix) == 1 for ix in holders.values()), "a page is held at two logical positions"
        for seq in self._seqs.values():
            assert 0 <= seq.floor <= seq.length and seq.num_committed <= seq.length
            if self.prefix_cache:
                assert len(seq.hashes) == seq.num_committed // P
            assert seq.has_state == (self.state is not None)
        if self.state is not None:
            self.state.check()
            assert self.state.num_used == len(self._seqs)
