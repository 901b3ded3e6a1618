"""The Triton runner's KV pages: one pool per KV group on the device, and the tables a forward's
kernels read.

* `DevicePages`: per group of the state layout (workbench/state/layout.py) K and V pools
  ``[layers in the group, pages + 1, PAGE, Hkv, D]``, allocated once (`TritonRunner.init_kv_pool`,
  sized by the scheduler). The extra last page of each group is the scratch page that a CUDA
  graph's padding rows write into; no sequence ever owns it. A layer's pool is a contiguous view
  ``[pages + 1, PAGE, Hkv, D]``, the layout kernels/kv_pages.py addresses through a block table.
  Which page holds what is the scheduler's `PageAllocator`'s business; pages are never zeroed
  (the kernels never read a position a row does not own: tests poison them with NaN).
* `forward_rows` / `forward_tables`: a forward's rows (eager forwards and chunk graphs alike);
  an eager forward's row tables (token, position, table row) and block tables
  (one row per segment, per group), packed in one int32 host tensor, so one copy moves them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DevicePages:
    def __init__(self, layout, num_pages: dict[str, int], n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.layout, self.dtype, self.device = layout, dtype, device
        self.page_size = P = layout.page_size
        self.groups = layout.group_names
        self.num_pages = {g: int(num_pages[g]) for g in self.groups}
        self.k = {g.name: torch.empty((len(g.layers), self.num_pages[g.name] + 1, P, n_kv_heads, head_dim),
                                      dtype=dtype, device=device) for g in layout.groups}
        self.v = {g: torch.empty_like(t) for g, t in self.k.items()}
        # layer -> (index of its group in self.groups, its K and V pools)
        self._layers = {li: (gi, self.k[g.name][j], self.v[g.name][j])
                        for gi, g in enumerate(layout.groups) for j, li in enumerate(g.layers)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def scratch(self, group: str) -> int:
        """The page id graph padding rows write into (one past the allocator's pages)."""
        return self.num_pages[group]

    def layer(self, li: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(group index, K pool, V pool) of layer li."""
        return self._layers[li]

    def copy(self, copies) -> None:
        """The allocator's `PageCopy`s (copy-on-write, fork of a partial page): positions [0, n)
        of page src to page dst in every layer of the group, in order (device copies, stream
        ordered before the forward that follows)."""
        for c in copies:
            for pool in (self.k[c.group], self.v[c.group]):
                pool[:, c.dst, : c.num_positions] = pool[:, c.src, : c.num_positions]

    def poison(self) -> None:
        """NaN in every page (tests: outputs must not change)."""
        for d in (self.k, self.v):
            for t in d.values():
                t.fill_(float("nan"))


def table_width(segments: Sequence, groups: Sequence[str]) -> int:
    """Entries of the widest block table of the segments (at least 1)."""
    return max([1] + [len(s.block_tables[g]) for s in segments for g in groups])


def forward_rows(segments: Sequence) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rows of a forward, segment after segment: (tokens, positions, table rows, sampled
    rows), a row's table row the index of its segment, a sampled row each sampled segment's last."""
    ids, pos, row, sel = [], [], [], []
    for i, s in enumerate(segments):
        n = len(s.token_ids)
        ids += s.token_ids
        pos += range(s.start_pos, s.start_pos + n)
        row += [i] * n
        if s.samples:
            sel.append(len(ids) - 1)
    return ids, pos, row, sel


def forward_tables(segments: Sequence, groups: Sequence[str]) -> tuple[torch.Tensor, list[int], int, int]:
    """(host int32 tensor, sampled rows, R, W): the tensor is ``[3 * R + G * S * W]``, first the
    rows' (token, position, table row) as [3, R] (`forward_rows`), then per group its block
    tables [S, W] (row i: segment i's page ids, -1 past its pages)."""
    ids, pos, row, sel = forward_rows(segments)
    R, S, W = len(ids), len(segments), table_width(segments, groups)
    tables = [list(s.block_tables[g]) + [-1] * (W - len(s.block_tables[g])) for g in groups for s in segments]
    flat = torch.tensor([ids, pos, row], dtype=torch.int32).flatten()
    return torch.cat([flat, torch.tensor(tables, dtype=torch.int32).flatten()]), sel, R, W
