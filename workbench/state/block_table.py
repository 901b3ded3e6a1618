"""BlockTable: one sequence's logical pages in one KV group.

Entry i holds the page id of positions [i*P, (i+1)*P), or None (a hole) where a sliding group
has dropped a page that no query can see any more. Positions keep their logical page index:
a hole never shifts the entries after it, so `locate(pos)` is `pos // P, pos % P`.

Invariants (the allocator keeps them): entries below the first live page are holes, entries
from it to the end are pages, and len(table) == ceil(length / P). The table holds ids only;
the refcounts live in the group's PagePool. Plain Python: no torch.
"""

from __future__ import annotations


class BlockTable:
    def __init__(self, page_size: int, entries: list[int | None] | None = None):
        self.page_size = page_size
        self._entries: list[int | None] = list(entries or [])

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> int | None:
        return self._entries[i]

    @property
    def entries(self) -> tuple[int | None, ...]:
        return tuple(self._entries)

    def pages(self) -> list[int]:
        """The page ids held, in logical order (holes skipped)."""
        return [p for p in self._entries if p is not None]

    @property
    def num_holes(self) -> int:
        return sum(p is None for p in self._entries)

    def ids(self, fill: int = -1) -> list[int]:
        """The table as the runner's page-table row: holes as `fill`."""
        return [fill if p is None else p for p in self._entries]

    def locate(self, pos: int) -> tuple[int, int]:
        """(page id, offset) of a position; the position's page must be held."""
        page = self._entries[pos // self.page_size]
        if page is None:
            raise IndexError(f"position {pos} lies in a dropped page")
        return page, pos % self.page_size

    def append(self, page: int) -> None:
        self._entries.append(page)

    def replace(self, i: int, page: int) -> int | None:
        old, self._entries[i] = self._entries[i], page
        return old

    def clear(self, i: int) -> int | None:
        """Entry i becomes None (its page moved to the host store, allocator.swap_out)."""
        old, self._entries[i] = self._entries[i], None
        return old

    def truncate(self, num_entries: int) -> list[int]:
        """Keep the first `num_entries`; returns the pages cut off, last first."""
        cut = [p for p in reversed(self._entries[num_entries:]) if p is not None]
        del self._entries[num_entries:]
        return cut

    def drop_below(self, first: int) -> list[int]:
        """Turn the entries before `first` into holes; returns the pages dropped, last first."""
        out = []
        for i in range(min(first, len(self._entries)) - 1, -1, -1):
            if self._entries[i] is not None:
                out.append(self._entries[i])
                self._entries[i] = None
        return out
