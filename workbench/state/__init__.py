"""Paged sequence state, as plain-Python bookkeeping (no torch; the runners own the tensors).

    layout.py        StateLayout: page size, KV groups (global / sliding), per-page payloads,
                     per-sequence state specs
    pages.py         PagePool: one group's page ids, refcounts, free list; PageCopy, GroupStats
    block_table.py   BlockTable: a sequence's logical pages in one group (holes for dropped ones)
    prefix_cache.py  chained page hashes, the hash index and LRU of one pool; PrefixMatch
    host.py          HostPool: one group's host page ids (host backing); PageMove
    fences.py        Quarantine: what a launched step may still touch, until it retires
    state_slots.py   StateSlots: per-sequence recurrent/conv state slots, versions for speculation
    sequence.py      SequenceState: one sequence's length, floor, tokens, hashes, tables
    allocator.py     PageAllocator: the operations (add, append, commit, truncate, fork, free)
"""

from .allocator import AllocatorStats, PageAllocator
from .block_table import BlockTable
from .fences import Quarantine
from .host import HostPool, PageMove
from .layout import (
    DEFAULT_KEY_BLOCKS,
    DEFAULT_PAGE_SIZE,
    KVGroup,
    PagePayloadSpec,
    SeqStateSpec,
    StateLayout,
)
from .pages import GroupStats, PageCopy, PagePool
from .prefix_cache import (
    PrefixCache,
    PrefixMatch,
    cache_key,
    chain_hashes,
    check_prefix,
    find_prefix,
    page_hash,
    root_hash,
)
from .sequence import SequenceState
from .state_slots import SlotCopy, StateSlots

__all__ = [
    "AllocatorStats", "BlockTable", "DEFAULT_KEY_BLOCKS", "DEFAULT_PAGE_SIZE", "GroupStats", "HostPool", "KVGroup",
    "PageAllocator", "PageCopy", "PageMove", "PagePayloadSpec", "PagePool", "PrefixCache", "PrefixMatch", "Quarantine",
    "SeqStateSpec", "SequenceState", "SlotCopy", "StateLayout", "StateSlots", "cache_key", "chain_hashes",
    "check_prefix", "find_prefix", "page_hash", "root_hash",
]
