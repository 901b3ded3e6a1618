"""Blocked causal attention whose per-row result depends only on that row's own sequence.

Keys are processed in fixed blocks of `KV_BLOCK` positions. Each query row is its own matrix
product operand: for row r and block b, `s[r, b] = q_r [G, D] @ K_b^T [D, KV_BLOCK]`, one element
of a batched product of always the same shape (G = query heads per kv head). Then

    m = max over all blocks           exact (max is order-free)
    p = exp(s - m)                    elementwise
    l = sum_b rowsum(p_b)             block sums of fixed length, blocks added in order (cumsum)
    o = sum_b p_b @ V_b               fixed-shape products, blocks added in order (cumsum)
    out = o / l

A block that is fully masked for a row (it lies past the row's position, or before its sliding
window) contributes exact zeros, and adding +-0 leaves a float unchanged. So whichever blocks a
pass happens to visit, each row gets the same bits: prefill in any chunking, decode, and batched
decode all agree with solo. `tests/test_attention.py` asserts this bitwise.

Why rows are separate product operands rather than tiles of a [rows, D] matrix: BLAS sgemm on
this machine gives a row different bits depending on the row count of the call (1, 2-3, >= 4
rows take different kernels, and so do the last rows of some counts), so an operand whose row
count varied with the chunk would break exactness. `[G, D]` per row is the same in every call.
The cache is kept in a block layout (keys transposed inside each block) so that a decode row's
operands are plain views of it; a prefill pass copies them into the same contiguous layout, so
every call takes the same BLAS path.

Paged caches. A block is also a KV page (page size = KV_BLOCK = 256 positions, see
workbench/state/layout.py), so a sequence's cache is a pool of pages [num_pages, Hkv, ...] and
a block table: logical block i (positions i*256..) lives in page table[i]. `attend` gathers the
blocks lo..hi of a pass through the table, in logical order, into the same contiguous operand a
contiguous cache gives (no table: the identity), so a row's reduction is bitwise what it is with
a contiguous cache. Entries before a sliding window's first block may be holes (-1): a pass never
reads below its `lo`, which is at or above every hole.

Recycled pages are harmless. Keys no row of a pass can see (past the last query, before the
window, or in a page's unwritten tail) may hold anything, NaN included: their scores are
replaced by -inf (a select) and their values by 0 (a select, not `p * v`, since 0 * NaN = NaN)
before they enter any sum. Values a row cannot see but another row of its pass can are written
and finite, so their zero probability adds exact zeros as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_BLOCK = 256
ROWS_PER_PASS = 64  # query rows per pass: bounds memory only; results do not depend on it


def round_up_capacity(n: int) -> int:
    return max(KV_BLOCK, -(-n // KV_BLOCK) * KV_BLOCK)


def to_blocks(k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major caches [cap, Hkv, D] -> the block layout attend() reads:
    K [nb, Hkv, D, KV_BLOCK] (keys transposed inside a block, ready as a product operand) and
    V [nb, Hkv, KV_BLOCK, D]."""
    cap, hkv, d = k_rows.shape
    nb = cap // KV_BLOCK
    kb = k_rows.view(nb, KV_BLOCK, hkv, d).permute(0, 2, 3, 1).contiguous()
    vb = v_rows.view(nb, KV_BLOCK, hkv, d).permute(0, 2, 1, 3).contiguous()
    return kb, vb


def locate(table: torch.Tensor | None, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) int64 [n] of positions start..start+n through a block table (None: the
    identity); a forward computes them once per segment and group, for every layer."""
    pos = torch.arange(start, start + n)
    blk, off = pos // KV_BLOCK, pos % KV_BLOCK
    return (blk if table is None else table[blk]), off


def write_rows(k_blocks, v_blocks, start: int, k: torch.Tensor, v: torch.Tensor,
               where: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Store rows k, v [n, Hkv, D] at positions start.. of block-layout caches (or pages:
    `where` = locate(table, start, n))."""
    page, off = where if where is not None else locate(None, start, k.shape[0])
    k_blocks[page, :, :, off] = k
    v_blocks[page, :, off, :] = v


@dataclass(frozen=True)
class RowPass:
    """Where a pass of query rows looks: key blocks lo..hi and which keys each row cannot see.
    It depends only on positions and window, so a forward computes it once per segment and
    window kind and reuses it in every layer."""

    start: int  # first query row of the pass within the segment
    n: int
    lo: int
    hi: int
    hidden: torch.Tensor  # bool [n, nb, 1, 1, KV_BLOCK]: True where a key is not visible
    # keys no row of the pass sees, only in the blocks that have any (a decode row's last block,
    # a window's first): their pass-relative indices and bool masks [len, 1, KV_BLOCK, 1]
    stale_blocks: tuple[int, ...]
    stale: torch.Tensor | None


def plan_tiles(positions: torch.Tensor, window: int, group: int = 0) -> list[RowPass]:
    c = positions.shape[0]
    plans = []
    for r0 in range(0, c, ROWS_PER_PASS):
        pos = positions[r0 : r0 + ROWS_PER_PASS]
        n = pos.shape[0]
        hi = int(pos.max()) // KV_BLOCK
        first = int(pos.min()) - window + 1 if window else 0
        lo = max(first, 0) // KV_BLOCK
        nb = hi - lo + 1
        kpos = torch.arange(lo * KV_BLOCK, (hi + 1) * KV_BLOCK, dtype=torch.int64).view(1, nb, 1, 1, KV_BLOCK)
        rpos = pos.view(n, 1, 1, 1, 1)
        visible = kpos <= rpos
        if window:
            visible &= (rpos - kpos) < window
        unseen = ~visible.any(0).view(nb, 1, KV_BLOCK, 1)
        blocks = tuple(int(b) for b in unseen.view(nb, -1).any(1).nonzero().flatten())
        plans.append(RowPass(r0, n, lo, hi, ~visible, blocks, unseen[list(blocks)] if blocks else None))
    return plans


def attend(
    q: torch.Tensor,  # [C, H, D] float32, rope applied
    k_cache: torch.Tensor,  # [nb, Hkv, D, KV_BLOCK] float32 block layout (to_blocks)
    v_cache: torch.Tensor,  # [nb, Hkv, KV_BLOCK, D]
    positions: torch.Tensor,  # [C] int64, absolute positions of the queries (cache holds <= max)
    window: int,  # 0 = global; else a key is visible when 0 <= qpos - kpos < window
    scale: float,
    tiles: list[RowPass] | None = None,  # plan_tiles(positions, window), if precomputed
    table: torch.Tensor | None = None,  # int64 block table: logical block -> page (None: identity)
    mass: torch.Tensor | None = None,  # float64 [pages]: each page's attention mass is added here
) -> torch.Tensor:
    c, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    if tiles is None:
        tiles = plan_tiles(positions, window)
    out = torch.empty(c, h, d, dtype=torch.float32)
    for tp in tiles:
        r0, n, lo, hi = tp.start, tp.n, tp.lo, tp.hi
        nb = hi - lo + 1
        # The pass's blocks read in place: page ids in logical order, cut into runs of
        # consecutive pages (one run without a table) so that each run's blocks are one view of
        # the pool; a block with keys no row sees is a run of its own, its unseen values made
        # zeros by a select (a copy of that block only); a decode row whose pass spans several
        # runs gathers them into one instead. Each (block, head) product is its own matrix
        # product whatever the runs, so the bits do not depend on where pages lie (tested:
        # scattered pages against the identity table). CPU cost at 8 slots, 512-token prompts,
        # scattered pages: decode steps ~24% slower than the contiguous cache of cc1e427 (the
        # gather's copy; 0.153 vs 0.123 s per step); the allocator hands a sequence consecutive
        # pages where it can (state/pages.py), and a decode row over consecutive pages reads
        # them in place, its partly written last block a run of its own (no gather: only
        # scattered pages are copied).
        pages = list(range(lo, hi + 1)) if table is None else table[lo : hi + 1].tolist()
        stale = dict(zip(tp.stale_blocks, torch.where(tp.stale, 0.0, v_cache[[pages[i] for i in tp.stale_blocks]])
                         if tp.stale is not None else ()))
        runs, i = [], 0  # (first block, blocks, first page)
        while i < nb:
            e = i + 1
            if i not in stale:
                while e < nb and e not in stale and pages[e] == pages[e - 1] + 1:
                    e += 1
            runs.append((i, e - i, pages[i]))
            i = e
        if n == 1 and any(pages[e] != pages[e - 1] + 1 for e in range(1, nb)):
            # one query row over scattered pages: the pass's pages gathered (one copy of K and
            # V, measured cheaper on the CPU than a batched call per run) into one run
            k_src, v_src = k_cache[pages], v_cache[pages]
            for b0, fixed in stale.items():
                v_src[b0] = fixed
            runs, stale = [(0, nb, 0)], {}
        else:
            k_src, v_src = k_cache, v_cache
        qr = q[r0 : r0 + n].reshape(n, hkv, g, d)
        if n == 1:
            # one query row: every (block, head) product of a run in a single batched call
            s = torch.cat([torch.bmm(qr.expand(L, hkv, g, d).reshape(-1, g, d),
                                     k_src[p0 : p0 + L].reshape(-1, d, KV_BLOCK)).view(L, hkv, g, KV_BLOCK)
                           for _, L, p0 in runs]).unsqueeze(0)
        else:
            # many rows: per (block, head), the block is shared by all rows through a
            # stride-0 batch (no copies); each row is still its own [G, D] operand
            s = torch.stack(
                [torch.stack([torch.bmm(qr[:, kh], k_cache[pages[b], kh].expand(n, d, KV_BLOCK)) for kh in range(hkv)], 1)
                 for b in range(nb)], 1)
        s = s * scale
        s = s.masked_fill(tp.hidden, float("-inf"))
        m = s.amax(dim=(1, 4), keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True).cumsum(1)[:, -1]  # [n, hkv, g, 1], blocks added in order
        if mass is not None:  # (read only: the output's bits do not depend on it)
            # each block's share of every row's and query head's softmax: the probability mass
            # the page received (eviction="scored", state/pages.py)
            share = (p.sum(dim=-1) / l[..., 0].unsqueeze(1)).sum(dim=(0, 2, 3))  # [nb]
            mass.index_add_(0, torch.tensor(pages, dtype=torch.int64), share.double())
        if n == 1:
            o = torch.cat([torch.bmm(p[0, b0 : b0 + L].reshape(-1, g, KV_BLOCK),
                                     (stale[b0].unsqueeze(0) if b0 in stale else v_src[p0 : p0 + L])
                                     .reshape(-1, KV_BLOCK, d)).view(L, hkv, g, d)
                           for b0, L, p0 in runs]).unsqueeze(0)
        else:
            o = torch.stack(
                [torch.stack([torch.bmm(p[:, b, kh], (stale[b] if b in stale else v_cache[pages[b]])[kh]
                                        .expand(n, KV_BLOCK, d)) for kh in range(hkv)], 1)
                 for b in range(nb)], 1)
        o = o.cumsum(1)[:, -1]
        out[r0 : r0 + n] = (o / l).reshape(n, h, d)
    return out


def attend_ref(q, k_cache, v_cache, positions, window, scale) -> torch.Tensor:
    """Plain masked softmax attention in float64: the numerical reference, not exact-by-design."""
    c, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    L = int(positions.max()) + 1
    k = k_cache[:L].double().repeat_interleave(g, dim=1)  # [L, H, D]
    v = v_cache[:L].double().repeat_interleave(g, dim=1)
    s = torch.einsum("chd,lhd->hcl", q.double(), k) * scale
    kpos = torch.arange(L).view(1, 1, L)
    qpos = positions.view(1, c, 1)
    vis = kpos <= qpos
    if window:
        vis &= (qpos - kpos) < window
    s = s.masked_fill(~vis, float("-inf"))
    return torch.einsum("hcl,lhd->chd", s.softmax(-1), v).float()
