"""PagePool: the page ids of one KV group, their refcounts, the free list and the quarantine.

A page is in exactly one of four states:

* free: no holder, no hash; on the free list;
* used: refcount > 0 (held by that many block-table entries; shared when > 1);
* cached: refcount 0 but hashed, so a prefix hit can take it back; evictable, LRU first;
* quarantined: refcount 0, released under a fence that is not retired yet (fences.py).

Invariant: free + used + cached + quarantined == num_pages, and the four sets are disjoint.
A page is read-only when it is shared (refcount > 1) or hashed; `PageAllocator` copies it
before writing (copy-on-write), it never writes one in place.

Allocation is deterministic: the lowest free page id first, then the least recently used
cached page is evicted (its hash dropped). A heap gives the lowest id in O(log n); the
order does not affect any result, only reproducibility of the page ids.

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


class PagePool:
    def __init__(self, name: str, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise WorkbenchError(f"num_pages={num_pages!r} for group {name!r} is out of range: allowed >= 1")
        self.name = name
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages))  # a heap (sorted is a valid heap)
        self.cache = PrefixCache()
        self.quarantine = Quarantine()
        self._num_used = 0
        self._allocated = self._freed = self._evicted = 0

    # -- counts ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

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
        return len(self._free) + self.cache.num_evictable

    def is_read_only(self, page: int) -> bool:
        return self.refcount[page] > 1 or self.cache.hash_of(page) is not None

    def is_matchable(self, page: int) -> bool:
        """Whether a prefix hit may take this hashed page: held or evictable, not quarantined."""
        return self.refcount[page] > 0 or self.cache.is_evictable(page)

    # -- operations ------------------------------------------------------------------------

    def can_allocate(self, n: int = 1) -> bool:
        return self.num_available >= n

    def allocate(self) -> int:
        """A blank page with refcount 1: the lowest free id, else the LRU cached page."""
        if self._free:
            page = heapq.heappop(self._free)
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
        if self.quarantine.is_pending(fence):
            self.quarantine.hold(fence, page)
        else:
            self._settle(page)

    def retire(self, step_id: int) -> None:
        for page in self.quarantine.retire(step_id):
            self._settle(page)

    def _settle(self, page: int) -> None:
        if self.cache.hash_of(page) is not None:
            self.cache.make_evictable(page)
        else:
            heapq.heappush(self._free, page)

    # -- telemetry and checks ---------------------------------------------------------------

    def read_stats(self) -> GroupStats:
        """A snapshot; the since-last-read counters restart at zero."""
        s = GroupStats(self.name, self.num_pages, self._num_used, self.num_free, self.num_cached,
                       self.num_quarantined, self._allocated, self._freed, self._evicted)
        self._allocated = self._freed = self._evicted = 0
        return s

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every operation)."""
        free, cached, quarantined = set(self._free), set(self.cache.evictable()), set(self.quarantine.items())
        used = {p for p, r in enumerate(self.refcount) if r > 0}
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert len(quarantined) == self.num_quarantined, "a page is quarantined twice"
        assert used == {p for p in range(self.num_pages) if self.refcount[p] > 0}
        assert len(used) == self._num_used, "the used count drifted"
        assert not (free & used or free & cached or free & quarantined), "a free page is also held"
        assert not (used & cached or used & quarantined or cached & quarantined), "a page is in two states"
        assert len(free) + len(used) + len(cached) + len(quarantined) == self.num_pages, "a page is lost"
        assert all(self.cache.hash_of(p) is None for p in free), "a free page keeps a hash"
        assert all(r >= 0 for r in self.refcount)
        self.cache.check()
