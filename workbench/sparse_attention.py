"""QSA on the torch path: the indexer's block summaries, kept beside the KV pages, and per-row
sparse attention over the blocks a row selects (workbench/qsa.py says which).

The index. Per KV group holding QSA layers, a tensor `[num_pages, qsa layers of the group,
P // B, S, Hkv, D]` indexed by the same page id as the KV (StateLayout's page payload): one
summary per block of B positions, S = 1 for the mean of its keys, S = 2 for Quest's bounds kept
as centre (max + min) / 2 and radius (max - min) / 2, so that a query's upper bound
sum_d max(q_d min_d, q_d max_d) is two products, q . centre + |q| . radius. A block's summary is
written by the forward that completes it, from the keys in the cache, with a fixed sequence of
elementwise ops, so it has the same bits whichever chunk completed it. Pages move with their
summaries: copy-on-write and forks copy the whole blocks they copy, swaps the whole page.

A sparse row (position p >= dense_positions) at KV head h: the blocks between its sinks and
its local window are scored with its queries of that head's group, `[G, D] @ [D, n]` (one
product whose shape depends only on p), the scores of the group's heads added in order; the
top_k are taken by a stable sort (ties to the earlier block) and joined with the sinks and the
local blocks in position order; their keys are gathered through the block table into one
`[D, kept * B]` operand, and the row's softmax and P @ V run over it with its positions past p
masked (a select, so unwritten keys never enter a sum). Every shape is fixed by (config, p), and
each row is its own call, so a row's bits depend on its own sequence only: batched equals solo,
and prefill, decode and verify rows at p agree. Rows below the boundary call attention.attend,
the dense path itself.

Why rows loop in Python here: the CPU path is the reference and the test oracle; a row's
operands are a few thousand keys, and the loop is what makes each row's call its own. The
Triton runner's kernels (`kernels/qsa.py`) batch the rows, each row still selecting for itself.
"""

from __future__ import annotations

import torch

from .attention import KV_BLOCK, attend, plan_tiles
from .qsa import QSAConfig


class QSAIndex:
    """The indexer state of one page pool: block summaries per page, and activation counters."""

    def __init__(self, config: QSAConfig, layers: tuple[int, ...], layout, num_pages: dict[str, int],
                 n_kv_heads: int, head_dim: int):
        self.config = config
        self.layers = tuple(layers)
        self.where: dict[int, tuple[str, int]] = {}
        per_group: dict[str, int] = {}
        for g in layout.groups:
            for li in g.layers:
                if li in self.layers:
                    self.where[li] = (g.name, per_group.get(g.name, 0))
                    per_group[g.name] = per_group.get(g.name, 0) + 1
        s = 1 if config.summary == "mean" else 2
        self.summ = {name: torch.empty(num_pages[name], n, KV_BLOCK // config.block, s, n_kv_heads, head_dim)
                     for name, n in per_group.items()}
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.summ.values())

    def read_stats(self) -> dict[str, int]:
        """Counters since the previous read: row-layers on the sparse and the dense path, blocks
        scored and kept (summed over KV heads)."""
        out, self.stats = self.stats, dict.fromkeys(STAT_KEYS, 0)
        return out

    # -- pages -----------------------------------------------------------------------------
    def copy(self, group: str, src: int, dst: int, num_positions: int) -> None:
        """A `PageCopy` of positions [0, n): the summaries of its whole blocks go with it."""
        if group in self.summ:
            nb = num_positions // self.config.block
            self.summ[group][dst, :, :nb] = self.summ[group][src, :, :nb]

    def move(self, dst: "QSAIndex", group: str, src_page: int, dst_page: int) -> None:
        if group in self.summ:
            dst.summ[group][dst_page] = self.summ[group][src_page]

    def poison(self, group: str, idx: torch.Tensor, value: float) -> None:
        if group in self.summ:
            self.summ[group][idx] = value

    # -- a forward's writes ----------------------------------------------------------------
    def update(self, layer: int, k_cache: torch.Tensor, table: torch.Tensor, start: int, n: int) -> None:
        """Summaries of the blocks that the write of positions [start, start + n) completed,
        from the keys now in `k_cache` ([num_pages, Hkv, D, P], layer `layer`'s)."""
        b = self.config.block
        first, last = start // b, (start + n) // b
        if last <= first:
            return
        group, j = self.where[layer]
        blocks = torch.arange(first, last)
        pos = (blocks[:, None] * b + torch.arange(b)).flatten()
        keys = k_cache[table[pos // KV_BLOCK], :, :, pos % KV_BLOCK].view(len(blocks), b, *k_cache.shape[1:3])
        # a fixed sequence of elementwise ops over the block's keys in order: the same bits for
        # a block whatever else the call holds
        if self.config.summary == "mean":
            acc = keys[:, 0]
            for i in range(1, b):
                acc = acc + keys[:, i]
            val = (acc / b).unsqueeze(1)
        else:
            lo = hi = keys[:, 0]
            for i in range(1, b):
                lo, hi = torch.minimum(lo, keys[:, i]), torch.maximum(hi, keys[:, i])
            val = torch.stack([(hi + lo) / 2, (hi - lo) / 2], 1)
        first_pos = blocks * b
        self.summ[group][:, j][table[first_pos // KV_BLOCK], (first_pos % KV_BLOCK) // b] = val

    # -- attention -------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               positions: torch.Tensor, scale: float, table: torch.Tensor, tiles=None) -> torch.Tensor:
        """Attention of one segment's rows q [n, H, D] at `positions` (increasing) in a QSA
        layer: rows below the boundary through attention.attend (`tiles`: its plan for all the
        rows, used when every row is dense), the rest each over its own selected blocks."""
        cfg = self.config
        n = q.shape[0]
        nd = int((positions < cfg.dense_positions).sum())
        self.stats["dense_rows"] += nd
        self.stats["sparse_rows"] += n - nd
        if nd == n:
            return attend(q, k_cache, v_cache, positions, 0, scale, tiles, table)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = attend(q[:nd], k_cache, v_cache, positions[:nd], 0, scale, plan_tiles(positions[:nd], 0), table)
        group, j = self.where[layer]
        summ = self.summ[group][:, j]
        b = cfg.block
        hkv, d = k_cache.shape[1], k_cache.shape[2]
        g = q.shape[1] // hkv
        # the summaries of every block a row of the segment may score, gathered once (a row
        # reads a prefix of it: the same strides whatever the segment)
        nblk_max = int(positions[-1]) // b + 1
        blocks = torch.arange(nblk_max)
        first_pos = blocks * b
        all_summ = summ[table[first_pos // KV_BLOCK], (first_pos % KV_BLOCK) // b]  # [nb, S, Hkv, D]
        kh = torch.arange(hkv)[:, None]
        within = torch.arange(b)
        for r in range(nd, n):
            p = int(positions[r])
            nblk = p // b + 1
            lo, hi = cfg.sink_blocks, nblk - cfg.local_blocks  # the scored blocks [lo, hi)
            qg = q[r].view(hkv, g, d)
            scores = _scores(qg, all_summ[lo:hi], cfg.summary)  # [Hkv, hi - lo]
            top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : cfg.top_k]
            sel = torch.cat([torch.arange(lo).expand(hkv, lo), top.sort(-1).values + lo,
                             torch.arange(hi, nblk).expand(hkv, nblk - hi)], 1)  # [Hkv, kept], in order
            pos = (sel[:, :, None] * b + within).flatten(1)  # [Hkv, kept * B]
            page, off = table[pos // KV_BLOCK], pos % KV_BLOCK
            kt = k_cache[page, kh, :, off].transpose(1, 2).contiguous()  # [Hkv, D, S]
            hidden = pos > p  # the own block's unwritten tail
            v = torch.where(hidden[:, :, None], 0.0, v_cache[page, kh, off, :])  # [Hkv, S, D]
            s = torch.bmm(qg, kt) * scale
            s = s.masked_fill(hidden[:, None, :], float("-inf"))
            m = s.amax(-1, keepdim=True)
            e = torch.exp(s - m)
            out[r] = (torch.bmm(e, v) / e.sum(-1, keepdim=True)).view(hkv * g, d)
            self.stats["blocks_scored"] += hkv * (hi - lo)
            self.stats["blocks_kept"] += hkv * sel.shape[1]
        return out


STAT_KEYS = ("sparse_rows", "dense_rows", "blocks_scored", "blocks_kept")


def _scores(qg: torch.Tensor, summ: torch.Tensor, kind: str) -> torch.Tensor:
    """Block scores [Hkv, n] of a row's queries qg [Hkv, G, D] against summaries [n, S, Hkv, D]:
    per query head one [G, D] @ [D, n] product, the group's heads added in order."""
    c = summ[:, 0].permute(1, 2, 0)  # [Hkv, D, n]
    s = torch.bmm(qg, c)
    if kind == "minmax":
        s = s + torch.bmm(qg.abs(), summ[:, 1].permute(1, 2, 0))
    acc = s[:, 0]
    for i in range(1, s.shape[1]):
        acc = acc + s[:, i]
    return acc


def qsa_ref(q, keys, values, position: int, config: QSAConfig, scale: float):
    """A naive float64 reference of one row (q [H, D]; keys, values [L, Hkv, D] of positions
    0..L-1, L > position): summaries, scores, selection and softmax written out plainly from the
    definition in workbench/qsa.py. Not bitwise: tests compare within tolerance, on inputs
    whose scores have no near ties."""
    b = config.block
    hkv, d = keys.shape[1], keys.shape[2]
    g = q.shape[0] // hkv
    nblk = position // b + 1
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hkv):
        qh = q[h * g : (h + 1) * g].double()
        if nblk <= config.kept_blocks:
            keep = list(range(nblk))
        else:
            lo, hi = config.sink_blocks, nblk - config.local_blocks
            scores = []
            for blk in range(lo, hi):
                kb = keys[blk * b : (blk + 1) * b, h].double()
                if config.summary == "mean":
                    scores.append(float((qh @ kb.mean(0)).sum()))
                else:
                    mn, mx = kb.min(0).values, kb.max(0).values
                    scores.append(float(torch.maximum(qh * mn, qh * mx).sum()))
            order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: config.top_k]
            keep = list(range(lo)) + sorted(i + lo for i in order) + list(range(hi, nblk))
        idx = [blk * b + i for blk in keep for i in range(b) if blk * b + i <= position]
        kk, vv = keys[idx, h].double(), values[idx, h].double()
        out[h * g : (h + 1) * g] = torch.softmax(qh @ kk.T * scale, -1) @ vv
    return out.float()


def payload_specs(config: QSAConfig, layers: tuple[int, ...], layout, model_config) -> tuple:
    """The indexer's per-page payloads (StateLayout.page_payloads), so that memory sizing counts
    them: one per KV group holding QSA layers, float32 like the torch path's KV."""
    from .state import PagePayloadSpec

    s = 1 if config.summary == "mean" else 2
    out = []
    for g in layout.groups:
        n = sum(1 for li in g.layers if li in layers)
        if n:
            out.append(PagePayloadSpec(f"qsa_{g.name}", g.name, (n, layout.page_size // config.block, s,
                                                                 model_config.n_kv_heads, model_config.head_dim)))
    return tuple(layout.page_payloads) + tuple(out)
