"""SequenceState: one sequence's paged state, as the allocator keeps it.

* `length`: positions that have pages (written, or about to be written by a launched step);
* `token_ids`: the committed tokens, whose KV is written (len(token_ids) <= length);
* `hashes`: the chained hashes of the committed full pages (prefix cache on);
* `floor`: the lowest position a query of this sequence may still be at; `append` raises it
  to its first query (less max_rollback) and a sliding group drops the pages dead for every
  query >= floor; `truncate` lowers it to the new length;
* `tables`: one BlockTable per KV group;
* `has_state`: whether it owns a run of StateSlots (the layout has per-sequence state);
* `host`: while paged out (host.py), group -> {logical page: host page} of the pages that moved
  to the host store (their table entries are None meanwhile); empty when resident.

Invariants (PageAllocator.check): 0 <= floor <= length, len(token_ids) <= length, every table
has ceil(length / P) entries, its holes are a prefix, and every page a query >= floor can see
is held. Plain Python.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from .block_table import BlockTable


@dataclass
class SequenceState:
    seq_id: Hashable
    tables: dict[str, BlockTable]
    length: int = 0
    floor: int = 0
    token_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    has_state: bool = False  # owns a run of StateSlots
    host: dict[str, dict[int, int]] = field(default_factory=dict)  # paged out: group -> {page: host page}

    @property
    def resident(self) -> bool:
        return not self.host

    @property
    def num_committed(self) -> int:
        return len(self.token_ids)
