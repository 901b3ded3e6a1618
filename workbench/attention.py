"""Blocked causal attention whose per-row result depends only on that row's own sequence.

Keys are processed in fixed blocks of `KV_BLOCK` positions and queries in fixed tiles of
`Q_TILE` rows, so every product has the same shape whatever the chunk size or batch:

    s = q_tile @ K_block^T            fixed [G*Q_TILE, KV_BLOCK] per block
    m = max over all blocks           exact (max is order-free)
    p = exp(s - m)                    elementwise
    l = sum_b rowsum(p_b)             block sums of fixed length, blocks added in order (cumsum)
    o = sum_b p_b @ V_b               fixed-shape products, blocks added in order (cumsum)
    out = o / l

A block that is fully masked for a row (it lies past the row's position, or before its sliding
window) contributes exact zeros, and adding +-0 leaves a float unchanged. So whichever blocks a
tile happens to visit, each row gets the same bits: prefill in any chunking, decode, and batched
decode all agree with solo. `tests/test_attention.py` asserts this bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_BLOCK = 256
Q_TILE = 8


def round_up_capacity(n: int) -> int:
    return max(KV_BLOCK, -(-n // KV_BLOCK) * KV_BLOCK)


@dataclass(frozen=True)
class TilePlan:
    """Where one query tile looks: key blocks lo..hi and the visibility mask. It depends only on
    positions and window, so a forward computes it once per segment and reuses it in every
    layer of that window kind."""

    start: int  # first query row of the tile within the segment
    n: int  # real rows (the rest of Q_TILE is padding)
    lo: int
    hi: int
    hidden: torch.Tensor  # bool [nb, 1, G*Q_TILE, KV_BLOCK]: True where a key is not visible


def plan_tiles(positions: torch.Tensor, window: int, group: int) -> list[TilePlan]:
    c = positions.shape[0]
    pos_list = positions.tolist()
    plans = []
    for t0 in range(0, c, Q_TILE):
        n = min(Q_TILE, c - t0)
        tile_pos = pos_list[t0 : t0 + n]
        qpos = torch.full((Q_TILE,), tile_pos[-1], dtype=torch.int64)
        qpos[:n] = positions[t0 : t0 + n]
        hi = max(tile_pos) // KV_BLOCK
        first = min(tile_pos) - window + 1 if window else 0
        lo = max(first, 0) // KV_BLOCK
        nb = hi - lo + 1
        kpos = torch.arange(lo * KV_BLOCK, (hi + 1) * KV_BLOCK, dtype=torch.int64).view(nb, 1, 1, KV_BLOCK)
        rpos = qpos.repeat(group).view(1, 1, group * Q_TILE, 1)
        visible = kpos <= rpos
        if window:
            visible &= (rpos - kpos) < window
        plans.append(TilePlan(t0, n, lo, hi, ~visible))
    return plans


def attend(
    q: torch.Tensor,  # [C, H, D] float32, rope applied
    k_cache: torch.Tensor,  # [cap, Hkv, D] float32, cap % KV_BLOCK == 0
    v_cache: torch.Tensor,  # [cap, Hkv, D]
    positions: torch.Tensor,  # [C] int64, absolute positions of the queries (cache holds <= max)
    window: int,  # 0 = global; else a key is visible when 0 <= qpos - kpos < window
    scale: float,
    tiles: list[TilePlan] | None = None,  # plan_tiles(positions, window, H // Hkv), if precomputed
) -> torch.Tensor:
    c, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    if tiles is None:
        tiles = plan_tiles(positions, window, g)
    out = torch.empty(c, h, d, dtype=torch.float32)
    for tp in tiles:
        t0, n, lo, hi = tp.start, tp.n, tp.lo, tp.hi
        nb = hi - lo + 1
        qt = q.new_zeros(Q_TILE, h, d)
        qt[:n] = q[t0 : t0 + n]
        kb = k_cache[lo * KV_BLOCK : (hi + 1) * KV_BLOCK].view(nb, KV_BLOCK, hkv, d).permute(0, 2, 1, 3)
        vb = v_cache[lo * KV_BLOCK : (hi + 1) * KV_BLOCK].view(nb, KV_BLOCK, hkv, d).permute(0, 2, 1, 3)
        # rows ordered (group, query) so each kv head sees one fixed [G*Q_TILE, D] operand
        qg = qt.view(Q_TILE, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * Q_TILE, d)
        s = torch.matmul(qg.expand(nb, -1, -1, -1), kb.transpose(-1, -2).contiguous()) * scale
        s = s.masked_fill(tp.hidden, float("-inf"))
        m = s.amax(dim=(0, 3), keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True).cumsum(0)[-1]
        o = torch.matmul(p, vb.contiguous()).cumsum(0)[-1]
        o = o / l  # [hkv, g*Q_TILE, d]
        o = o.view(hkv, g, Q_TILE, d).permute(2, 0, 1, 3).reshape(Q_TILE, h, d)
        out[t0 : t0 + n] = o[:n]
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
