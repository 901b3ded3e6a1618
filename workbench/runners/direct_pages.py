"""DirectPages: drive a paged runner without the scheduler (benchmark scripts, runner tests).

The engine's `Scheduler` owns a `PageAllocator` and hands every `Segment` its block tables. A
script that calls `runner.run` itself (a device benchmark timing the decode loop, a test that
checks one forward) needs the same bookkeeping and nothing else: this object holds an
allocator over the runner's state layout, allocates the runner's pool once, and makes segments
whose tables cover what they write:

    pages = DirectPages(runner, tokens_per_group=8192)
    out = runner.run([pages.segment(0, "a", prompt, 0)], {0: 1024})
    out = runner.run([pages.segment(0, "a", (tok,), len(prompt))], {0: 1024})
    runner.decode_loop([pages.segment(0, "a", (tok,), n, reserve=steps)], steps)
    pages.free("a")

Positions are appended as segments are made (no tokens are committed: there is no prefix
cache to hash them for), so a segment must continue its sequence: start at or below the
positions it already holds. No prefix cache (a script asks for it
through the engine). Plain bookkeeping: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..errors import WorkbenchError
from ..scheduler import Segment
from ..state import PageAllocator


class DirectPages:
    def __init__(self, runner, tokens_per_group: int):
        layout = runner.state_layout
        n = -(-tokens_per_group // layout.page_size)
        self.num_pages = {g: n for g in layout.group_names}
        runner.init_kv_pool(self.num_pages)
        self.allocator = PageAllocator(layout, self.num_pages, prefix_cache=False, cache_key=runner.kv_cache_key)
        self._held: dict[Hashable, int] = {}  # sequence -> positions it holds pages for

    def segment(self, slot: int, rid: Hashable, token_ids: Sequence[int], start_pos: int, samples: bool = True,
                reserve: int | None = None, scored: int = 1) -> Segment:
        """A segment of ``token_ids`` at ``start_pos`` for sequence ``rid`` (new at position 0),
        with pages for ``reserve`` positions from ``start_pos`` (default: its tokens; a decode
        loop of k steps reserves k)."""
        alloc = self.allocator
        if rid not in self._held:
            if start_pos:
                raise WorkbenchError(f"sequence {rid!r} is new: its first segment starts at 0, not {start_pos}")
            alloc.add(rid)
            self._held[rid] = 0
        held = self._held[rid]
        if start_pos > held:
            raise WorkbenchError(f"sequence {rid!r} holds {held} positions: a segment at {start_pos} does not continue it")
        want = start_pos + max(len(token_ids), reserve or 0)
        copies = alloc.append(rid, want - held) if want > held else []
        self._held[rid] = max(held, want)
        tables = {g: tuple(alloc.block_table(rid, g).ids()) for g in alloc.layout.group_names}
        return Segment(slot, rid, tuple(int(t) for t in token_ids), start_pos, samples, tables, tuple(copies),
                       scored=scored)

    def fork(self, parent: Hashable, child: Hashable, num_tokens: int) -> tuple:
        """A new sequence `child` sharing `parent`'s first `num_tokens` positions
        (`PageAllocator.fork`); returns the copies its first segment must carry."""
        copies = self.allocator.fork(parent, child, num_tokens)
        self._held[child] = num_tokens
        return tuple(copies)

    def free(self, rid: Hashable) -> None:
        self.allocator.free(rid)
        self._held.pop(rid, None)
