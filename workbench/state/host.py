"""The host page store: page ids in host memory that a swapped-out sequence's pages move to.

Host backing (KVFlash): when the device pool is smaller than the live KV, a sequence that is not
scheduled can have its private pages copied to host pages (page-out) and its device pages
handed back; before its next step they are copied into fresh device pages (page-in). The
copies are bit copies of whole pages, so a sequence paged out and in computes exactly what it
would have computed resident. Pages shared with other sequences (refcount > 1, e.g. a common
prompt prefix) stay on the device, held by reference: a shared page is counted once, and its
other holders keep reading it.

`HostPool` is the id space of one KV group's host pages (the runner holds the tensors: pinned
memory on CUDA, plain memory on the CPU). A host page needs no fence: every move runs on one
ordered transfer queue (the runner's transfer stream), so a host page freed by a page-in is
only rewritten by a later page-out queued behind it. `PageMove` is the instruction to the
runner. Plain Python: no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..errors import WorkbenchError


@dataclass(frozen=True)
class PageMove:
    """Copy one whole page between the device pool and the host store of `group` (every layer
    of the group, K and V): device page `device` to host page `host` when `to_host` (a
    page-out), else host to device (a page-in). A step's moves run in order before its forward."""

    group: str
    device: int
    host: int
    to_host: bool


class HostPool:
    """Host page ids of one KV group: which are free (lowest id first, so the same calls give
    the same ids)."""

    def __init__(self, name: str, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise WorkbenchError(f"host num_pages={num_pages!r} for group {name!r} is out of range: allowed >= 0")
        self.name = name
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: the lowest free id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise WorkbenchError(f"the host store of group {self.name!r} is full ({self.num_pages} pages)")
        return heapq.heappop(self._free)

    def free(self, page: int) -> None:
        """A page-in moved it back (or its sequence ended while paged out)."""
        heapq.heappush(self._free, page)
