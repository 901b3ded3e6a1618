"""The prefix cache of one page pool: chained page hashes, the hash index and the LRU.

A full page's hash is blake2b(parent hash || the page's token ids), and the chain starts from
a root that hashes the cache key (model identity, KV dtype) and the page size, so a hash names
the page's whole prefix, not only its own tokens. Pages are hashed only once every position's
KV is written (`PageAllocator.commit`), so a hit never reads unwritten KV.

Why hashlib and not Python's `hash`: `hash` of str/bytes is salted per process
(PYTHONHASHSEED), so a key naming the model would hash differently in every process and a
cache could never be shared or recorded; and it is 64 bits of a non-cryptographic mix, where
a collision would silently serve another prefix's KV. blake2b with a 16-byte digest is stable
across processes and makes an accidental collision negligible; hashing a 256-token page costs
about a microsecond.

Owned here, per pool: hash -> page, page -> hash, and the LRU of evictable pages (hashed,
refcount 0), oldest first; and, across a layout's pools, the longest usable match. Invariants: the two maps are inverse; every LRU page is hashed.
The pool decides when a page enters or leaves the LRU; this class only keeps the order.
A hashed page is read-only: its content is the content its hash names, until it is evicted.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import WorkbenchError

if TYPE_CHECKING:
    from .layout import StateLayout
    from .pages import PagePool

DIGEST_SIZE = 16


def cache_key(model_id: str, dtype: str) -> bytes:
    """The extra key that makes hashes of one model and KV dtype differ from any other's."""
    return f"{model_id}\x00{dtype}".encode()


def root_hash(key: bytes, page_size: int) -> bytes:
    h = hashlib.blake2b(b"slotlab-prefix-v1\x00", digest_size=DIGEST_SIZE)
    h.update(struct.pack("<q", page_size))
    h.update(key)
    return h.digest()


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chain_hashes(token_ids: Sequence[int], page_size: int, root: bytes, num_pages: int | None = None) -> list[bytes]:
    """Hashes of the first `num_pages` full pages of `token_ids` (all full pages by default)."""
    n = len(token_ids) // page_size if num_pages is None else num_pages
    out, parent = [], root
    for i in range(n):
        parent = page_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefixMatch:
    """What `PageAllocator.match` found: the first `num_tokens` positions of a prompt are cached.

    `pages[group]` has one entry per cached page: a page id, or None where a sliding group
    needs no page (it lies wholly before the window of the first position to compute)."""

    num_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    pages: dict[str, tuple[int | None, ...]] = field(default_factory=dict)


def find_prefix(layout: "StateLayout", pools: Mapping[str, "PagePool"], root: bytes,
                token_ids: Sequence[int]) -> PrefixMatch:
    """The longest run of cached pages from the start of `token_ids` that every group can
    serve: a global group needs all of them, a sliding group only those the query at the hit
    point can see (`StateLayout.first_live_page`). At least one token is left to compute (the
    last prompt token must run for its logits): a hit is at most (len - 1) // P pages.
    Quarantined pages do not match."""
    P = layout.page_size
    max_pages = max(0, len(token_ids) - 1) // P
    if max_pages == 0:
        return PrefixMatch()
    hashes = chain_hashes(token_ids, P, root, max_pages)

    def usable(pool: "PagePool", h: bytes) -> bool:
        page = pool.cache.lookup(h)
        return page is not None and pool.is_matchable(page)

    ok = {name: [usable(pool, h) for h in hashes] for name, pool in pools.items()}
    k = 0
    while k < max_pages and all(ok[g.name][k] for g in layout.groups if not g.sliding):
        k += 1
    while k > 0:  # the longest hit every sliding group can serve too
        if all(all(ok[g.name][layout.first_live_page(g.name, k * P) : k]) for g in layout.groups if g.sliding):
            break
        k -= 1
    if k == 0:
        return PrefixMatch()
    pages = {}
    for name, pool in pools.items():
        lo = layout.first_live_page(name, k * P)
        pages[name] = (None,) * lo + tuple(pool.cache.lookup(h) for h in hashes[lo:k])
    return PrefixMatch(k * P, tuple(token_ids[: k * P]), tuple(hashes[:k]), pages)


def check_prefix(pools: Mapping[str, "PagePool"], match: PrefixMatch, page_size: int) -> None:
    """Raise unless every page of `match` is still the matchable page of its hash."""
    k = match.num_tokens // page_size
    for name, pool in pools.items():
        entries = match.pages.get(name, ())
        ok = len(entries) == k == len(match.hashes) and all(
            page is None or (pool.cache.lookup(h) == page and pool.is_matchable(page))
            for page, h in zip(entries, match.hashes))
        if not ok:
            raise WorkbenchError("prefix match is stale (pages changed since match()): match again before add")


class PrefixCache:
    """scored: evict the evictable page with the least `score` (the attention mass it received,
    kept by its PagePool), the least recently made evictable first among equal scores; else
    the least recently used. The scored order is a heap with stale entries skipped (an entry is
    live while it is the page's latest), rebuilt when stale ones outnumber the live."""

    def __init__(self, scored: bool = False) -> None:
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        self.scored = scored
        self.score: dict[int, float] = {}  # hashed page -> attention mass received (scored)
        self._heap: list[tuple[float, int, int]] = []  # (score, tick, page)
        self._entry: dict[int, tuple[float, int, int]] = {}  # evictable page -> its live heap entry
        self._tick = 0

    @property
    def num_hashed(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def lookup(self, h: bytes) -> int | None:
        return self._page_of.get(h)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def register(self, page: int, h: bytes) -> bool:
        """Name `page` by `h`. False (and nothing changes) when `h` already names a page: the
        first copy stays the cached one and `page` stays private."""
        if h in self._page_of or page in self._hash_of:
            return False
        self._page_of[h] = page
        self._hash_of[page] = h
        return True

    def is_evictable(self, page: int) -> bool:
        return page in self._lru

    def make_evictable(self, page: int) -> None:
        """A hashed page lost its last holder: it becomes the most recently used evictable."""
        assert page in self._hash_of and page not in self._lru
        self._lru[page] = None
        if self.scored:
            self._push(page)

    def rescore(self, page: int, score: float) -> None:
        """A hashed page's attention mass so far (scored): its place in the eviction order."""
        self.score[page] = score
        if self.scored and page in self._lru:
            self._push(page)

    def _push(self, page: int) -> None:
        self._tick += 1
        e = self._entry[page] = (self.score.get(page, 0.0), self._tick, page)
        heapq.heappush(self._heap, e)
        if len(self._heap) > 2 * len(self._entry) + 16:
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def claim(self, page: int) -> None:
        """An evictable page gained a holder (a prefix hit): it leaves the LRU."""
        del self._lru[page]
        self._entry.pop(page, None)

    def evict(self) -> int | None:
        """Drop the next evictable page's hash (the least scored, or the least recently used);
        returns the page (now blank)."""
        if not self._lru:
            return None
        if self.scored:
            while True:
                e = heapq.heappop(self._heap)
                if self._entry.get(e[2]) == e:
                    break
            page = e[2]
            del self._lru[page], self._entry[page]
        else:
            page, _ = self._lru.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        self.score.pop(page, None)
        return page

    def evictable(self) -> list[int]:
        """Evictable pages, least recently used first."""
        return list(self._lru)

    def check(self) -> None:
        assert len(self._page_of) == len(self._hash_of)
        assert all(self._hash_of[p] == h for h, p in self._page_of.items()), "hash maps disagree"
        assert all(p in self._hash_of for p in self._lru), "an evictable page has no hash"
        assert all(p in self._hash_of for p in self.score), "a score outlived its page's hash"
        if self.scored:
            assert set(self._entry) == set(self._lru), "an evictable page is missing from the scored order"
