"""PagePool: the page ids of one KV group, their refcounts, the free runs and the quarantine.

A page is in exactly one of four states:

* free: no holder, no hash; in a free run;
* used: refcount > 0 (held by that many block-table entries; shared when > 1);
* cached: refcount 0 but hashed, so a prefix hit can take it back; evictable, LRU first;
* quarantined: refcount 0, released under a fence that is not retired yet (fences.py).

Invariant: free + used + cached + quarantined == num_pages, and the four sets are disjoint.
A page is read-only when it is shared (refcount > 1) or hashed; `PageAllocator` copies it
before writing (copy-on-write), it never writes one in place.

Allocation prefers consecutive page ids, and is deterministic. The CPU attention
(attention.py) reads a run of consecutive pages as one view of the pool and gathers (copies)
scattered ones, so a sequence's pages should lie in as few runs as possible; which ids a page
gets never changes a result, only that copy and the reproducibility of the ids. The free pages
are kept as maximal runs of consecutive ids (`FreeRuns`):

* a sequence's next page is the page right after its last one, when that page is free;
* otherwise (its first page, or the next one is taken) it starts a run where it has the most
  room to grow: in the largest free run (the lowest such on ties), at its start when it begins
  at page 0 (nothing precedes it), else halfway along, leaving the first half to whatever
  sequence ends just before it (concurrent sequences each grow into pages of their own, as in
  a file system that spreads new files); a run of several pages that fits is placed whole;
* with no free page, the least recently used cached page is evicted (its hash dropped), or with
  a `mass_reader` (eviction="scored") the cached page that received the least attention mass.

Scored eviction (`mass_reader`: (group, pages) -> the attention mass each page received since
its last read, which the read zeroes; the runner keeps it). A page whose refcount falls to 0
joins `_unscored`; before any allocation the pool reads those pages' mass in one call and adds
it to each hashed one's score (a shared page's mass from every holder, counted once, as one
page), so a page is read, and its mass zeroed, before it can be handed out again. A hashed
page taken back by a prefix hit keeps its score and adds what it receives next.

Cost per page: O(log r) amortised, r the number of free runs (a heap of runs by length with
stale entries skipped and rebuilt when they outnumber the live ones; dicts by start and end).
No operation scans the pool.

Each KV group has its own pool (see allocator.py for why). Plain Python: no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..errors import WorkbenchError
from .fences import Quarantine
from .prefix_cache import PrefixCache


@dataclass(frozen=True)
class PageCopy:
    """An instruction to the runner: copy positions [0, num_positions) of page `src` to page
    `dst` in every layer of `group` (and the group's per-page payloads, recomputing any that
    summarise the whole page). Issued by copy-on-write and by fork of a partial page."""

    group: str
    src: int
    dst: int
    num_positions: int


@dataclass(frozen=True)
class GroupStats:
    """One group's pages at the time of the read, and what changed since the previous read."""

    group: str
    num_pages: int
    num_used: int
    num_free: int
    num_cached: int
    num_quarantined: int
    num_allocated: int  # pages handed out since the previous read (free or evicted)
    num_freed: int  # pages whose refcount fell to 0 since the previous read
    num_evicted: int  # cached pages evicted since the previous read


class FreeRuns:
    """The free page ids of a pool as maximal runs [start, end) of consecutive ids.

    Two runs never touch (a freed page merges with its neighbours). `_largest` is a heap of
    (-length, start); an entry is stale once its run changed, and is dropped when it surfaces."""

    def __init__(self, num_pages: int):
        self.num_free = num_pages
        self._end = {0: num_pages}  # start -> end of each run
        self._start = {num_pages: 0}  # end -> start
        self._largest = [(-num_pages, 0)]

    def runs(self) -> list[tuple[int, int]]:
        """(start, end) of every run, lowest first."""
        return sorted(self._end.items())

    def starts_at(self, page: int) -> bool:
        """Whether a run starts at `page`: the page is free and the one before it is not."""
        return page in self._end

    def take(self, page: int) -> None:
        """Take the first page of a run (`starts_at(page)`)."""
        self._split(page, page)

    def place(self, want: int) -> int:
        """Take the first page of a new run with room for `want` pages where one fits (see
        the module docstring); the pages after it stay free, for the caller to `take` next."""
        start, n = self._peek()
        page = start if start == 0 else start + max(0, min(n // 2, n - want))
        self._split(start, page)
        return page

    def give(self, page: int) -> None:
        """A page becomes free: it joins the run that ends at it and the one that starts after it."""
        start, end = page, page + 1
        if page in self._start:
            start = self._start.pop(page)
            del self._end[start]
        if end in self._end:
            end = self._end.pop(page + 1)
            del self._start[end]
        self._add(start, end)
        self.num_free += 1
        self._tidy()

    def _split(self, start: int, page: int) -> None:
        end = self._end.pop(start)
        del self._start[end]
        if start < page:
            self._add(start, page)
        if page + 1 < end:
            self._add(page + 1, end)
        self.num_free -= 1
        self._tidy()

    def _add(self, start: int, end: int) -> None:
        self._end[start], self._start[end] = end, start
        heapq.heappush(self._largest, (start - end, start))

    def _tidy(self) -> None:
        # mostly stale: rebuilt in O(runs), which the more than `runs` pushes or takes since the
        # last rebuild pay for (amortised O(1) each)
        if len(self._largest) > 2 * len(self._end) + 16:
            self._largest = [(s - e, s) for s, e in self._end.items()]
            heapq.heapify(self._largest)

    def _peek(self) -> tuple[int, int]:
        """(start, length) of the largest run, the lowest on ties."""
        while True:
            neg, start = self._largest[0]
            if self._end.get(start) == start - neg:
                return start, -neg
            heapq.heappop(self._largest)

    def check(self) -> None:
        runs = self.runs()
        assert all(s < e for s, e in runs), "an empty run"
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(runs, runs[1:])), "free runs overlap or touch"
        assert self._start == {e: s for s, e in runs}, "the run maps disagree"
        assert sum(e - s for s, e in runs) == self.num_free, "the free count drifted"
        assert set(self._largest) >= {(s - e, s) for s, e in runs}, "a run is missing from the heap"


class PagePool:
    def __init__(self, name: str, num_pages: int, mass_reader=None):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise WorkbenchError(f"num_pages={num_pages!r} for group {name!r} is out of range: allowed >= 1")
        self.name = name
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = FreeRuns(num_pages)
        self.cache = PrefixCache(scored=mass_reader is not None)
        self._mass_reader = mass_reader
        self._unscored: set[int] = set()  # pages released since their mass was last read (scored)
        self.quarantine = Quarantine()
        self._num_used = 0
        self._allocated = self._freed = self._evicted = 0

    # -- counts ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._free.num_free

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_cached(self) -> int:
        return self.cache.num_evictable

    @property
    def num_quarantined(self) -> int:
        return self.quarantine.num_held

    @property
    def num_available(self) -> int:
        """Pages an allocation can take now: free ones, then evictable cached ones."""
        return self._free.num_free + self.cache.num_evictable

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as runs [start, end) of consecutive ids, lowest first."""
        return self._free.runs()

    def is_read_only(self, page: int) -> bool:
        return self.refcount[page] > 1 or self.cache.hash_of(page) is not None

    def is_matchable(self, page: int) -> bool:
        """Whether a prefix hit may take this hashed page: held or evictable, not quarantined."""
        return self.refcount[page] > 0 or self.cache.is_evictable(page)

    # -- operations ------------------------------------------------------------------------

    def can_allocate(self, n: int = 1) -> bool:
        return self.num_available >= n

    def allocate(self, after: int | None = None, want: int = 1) -> int:
        """A blank page with refcount 1: the page right after `after` (the last page the
        caller's sequence holds) when it is free, else the first page of a new run with room
        for `want` pages (the caller's pages still to come, this one included), else the LRU
        cached page (or, scored, the least attended one)."""
        if self._unscored:
            self.read_mass()
        if after is not None and self._free.starts_at(after + 1):
            page = after + 1
            self._free.take(page)
        elif self._free.num_free:
            page = self._free.place(want)
        else:
            page = self.cache.evict()
            if page is None:
                raise WorkbenchError(
                    f"no page left in group {self.name!r}: {self._num_used} of {self.num_pages} in use, "
                    f"{self.num_quarantined} quarantined"
                )
            self._evicted += 1
        self.refcount[page] = 1
        self._num_used += 1
        self._allocated += 1
        return page

    def incref(self, page: int) -> None:
        """One more holder; a cached page (a prefix hit) leaves the LRU."""
        if self.refcount[page] == 0:
            if not self.cache.is_evictable(page):
                raise WorkbenchError(f"page {page} of group {self.name!r} is neither held nor cached: cannot share it")
            self.cache.claim(page)
            self._num_used += 1
        self.refcount[page] += 1

    def decref(self, page: int, fence: int | None = None) -> None:
        """One holder fewer. At refcount 0 the page is quarantined while `fence` is pending,
        else it becomes cached (if hashed) or free."""
        if self.refcount[page] < 1:
            raise WorkbenchError(f"page {page} of group {self.name!r} has no holder to release")
        self.refcount[page] -= 1
        if self.refcount[page]:
            return
        self._num_used -= 1
        self._freed += 1
        if self._mass_reader is not None:
            self._unscored.add(page)
        if self.quarantine.is_pending(fence):
            self.quarantine.hold(fence, page)
        else:
            self._settle(page)

    def read_mass(self) -> None:
        """Scored: the released pages' attention mass, read (and zeroed) in one call, added to
        each hashed one's score."""
        pages, self._unscored = sorted(self._unscored), set()
        for page, mass in zip(pages, self._mass_reader(self.name, pages)):
            if self.cache.hash_of(page) is not None:
                self.cache.rescore(page, self.cache.score.get(page, 0.0) + float(mass))

    def retire(self, step_id: int) -> None:
        for page in self.quarantine.retire(step_id):
            self._settle(page)

    def _settle(self, page: int) -> None:
        if self.cache.hash_of(page) is not None:
            self.cache.make_evictable(page)
        else:
            self._free.give(page)

    # -- telemetry and checks ---------------------------------------------------------------

    def read_stats(self) -> GroupStats:
        """A snapshot; the since-last-read counters restart at zero."""
        s = GroupStats(self.name, self.num_pages, self._num_used, self.num_free, self.num_cached,
                       self.num_quarantined, self._allocated, self._freed, self._evicted)
        self._allocated = self._freed = self._evicted = 0
        return s

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every operation)."""
        self._free.check()
        free = {p for s, e in self.free_runs() for p in range(s, e)}
        cached, quarantined = set(self.cache.evictable()), set(self.quarantine.items())
        used = {p for p, r in enumerate(self.refcount) if r > 0}
        assert all(0 <= p < self.num_pages for p in free), "a free page id is out of range"
        assert len(quarantined) == self.num_quarantined, "a page is quarantined twice"
        assert used == {p for p in range(self.num_pages) if self.refcount[p] > 0}
        assert len(used) == self._num_used, "the used count drifted"
        assert not (free & used or free & cached or free & quarantined), "a free page is also held"
        assert not (used & cached or used & quarantined or cached & quarantined), "a page is in two states"
        assert len(free) + len(used) + len(cached) + len(quarantined) == self.num_pages, "a page is lost"
        assert all(self.cache.hash_of(p) is None for p in free), "a free page keeps a hash"
        assert all(r >= 0 for r in self.refcount)
        self.cache.check()
