"""The Triton runner's KV pages: one pool per KV group on the device, and the tables a forward's
kernels read.

* `DevicePages`: per group of the state layout (workbench/state/layout.py) K and V pools
  ``[layers in the group, pages + 1, PAGE, Hkv, D]``, allocated once (`TritonRunner.init_kv_pool`,
  sized by the scheduler). The extra last page of each group is the scratch page that a CUDA
  graph's padding rows write into; no sequence ever owns it. A layer's pool is a contiguous view
  ``[pages + 1, PAGE, Hkv, D]``, the layout kernels/kv_pages.py addresses through a block table.
  Which page holds what is the scheduler's `PageAllocator`'s business; pages are never zeroed
  (the kernels never read a position a row does not own: tests poison them with NaN).
* `HostPages`: the host store of host backing (workbench/state/host.py), per group K and V
  ``[host pages, layers in the group, PAGE, Hkv, D]`` (page-major: a page is one contiguous
  block), pinned on CUDA so that copies to and from it are asynchronous; `move` runs a step's
  `PageMove`s on a transfer stream of its own (see there for the ordering).
* `forward_rows` / `forward_tables`: a forward's rows (eager forwards and chunk graphs alike);
  an eager forward's row tables (token, position, table row) and block tables
  (one row per segment, per group), packed in one int32 host tensor, so one copy moves them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch


class DevicePages:
    def __init__(self, layout, num_pages: dict[str, int], n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, qsa=None, qsa_layers: tuple[int, ...] = ()):
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
        # QSA: per group holding QSA layers, the indexer's block summaries float32 [its QSA
        # layers, pages + 1, PAGE // B, S, Hkv, D] at the KV's page ids (kernels/qsa.py's summ,
        # a layer's view); they move with their pages (copy, host moves)
        self.qsa = qsa
        # eviction="scored" (`track_mass`): per group (by index) float32 [pages + 1], the attention
        # mass each page received since its last read (kernels/attention.py's segment_mass)
        self.mass: list[torch.Tensor] | None = None
        self.summ: dict[str, torch.Tensor] = {}
        self._summ_layer: dict[int, torch.Tensor] = {}
        if qsa is not None:
            s = 1 if qsa.summary == "mean" else 2
            for g in layout.groups:
                mine = [li for li in g.layers if li in qsa_layers]
                if mine:
                    t = torch.empty((len(mine), self.num_pages[g.name] + 1, P // qsa.block, s, n_kv_heads, head_dim),
                                    dtype=torch.float32, device=device)
                    self.summ[g.name] = t
                    self._summ_layer.update((li, t[j]) for j, li in enumerate(mine))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v, self.summ) for t in d.values())

    def track_mass(self) -> None:
        """Measure each page's attention mass from now on (dense layers; graphs captured after
        this carry it)."""
        self.mass = [torch.zeros(self.num_pages[g] + 1, dtype=torch.float32, device=self.device) for g in self.groups]

    def take_mass(self, group: str, pages) -> list[float]:
        """The mass `pages` of `group` received since their last read, zeroed by the read (a
        host copy: it waits for the launched steps that may still add to them)."""
        t = self.mass[self.groups.index(group)]
        idx = torch.as_tensor(list(pages), dtype=torch.int64).to(self.device)
        got = t[idx].tolist()
        t[idx] = 0.0
        return got

    def summaries(self, li: int) -> torch.Tensor | None:
        """Layer li's QSA block summaries [pages + 1, PAGE // B, S, Hkv, D], None if not a QSA layer."""
        return self._summ_layer.get(li)

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
            if c.group in self.summ:  # the summaries of the whole blocks copied
                nb = c.num_positions // self.qsa.block
                self.summ[c.group][:, c.dst, :nb] = self.summ[c.group][:, c.src, :nb]

    def poison(self) -> None:
        """NaN in every page (tests: outputs must not change)."""
        for d in (self.k, self.v, self.summ):
            for t in d.values():
                t.fill_(float("nan"))


class HostPages:
    def __init__(self, pages: DevicePages, num_pages: dict[str, int]):
        self.pages = pages
        dev = pages.device
        pin = dev.type == "cuda"
        self.k = {g: torch.empty((int(num_pages[g]), *t[:, 0].shape), dtype=t.dtype, pin_memory=pin)
                  for g, t in pages.k.items()}
        self.v = {g: torch.empty_like(t, pin_memory=pin) for g, t in self.k.items()}
        self.summ = {g: torch.empty((int(num_pages[g]), *t[:, 0].shape), dtype=t.dtype, pin_memory=pin)
                     for g, t in pages.summ.items()}  # QSA's summaries, page-major like K and V
        self.stream = torch.cuda.Stream(dev) if pin else None
        self._timed: list[tuple] = []  # (start, end) events of moves not yet read
        # group -> device pages of moves the compute stream has not waited for (CUDA)
        self._pending: dict[str, set[int]] = {}
        self._cpu_s = 0.0

    def move(self, moves) -> None:
        """Run the moves in order. On CUDA they run on the transfer stream, which first waits for
        every step launched so far (a page-out reads what they wrote, a page-in may take a page
        they were the last to read). The compute stream does not wait here: `order_before`
        makes a forward wait for the transfers only when its block tables hold a page they
        touch (a page-in's page, or a page a page-out freed and the forward's growth took), so
        the other forwards overlap them. The pages of one direction and group go as one gather
        (page-outs) or scatter (page-ins) on the device and a contiguous copy per page."""
        dev = self.pages
        # consecutive moves of one group and direction, in order
        runs = [(g, out, list(ms)) for (g, out), ms in itertools.groupby(moves, key=lambda m: (m.group, m.to_host))]
        if self.stream is None:
            t0 = time.perf_counter()
            self._run(dev, runs)
            self._cpu_s += time.perf_counter() - t0
            return
        compute = torch.cuda.current_stream(dev.device)
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            self._run(dev, runs)
            end.record()
        self._timed.append((start, end))
        for m in moves:
            self._pending.setdefault(m.group, set()).add(m.device)

    def order_before(self, segments) -> None:
        """Make the compute stream wait for the transfers issued so far if any of `segments`'
        block tables holds a page they touch (then none is pending any more)."""
        if any(not pages.isdisjoint(s.block_tables[g]) for s in segments for g, pages in self._pending.items()):
            torch.cuda.current_stream(self.pages.device).wait_stream(self.stream)
            self._pending = {}

    def _run(self, dev: DevicePages, runs) -> None:
        for group, to_host, ms in runs:
            idx = torch.tensor([m.device for m in ms], dtype=torch.int64).to(dev.device, non_blocking=True)
            pools = [(dev.k[group], self.k[group]), (dev.v[group], self.v[group])]
            if group in self.summ:
                pools.append((dev.summ[group], self.summ[group]))
            for pool, store in pools:
                if to_host:
                    staged = pool.index_select(1, idx).transpose(0, 1).contiguous()  # [n, layers, ...]
                    for i, m in enumerate(ms):
                        store[m.host].copy_(staged[i], non_blocking=True)
                else:
                    staged = torch.empty((len(ms), *store.shape[1:]), dtype=store.dtype, device=dev.device)
                    for i, m in enumerate(ms):
                        staged[i].copy_(store[m.host], non_blocking=True)
                    pool[:, idx] = staged.transpose(0, 1)

    def read_transfer_s(self) -> float:
        """Seconds the moves took (device time on CUDA, of those finished) since the previous read."""
        out, self._cpu_s = self._cpu_s, 0.0
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.pop(0)
            out += start.elapsed_time(end) / 1e3
        return out


def table_width(segments: Sequence, groups: Sequence[str]) -> int:
    """Entries of the widest block table of the segments (at least 1)."""
    return max([1] + [len(s.block_tables[g]) for s in segments for g in groups])


def forward_rows(segments: Sequence) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rows of a forward, segment after segment: (tokens, positions, table rows, sampled
    rows), a row's table row the index of its segment, the sampled rows each sampled segment's
    last `scored` (one, or every row of a speculative verify)."""
    ids, pos, row, sel = [], [], [], []
    for i, s in enumerate(segments):
        n = len(s.token_ids)
        ids += s.token_ids
        pos += range(s.start_pos, s.start_pos + n)
        row += [i] * n
        k = s.num_scored
        sel += range(len(ids) - k, len(ids))
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
