"""QSA sparse attention on the Triton path: block summaries, per-row block selection, and
attention over the selected blocks, for many rows in one launch; a row's result depends only
on it.

The definition is workbench/qsa.py's and the torch path's (workbench/sparse_attention.py); the
KV addressing is kernels/kv_pages.py's. B = the config's block, PAGE = positions per KV page
(a multiple of B), S = 1 (summary "mean") or 2 ("minmax"), G = Hq / Hkv query heads per KV head,
kept = sink_blocks + top_k + local_blocks, dense_positions = kept * B.

Layouts:

* k_cache, v_cache [pages, PAGE, Hkv, D] float32 or bfloat16; block_table int32 [rows, W]; row r
  reads block-table row seq[r] and sits at position pos[r] (it sees keys 0..pos[r]).
* summ float32 [pages, PAGE // B, S, Hkv, D] (any strides but a unit last one, e.g. one layer's
  view of a page payload): block b of a sequence with table row t lives at page
  t[(b * B) // PAGE], slot ((b * B) % PAGE) // B; S = 2 holds (centre, radius) =
  ((max + min) / 2, (max - min) / 2), elementwise over the block's keys.
* sel int32 [R, Hkv, kept]: a sparse row's kept block ids per KV head, ascending (the sinks
  [0, sink), the top_k selected, the local blocks [nblk - local, nblk)).
* q float32 [R, Hq, D]; out float32 [R, Hq, D].

The three functions (each with a plain torch ``*_ref`` beside it):

1. ``qsa_summaries``: one program per row. A row whose position completes a block
   ((pos + 1) % B == 0) reads the block's B keys through the block table (all KV heads in one
   tile) and writes its summary; other rows do nothing. The keys are combined in position
   order with the torch path's ops (acc = k0; acc = acc + k1; ...; acc * (1 / B), which is
   bitwise acc / B for B a power of two; min/max likewise), in float32: the reference's bits.
2. ``qsa_select``: rows at pos >= dense_positions (others untouched). First
   ``_qsa_score_kernel``, one program per (row, KV head, tile of QSA_SCORE_TILE blocks): the
   score of each block b in [sink, nblk - local) is sum over the group's query heads g, in
   order, of q_g . c_b (+ |q_g| . r_b for minmax), each a reduction over D of one lane of a
   fixed-shape tile; written to the float32 scratch [R, Hkv, max_blocks] at index b. Then
   ``_qsa_topk_kernel``, one program per (row, KV head): the scores are mapped to
   order-preserving int32 keys (-0 as +0, NaN above everything, as torch's descending sort),
   the top_k-th largest key T is found digit by digit from the top (QSA_RADIX_BITS bits a
   pass; a pass counts the keys >= each of the digit's candidates), and the kept set is every
   key > T plus the earliest top_k - count(> T) keys == T (ties to the earlier block),
   compacted in ascending order with tl.cumsum over tiles and a running offset. A row's scored
   range of up to QSA_RESIDENT_KEYS blocks is loaded once, as one tile in registers (its size
   the next power of two of max_blocks); longer ones are re-read by each pass in tiles of
   QSA_KEY_TILE. Exact integer work: no sort, and the same sel whatever the tile or form.
3. ``qsa_attention``: rows at pos >= dense_positions (others untouched). A row's kept list
   (its sel blocks expanded to B positions each, ascending) has n_vis = (kept - 1) * B +
   pos % B + 1 visible entries, a prefix (only the row's own block, the last, has positions
   past pos). ``_qsa_partial_kernel``, one program per (row, KV head, split of ``split``
   kept-list entries: num_splits = cdiv(kept * B, split), a function of the config alone),
   gathers K/V per entry through sel and the block table (entries past n_vis never loaded:
   masked loads, so NaN in unwritten cache entries never enters a sum) and runs
   attention.py's online-softmax block step (``_attend_block``: exp2, the scale in log2 units,
   the G query heads together) over tiles of BLOCK_N entries at fixed offsets of the kept list,
   then stores the split's (max, sum, acc); attention.py's combine (``_combine_row``, a second
   kernel, or with ``counters`` the row's last split program) merges the splits in split order
   and normalizes.

Why this is batch-invariant (row i of an R-row call bitwise the 1-row call, any R, any place in
the batch): every program works on one row (one row and KV head; one split or score tile), and
every reduction's shape and order is fixed by the config, the model's shapes and the row's own
position: the score tiles start at block `sink` whatever the row, the key tiles and splits sit
at fixed offsets of the kept list, the splits are merged in order, the selection is exact
integer arithmetic. Nothing depends on R, on other rows, or on which program runs what; the
grids' extents (R, max_blocks) only add programs that return at once. Dense rows
(pos < dense_positions) are the dense kernel's (attention.attention_rows): these kernels skip
them and leave their sel and out untouched.

Products: scores by broadcast multiply + tl.sum (a GEMV per block; no MMA shape to fill);
attention by attention.py's ``_attend_block``: tl.dot ("tf32x3", or "bf16" where the caller
asks) on a GPU, broadcast multiply + tl.sum under the interpreter (``use_dot``, as
attention_rows). Value checks (ids, positions in range) run only on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (
    ATTENTION_INPUT_PRECISION,
    ATTENTION_PRECISIONS,
    _LOG2E,
    _attend_block,
    _attention_config,
    _combine_row,
    _finish_item,
    _load_q,
)
from .kv_pages import block_table_args
from .pdl import enter, launch_kw

SUMMARIES = ("mean", "minmax")
# Blocks per score tile, by padded head dim (about 4K floats of summaries per tile).
QSA_SCORE_TILE: dict[int, int] = {16: 256, 32: 128, 64: 64, 128: 32, 256: 16, 512: 8}
# The top-k search: a row's scored range of up to QSA_RESIDENT_KEYS blocks is loaded once, as
# one tile (the next power of two of the scratch's max_blocks), and searched in registers; a
# longer one is read from the scratch again by each pass, in tiles of QSA_KEY_TILE.
# H200, Gemma 3 270M shapes (D 256, B 4, top_k 512), CUDA-graph device time of qsa_select per
# call: 8K context 14 / 26 us at 1 / 16 rows, 32K 38 / 87 us, 128K 203 / 397 us resident at 32
# warps (253 / 441 tiled); 1 bit a pass was no faster, 4 slower.
QSA_RESIDENT_KEYS = 32768
QSA_KEY_TILE = 8192
QSA_RADIX_BITS = 2  # bits of the threshold found per pass (32 / 2 = 16 passes)
# Kept-list entries per attention partial program by default (qsa_attention(split=)). H200, the
# same shapes, 2,056 kept positions of bfloat16 K/V, precision "bf16", fused combine: 14 / 27 us
# at 1 / 16 rows (split 64: 14 / 26, 256: 18 / 24); dense attention_rows (64-key segments) at
# 8K context 38 / 129 us, 32K 147 / 524, 128K 888 / 2087.
QSA_SPLIT = 128
QSA_SCORE_WARPS = 4
QSA_TOPK_WARPS = 16  # the tiled search's; a resident tile of n keys: n / 1024 warps, 4 to 32
_INT_MIN = tl.constexpr(-2147483648)


# -- 1. block summaries ---------------------------------------------------------------------
@triton.jit
def _qsa_summary_kernel(
    k_ptr, bt_ptr, stride_bt, seq_ptr, pos_ptr, s_ptr,
    stride_ks, stride_kl, stride_kh, stride_sp, stride_sb, stride_ss, stride_sh, Hkv, D,
    B: tl.constexpr, PAGE: tl.constexpr, HKV_P: tl.constexpr, D_P: tl.constexpr, MINMAX: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    r = tl.program_id(0)
    p = tl.load(pos_ptr + r).to(tl.int32)
    if (p >= 0) & ((p + 1) % B == 0):
        first = (p // B) * B
        page = tl.load(bt_ptr + tl.load(seq_ptr + r).to(tl.int64) * stride_bt + first // PAGE).to(tl.int64)
        off = first % PAGE  # the block's first offset in its page (B divides PAGE)
        h = tl.arange(0, HKV_P)
        d = tl.arange(0, D_P)
        m = (h < Hkv)[:, None] & (d < D)[None, :]
        src = k_ptr + page * stride_ks + h[:, None] * stride_kh + d[None, :]
        k0 = tl.load(src + off * stride_kl, mask=m, other=0.0).to(tl.float32)
        dst = s_ptr + page * stride_sp + (off // B) * stride_sb + h[:, None] * stride_sh + d[None, :]
        if MINMAX:
            lo = k0
            hi = k0
            for i in range(1, B):  # in position order
                ki = tl.load(src + (off + i) * stride_kl, mask=m, other=0.0).to(tl.float32)
                lo = tl.minimum(lo, ki, propagate_nan=tl.PropagateNan.ALL)
                hi = tl.maximum(hi, ki, propagate_nan=tl.PropagateNan.ALL)
            tl.store(dst, (hi + lo) * 0.5, mask=m)
            tl.store(dst + stride_ss, (hi - lo) * 0.5, mask=m)
        else:
            acc = k0
            for i in range(1, B):  # in position order
                acc = acc + tl.load(src + (off + i) * stride_kl, mask=m, other=0.0).to(tl.float32)
            tl.store(dst, acc * (1.0 / B), mask=m)


def qsa_summaries(k_cache: torch.Tensor, block_table: torch.Tensor | None, seq: torch.Tensor, pos: torch.Tensor,
                  block: int, summary: str, summ: torch.Tensor) -> torch.Tensor:
    """Write the summary of the block each row completes into ``summ`` (returned).

    k_cache [pages, PAGE, Hkv, D] float32/bfloat16 (block_table None: a contiguous [S, L, Hkv,
    D] cache, kv_pages.py); seq, pos int32/int64 [R]; summ float32 [pages, PAGE // block, S,
    Hkv, D] (S = 1 "mean", 2 "minmax"; unit last stride). A row at pos with (pos + 1) % block
    == 0 writes block pos // block's summary from the keys now in the cache; other rows (pos <
    0 too) write nothing. Call it after the forward's KV write: every row of a prefill chunk
    that completes a block then writes its block (the same bits whichever chunk did)."""
    _check_block(block)
    if summary not in SUMMARIES:
        raise ValueError(f"summary={summary!r} is not allowed: allowed {', '.join(SUMMARIES)}")
    _check_kv("k_cache", k_cache)
    bt, page, S_rows, L_max = block_table_args(k_cache, block_table)
    _, _, Hkv, D = k_cache.shape
    _check_summ(summ, k_cache.shape[0], page, block, 1 if summary == "mean" else 2, Hkv, D, k_cache.device)
    R = _check_rows(seq, pos, k_cache.device, S_rows, L_max)
    if R == 0:
        return summ
    _qsa_summary_kernel[(R,)](
        k_cache, bt, bt.stride(0), seq, pos, summ,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        summ.stride(0), summ.stride(1), summ.stride(2), summ.stride(3), Hkv, D,
        B=block, PAGE=page, HKV_P=triton.next_power_of_2(Hkv), D_P=max(16, triton.next_power_of_2(D)),
        MINMAX=summary == "minmax", num_warps=4, **launch_kw(k_cache),
    )
    return summ


def qsa_summaries_ref(k_cache, block_table, seq, pos, block: int, summary: str, summ: torch.Tensor) -> torch.Tensor:
    """Reference: the torch path's ops (QSAIndex.update) per completing row, into ``summ``."""
    bt, page, _, _ = block_table_args(k_cache, block_table)
    for r in range(seq.shape[0]):
        p = int(pos[r])
        if p < 0 or (p + 1) % block:
            continue
        t = bt[int(seq[r])].long()
        j = torch.arange((p // block) * block, p + 1)
        keys = k_cache[t[j // page], j % page].float()  # [B, Hkv, D]
        if summary == "mean":
            acc = keys[0]
            for i in range(1, block):
                acc = acc + keys[i]
            val = (acc / block)[None]
        else:
            lo = hi = keys[0]
            for i in range(1, block):
                lo, hi = torch.minimum(lo, keys[i]), torch.maximum(hi, keys[i])
            val = torch.stack([(hi + lo) / 2, (hi - lo) / 2])
        first = int(j[0])
        summ[t[first // page], (first % page) // block] = val
    return summ


# -- 2. block selection ---------------------------------------------------------------------
@triton.jit
def _qsa_score_kernel(
    q_ptr, s_ptr, bt_ptr, stride_bt, seq_ptr, pos_ptr, sc_ptr,
    stride_qr, stride_qh, stride_sp, stride_sb, stride_ss, stride_sh, stride_cr, stride_ch, D,
    B: tl.constexpr, PAGE: tl.constexpr, DENSE: tl.constexpr, SINK: tl.constexpr, LOCAL: tl.constexpr,
    GROUP: tl.constexpr, D_P: tl.constexpr, BLOCK_S: tl.constexpr, MINMAX: tl.constexpr, PDL: tl.constexpr,
):
    """Program (r, kvh, t): the scores of blocks SINK + [t * BLOCK_S, (t + 1) * BLOCK_S) of row
    r's scored range [SINK, nblk - LOCAL), into the scratch at their block ids."""
    enter(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.load(pos_ptr + r).to(tl.int32)
    hi = p // B + 1 - LOCAL
    first_blk = SINK + tl.program_id(2) * BLOCK_S
    if (p >= DENSE) & (first_blk < hi):
        b = first_blk + tl.arange(0, BLOCK_S)
        bm = b < hi
        d = tl.arange(0, D_P)
        dm = d < D
        first = b * B
        page = tl.load(bt_ptr + tl.load(seq_ptr + r).to(tl.int64) * stride_bt + first // PAGE, mask=bm,
                       other=0).to(tl.int64)
        src = s_ptr + page[:, None] * stride_sp + ((first % PAGE) // B)[:, None] * stride_sb + kvh * stride_sh \
            + d[None, :]
        m = bm[:, None] & dm[None, :]
        c = tl.load(src, mask=m, other=0.0)  # [BLOCK_S, D_P] centres (means)
        if MINMAX:
            rad = tl.load(src + stride_ss, mask=m, other=0.0)
        for g in tl.static_range(GROUP):  # the group's heads added in order
            qg = tl.load(q_ptr + r * stride_qr + (kvh * GROUP + g) * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
            s = tl.sum(qg[None, :] * c, axis=1)
            if MINMAX:
                s = s + tl.sum(tl.abs(qg)[None, :] * rad, axis=1)
            if g == 0:
                acc = s
            else:
                acc = acc + s
        tl.store(sc_ptr + r * stride_cr + kvh * stride_ch + b, acc, mask=bm)


@triton.jit
def _order_key(s):
    """int32 keys ordered as the float32 scores s: -0 as +0, every NaN above +inf."""
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(s == 0.0, 0, key)
    return tl.where(s != s, 0x7FFFFFFF, key)


@triton.jit
def _kth_key(base, lo, hi, K, keys, BITS: tl.constexpr, TILE: tl.constexpr, RESIDENT: tl.constexpr):
    """The K-th largest key of scores base[lo:hi] (K <= hi - lo): the largest T with
    count(key >= T) >= K, found digit by digit from the top, BITS bits a pass (a pass counts the
    keys >= each of the digit's 2^BITS candidates; the candidates always fit int32, the digit
    arithmetic is int64). RESIDENT: ``keys`` holds the range's keys, one TILE in registers
    starting at lo (lanes at or past hi masked here); else each pass reads the scores again,
    tile by tile (``keys`` unused)."""
    NC: tl.constexpr = 1 << BITS
    jc = tl.arange(0, NC).to(tl.int64)
    one = hi.to(tl.int64) * 0 + 1
    T = one * _INT_MIN
    for i in range(32 // BITS):
        step = one << (32 - BITS * (i + 1))
        cand = (T + jc * step).to(tl.int32)  # [NC], ascending
        if RESIDENT:
            b = lo + tl.arange(0, TILE)
            cnt = tl.sum(((keys[:, None] >= cand[None, :]) & (b < hi)[:, None]).to(tl.int32), axis=0)
        else:
            cnt = tl.zeros([NC], dtype=tl.int32)
            for t in range(lo, hi, TILE):
                b = t + tl.arange(0, TILE)
                m = b < hi
                key = _order_key(tl.load(base + b, mask=m, other=0.0))
                cnt += tl.sum(((key[:, None] >= cand[None, :]) & m[:, None]).to(tl.int32), axis=0)
        T = T + tl.max(tl.where(cnt >= K, jc, 0), axis=0) * step  # (cnt[0] >= K always)
    return T.to(tl.int32)


@triton.jit
def _qsa_topk_kernel(
    sc_ptr, pos_ptr, sel_ptr, stride_cr, stride_ch, stride_lr, stride_lh,
    B: tl.constexpr, DENSE: tl.constexpr, SINK: tl.constexpr, TOPK: tl.constexpr, LOCAL: tl.constexpr,
    SINK_P: tl.constexpr, LOCAL_P: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
    RESIDENT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (r, kvh): row r's kept blocks for KV head kvh, ascending, into sel. RESIDENT:
    the row's scored range fits one TILE, loaded once (else every pass reads the scratch)."""
    enter(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.load(pos_ptr + r).to(tl.int32)
    if p >= DENSE:
        hi = p // B + 1 - LOCAL  # scored blocks [SINK, hi): more than TOPK of them (p >= DENSE)
        base = sc_ptr + r * stride_cr + kvh * stride_ch
        out = sel_ptr + r * stride_lr + kvh * stride_lh
        b0 = SINK + tl.arange(0, TILE)
        if RESIDENT:
            keys = _order_key(tl.load(base + b0, mask=b0 < hi, other=0.0))
        else:
            keys = b0  # (unused)
        T = _kth_key(base, SINK, hi, TOPK, keys, BITS, TILE, RESIDENT)
        # every key > T and the first TOPK - count(> T) keys == T, in block order
        zero = hi * 0
        n_gt = zero
        for t in range(SINK, hi, TILE):
            b = t + tl.arange(0, TILE)
            m = b < hi
            if RESIDENT:
                key = keys
            else:
                key = _order_key(tl.load(base + b, mask=m, other=0.0))
            n_gt += tl.sum(((key > T) & m).to(tl.int32), axis=0)
        need_eq = TOPK - n_gt  # >= 1
        n_out = zero
        n_eq = zero
        for t in range(SINK, hi, TILE):
            b = t + tl.arange(0, TILE)
            m = b < hi
            if RESIDENT:
                key = keys
            else:
                key = _order_key(tl.load(base + b, mask=m, other=0.0))
            eq = ((key == T) & m).to(tl.int32)
            eq_rank = n_eq + tl.cumsum(eq, axis=0) - eq
            take = (((key > T) & m) | ((eq == 1) & (eq_rank < need_eq))).to(tl.int32)
            slot = n_out + tl.cumsum(take, axis=0) - take
            tl.store(out + SINK + slot, b, mask=take == 1)
            n_out += tl.sum(take, axis=0)
            n_eq += tl.sum(eq, axis=0)
        js = tl.arange(0, SINK_P)
        tl.store(out + js, js, mask=js < SINK)
        jl = tl.arange(0, LOCAL_P)
        tl.store(out + SINK + TOPK + jl, hi + jl, mask=jl < LOCAL)


def qsa_select(q: torch.Tensor, summ: torch.Tensor, block_table: torch.Tensor | None, seq: torch.Tensor,
               pos: torch.Tensor, block: int, top_k: int, sink_blocks: int, local_blocks: int, summary: str,
               sel: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Each sparse row's kept blocks per KV head into ``sel`` (returned).

    q float32 (or bfloat16) [R, Hq, D]; summ float32 [pages, PAGE // block, S, Hkv, D]
    (``qsa_summaries``'); block_table int32 [rows, W] (None: summ is [S_seq, L // block, ...],
    one page per sequence); seq, pos [R]; sel int32 [R, Hkv, sink + top_k + local] (unit last
    stride). Rows at pos >= dense_positions get, per KV head, the sinks, the top_k blocks of
    [sink, nblk - local) by score (ties to the earlier block), and the local blocks, ascending;
    other rows' sel is untouched. ``scratch``: float32 [R, Hkv, max_blocks] (unit last stride;
    max_blocks at least every row's pos // block + 1; default the most a table row addresses,
    W * PAGE // block), the block scores, at block ids (written only for sparse rows' scored
    blocks)."""
    _check_block(block)
    if summary not in SUMMARIES:
        raise ValueError(f"summary={summary!r} is not allowed: allowed {', '.join(SUMMARIES)}")
    for name, v, lo in (("top_k", top_k, 1), ("sink_blocks", sink_blocks, 0), ("local_blocks", local_blocks, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    _check_q(q)
    R, Hq, D = q.shape
    if summ.dim() != 5 or summ.dtype != torch.float32 or summ.stride(-1) != 1 or summ.device != q.device:
        raise ValueError(f"summ must be float32 [pages, PAGE // B, S, Hkv, D] with unit last stride on {q.device}, "
                         f"got {summ.dtype} {tuple(summ.shape)}")
    Hkv = summ.shape[3]
    S = 1 if summary == "mean" else 2
    if summ.shape[2] != S or summ.shape[4] != D or Hq % Hkv:
        raise ValueError(f"summ {tuple(summ.shape)} does not fit summary={summary!r} (S={S}), q {tuple(q.shape)}")
    page = summ.shape[1] * block
    if block_table is None:
        bt = torch.arange(summ.shape[0], dtype=torch.int32, device=q.device)[:, None]
    else:
        bt = block_table
        if bt.dim() != 2 or bt.dtype != torch.int32 or bt.device != q.device or bt.stride(1) != 1:
            raise ValueError(f"block_table must be int32 [rows, pages] with unit stride on {q.device}, got "
                             f"{bt.dtype} {tuple(bt.shape)} on {bt.device}")
    kept = sink_blocks + top_k + local_blocks
    dense = kept * block
    if sel.shape != (R, Hkv, kept) or sel.dtype != torch.int32 or sel.stride(-1) != 1 or sel.device != q.device:
        raise ValueError(f"sel must be int32 [{R}, {Hkv}, {kept}] with unit last stride on {q.device}, got "
                         f"{sel.dtype} {tuple(sel.shape)}")
    if scratch is None:
        scratch = torch.empty((R, Hkv, bt.shape[1] * page // block), dtype=torch.float32, device=q.device)
    elif (scratch.dim() != 3 or scratch.shape[:2] != (R, Hkv) or scratch.dtype != torch.float32
          or scratch.stride(-1) != 1 or scratch.device != q.device):
        raise ValueError(f"scratch must be float32 [{R}, {Hkv}, max_blocks] with unit last stride on {q.device}")
    max_blocks = scratch.shape[2]
    _check_rows(seq, pos, q.device, bt.shape[0], min(bt.shape[1] * page, max_blocks * block))
    if R == 0:
        return sel
    d_p = max(16, triton.next_power_of_2(D))
    if d_p not in QSA_SCORE_TILE:
        raise ValueError(f"head dim up to {max(QSA_SCORE_TILE)} supported, got padded {d_p}")
    block_s = QSA_SCORE_TILE[d_p]
    common = dict(B=block, DENSE=dense, SINK=sink_blocks, LOCAL=local_blocks, **launch_kw(q))
    _qsa_score_kernel[(R, Hkv, triton.cdiv(max_blocks, block_s))](
        q, summ, bt, bt.stride(0), seq, pos, scratch,
        q.stride(0), q.stride(1), summ.stride(0), summ.stride(1), summ.stride(2), summ.stride(3),
        scratch.stride(0), scratch.stride(1), D,
        PAGE=page, GROUP=Hq // Hkv, D_P=d_p, BLOCK_S=block_s, MINMAX=summary == "minmax",
        num_warps=QSA_SCORE_WARPS, **common,
    )
    _qsa_topk_kernel[(R, Hkv)](
        scratch, pos, sel, scratch.stride(0), scratch.stride(1), sel.stride(0), sel.stride(1),
        TOPK=top_k, SINK_P=triton.next_power_of_2(max(sink_blocks, 1)),
        LOCAL_P=triton.next_power_of_2(local_blocks), **_topk_config(max_blocks), **common,
    )
    return sel


def _topk_config(max_blocks: int) -> dict:
    """The top-k kernel's tile, search form and warps: a function of the scratch's max_blocks."""
    n = triton.next_power_of_2(max_blocks)
    if n <= QSA_RESIDENT_KEYS:
        return dict(TILE=n, RESIDENT=True, BITS=QSA_RADIX_BITS, num_warps=max(4, min(32, n // 1024)))
    return dict(TILE=QSA_KEY_TILE, RESIDENT=False, BITS=QSA_RADIX_BITS, num_warps=QSA_TOPK_WARPS)


def qsa_select_ref(q, summ, block_table, seq, pos, block: int, top_k: int, sink_blocks: int, local_blocks: int,
                   summary: str, sel: torch.Tensor) -> torch.Tensor:
    """Reference: float32 scores per query head (each block's product summed over D on its own,
    as the kernel scores a block: identical blocks then score identically on any BLAS, where a
    batched product may round a block by its position in the batch), the group's heads added
    in order, and a stable sort, per sparse row, into sel."""
    R, Hq, D = q.shape
    Hkv = summ.shape[3]
    g = Hq // Hkv
    page = summ.shape[1] * block
    bt = (torch.arange(summ.shape[0])[:, None] if block_table is None else block_table).long()
    kept = sink_blocks + top_k + local_blocks
    for r in range(R):
        p = int(pos[r])
        if p < kept * block:
            continue
        nblk = p // block + 1
        lo, hi = sink_blocks, nblk - local_blocks
        first = torch.arange(lo, hi) * block
        t = bt[int(seq[r])]
        sm = summ[t[first // page], (first % page) // block]  # [n, S, Hkv, D]
        qg = q[r].float().view(Hkv, g, 1, D)
        s = (qg * sm[:, 0].permute(1, 0, 2)[:, None]).sum(-1)  # [Hkv, G, n]
        if summary == "minmax":
            s = s + (qg.abs() * sm[:, 1].permute(1, 0, 2)[:, None]).sum(-1)
        acc = s[:, 0]
        for i in range(1, g):
            acc = acc + s[:, i]
        top = torch.sort(acc, dim=-1, descending=True, stable=True).indices[:, :top_k]
        sel[r] = torch.cat([torch.arange(lo).expand(Hkv, lo), top.sort(-1).values + lo,
                            torch.arange(hi, nblk).expand(Hkv, nblk - hi)], 1).to(sel.dtype)
    return sel


# -- 3. attention over the kept blocks ------------------------------------------------------
@triton.jit
def _qsa_partial_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, seq_ptr, pos_ptr, bt_ptr, stride_bt,
    stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh, stride_lr, stride_lh,
    qk_scale_log2, D, Hkv, count_ptr, o_ptr, stride_or, stride_oh,
    B: tl.constexpr, DENSE: tl.constexpr, KEPT: tl.constexpr, NSPLIT: tl.constexpr,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PAGE: tl.constexpr, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (r, kvh, sg): entries [sg * SPLIT, (sg + 1) * SPLIT) of row r's kept list for KV
    head kvh, in tiles of BLOCK_N entries, online softmax; the split's partial to the workspace."""
    enter(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sg = tl.program_id(2)
    p = tl.load(pos_ptr + r).to(tl.int32)
    if p >= DENSE:
        n_vis = (KEPT - 1) * B + p % B + 1  # the visible prefix of the kept list
        seg_lo = sg * SPLIT
        seg_hi = tl.minimum(n_vis, seg_lo + SPLIT)  # empty splits run no tile; the combine skips them
        table = bt_ptr + tl.load(seq_ptr + r).to(tl.int64) * stride_bt
        sel_row = sel_ptr + r * stride_lr + kvh * stride_lh
        d = tl.arange(0, D_P)
        dmask = d < D
        q = _load_q(q_ptr, r, kvh, stride_qr, stride_qh, D, GROUP, QROWS, D_P)
        m_i = tl.full([QROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([QROWS], dtype=tl.float32)
        acc = tl.zeros([QROWS, D_P], dtype=tl.float32)
        for t0 in range(seg_lo, seg_hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)  # kept-list entries: block t // B of sel, position t % B in it
            jmask = t < seg_hi
            blk = tl.load(sel_row + t // B, mask=jmask, other=0)
            j = blk * B + t % B  # absolute positions, ascending
            page = tl.load(table + j // PAGE, mask=jmask, other=0).to(tl.int64)
            jp = (j % PAGE).to(tl.int64)
            kvmask = jmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + page[:, None] * stride_ks + kvh * stride_kh + jp[:, None] * stride_kl + d[None, :],
                        mask=kvmask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + page[:, None] * stride_vs + kvh * stride_vh + jp[:, None] * stride_vl + d[None, :],
                        mask=kvmask, other=0.0).to(tl.float32)
            m_i, l_i, acc = _attend_block(q, k, v, jmask, m_i, l_i, acc, qk_scale_log2, USE_DOT, INPUT_PRECISION)
        _finish_item(r, kvh, sg, m_i, l_i, acc, 0, n_vis, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, o_ptr,
                     stride_or, stride_oh, D, Hkv, NSPLIT, GROUP, QROWS, D_P, SPLIT, FUSED, False)


@triton.jit
def _qsa_combine_kernel(
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, pos_ptr, stride_or, stride_oh, D, Hkv,
    B: tl.constexpr, DENSE: tl.constexpr, KEPT: tl.constexpr, NSPLIT: tl.constexpr,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.load(pos_ptr + r).to(tl.int32)
    if p >= DENSE:
        n_vis = (KEPT - 1) * B + p % B + 1
        _combine_row(ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, r, kvh, 0, n_vis, stride_or, stride_oh, D, Hkv, NSPLIT,
                     GROUP, QROWS, D_P, SPLIT, "", False)


def qsa_attention_config(q: torch.Tensor, k_cache: torch.Tensor, kept_blocks: int, block: int,
                         split: int | None = None, use_dot: bool | None = None) -> dict:
    """The launch configuration of ``qsa_attention`` for these shapes: split, num_splits,
    BLOCK_N, QROWS, D_P, num_warps, use_dot (functions of the model's shapes, the KV dtype, the
    config and the caller's split only) and the workspace shapes."""
    split = split or QSA_SPLIT
    use_dot = q.is_cuda if use_dot is None else use_dot
    R, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    qrows = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    d_p = max(16, triton.next_power_of_2(D))
    block_n, warps = _attention_config(qrows, d_p, k_cache.element_size(), split)
    if use_dot and block_n < 16:
        raise ValueError(f"split={split} gives {block_n}-entry key tiles: tl.dot needs 16 or more")
    nsplit = triton.cdiv(kept_blocks * block, split)
    return dict(split=split, num_splits=nsplit, block_n=block_n, qrows=qrows, d_p=d_p, num_warps=warps,
                use_dot=use_dot, ws_ml=(R, Hkv, nsplit, qrows), ws_acc=(R, Hkv, nsplit, qrows, d_p))


def qsa_attention_workspace(q: torch.Tensor, k_cache: torch.Tensor, kept_blocks: int, block: int,
                            split: int | None = None, use_dot: bool | None = None) -> tuple:
    """(ws_m, ws_l, ws_acc) float32 for ``qsa_attention(workspace=)``, sized for q's rows."""
    c = qsa_attention_config(q, k_cache, kept_blocks, block, split, use_dot)
    ws_m = torch.empty(c["ws_ml"], dtype=torch.float32, device=q.device)
    return ws_m, torch.empty_like(ws_m), torch.empty(c["ws_acc"], dtype=torch.float32, device=q.device)


def qsa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
                  seq: torch.Tensor, pos: torch.Tensor, sel: torch.Tensor, block: int, scale: float,
                  out: torch.Tensor, dense_positions: int | None = None, *, split: int | None = None,
                  use_dot: bool | None = None, precision: str | None = None, counters: torch.Tensor | None = None,
                  workspace: tuple | None = None) -> torch.Tensor:
    """Attention of each sparse row over its kept blocks, into ``out`` (returned).

    q float32 [R, Hq, D]; k_cache, v_cache [pages, PAGE, Hkv, D] float32/bfloat16 (block_table
    None: contiguous [S, L, Hkv, D]); seq, pos [R]; sel int32 [R, Hkv, kept] (``qsa_select``'s:
    ascending block ids whose last is the row's own block); out float32 [R, Hq, D].
    dense_positions: kept * block (checked; default that). Rows at pos >= dense_positions:
    softmax(q K^T * scale) V over the kept positions <= pos; other rows' out untouched.
    ``split``: kept-list entries per partial program (default QSA_SPLIT; a multiple of the key
    tile), one value per caller. ``use_dot`` / ``precision``: as attention_rows (default tl.dot
    "tf32x3" on a GPU, tl.sum under the interpreter). ``counters``: int32 zeros, at least R *
    Hkv, reusable (left zero): the row's last split program merges (one launch). ``workspace``:
    (ws_m, ws_l, ws_acc) from ``qsa_attention_workspace`` (default allocated here)."""
    _check_block(block)
    precision = precision or ATTENTION_INPUT_PRECISION
    if precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed: allowed {', '.join(ATTENTION_PRECISIONS)}")
    _check_q(q)
    _check_kv("k_cache", k_cache)
    _check_kv("v_cache", v_cache)
    if k_cache.shape != v_cache.shape or k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"k/v caches must be one shape on {q.device}, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    R, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"head dims {D} vs {Dk} must match and Hq={Hq} be a multiple of Hkv={Hkv}")
    bt, page, S_rows, L_max = block_table_args(k_cache, block_table)
    if page % block:
        raise ValueError(f"a page of {page} positions must hold whole blocks of {block}")
    if sel.dim() != 3 or sel.shape[:2] != (R, Hkv) or sel.dtype != torch.int32 or sel.stride(-1) != 1 \
            or sel.device != q.device:
        raise ValueError(f"sel must be int32 [{R}, {Hkv}, kept] with unit last stride on {q.device}, got "
                         f"{sel.dtype} {tuple(sel.shape)}")
    kept = sel.shape[2]
    if dense_positions is not None and dense_positions != kept * block:
        raise ValueError(f"dense_positions={dense_positions} must be kept * block = {kept * block}")
    if out.shape != q.shape or out.dtype != torch.float32 or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be float32 {tuple(q.shape)} with unit stride on {q.device}")
    _check_rows(seq, pos, q.device, S_rows, L_max)
    c = qsa_attention_config(q, k_cache, kept, block, split, use_dot)
    if workspace is None:
        workspace = qsa_attention_workspace(q, k_cache, kept, block, c["split"], c["use_dot"])
    ws_m, ws_l, ws_acc = workspace
    for t, shape in ((ws_m, c["ws_ml"]), (ws_l, c["ws_ml"]), (ws_acc, c["ws_acc"])):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"workspace must be contiguous float32 {c['ws_ml']}, {c['ws_ml']}, {c['ws_acc']}")
    fused = counters is not None
    if fused and (counters.dtype != torch.int32 or counters.numel() < R * Hkv or counters.device != q.device):
        raise ValueError(f"counters must be int32 zeros, at least {R * Hkv} of them, on {q.device}")
    if R == 0:
        return out
    consts = dict(B=block, DENSE=kept * block, KEPT=kept, NSPLIT=c["num_splits"], GROUP=Hq // Hkv,
                  QROWS=c["qrows"], D_P=c["d_p"], SPLIT=c["split"], **launch_kw(q))
    _qsa_partial_kernel[(R, Hkv, c["num_splits"])](
        q, k_cache, v_cache, sel, ws_m, ws_l, ws_acc, seq, pos, bt, bt.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), sel.stride(0), sel.stride(1),
        float(scale) * _LOG2E, D, Hkv, counters if fused else ws_m, out, out.stride(0), out.stride(1),
        BLOCK_N=c["block_n"], PAGE=page, USE_DOT=c["use_dot"], INPUT_PRECISION=precision, FUSED=fused,
        num_warps=c["num_warps"], **consts,
    )
    if not fused:
        _qsa_combine_kernel[(R, Hkv)](ws_m, ws_l, ws_acc, out, pos, out.stride(0), out.stride(1), D, Hkv,
                                      num_warps=4, **consts)
    return out


def qsa_attention_ref(q, k_cache, v_cache, block_table, seq, pos, sel, block: int, scale: float,
                      out: torch.Tensor) -> torch.Tensor:
    """Reference: per sparse row and KV head, the kept positions <= pos gathered through the
    block table, softmax(q K^T * scale) V in float64, into out (float32)."""
    bt, page, _, _ = block_table_args(k_cache, block_table)
    R, Hq, D = q.shape
    Hkv, kept = sel.shape[1], sel.shape[2]
    g = Hq // Hkv
    within = torch.arange(block)
    for r in range(R):
        p = int(pos[r])
        if p < kept * block:
            continue
        t = bt[int(seq[r])].long()
        for h in range(Hkv):
            j = (sel[r, h].long()[:, None] * block + within).flatten()
            j = j[j <= p]
            k = k_cache[t[j // page], j % page, h].double()
            v = v_cache[t[j // page], j % page, h].double()
            qh = q[r, h * g : (h + 1) * g].double()
            out[r, h * g : (h + 1) * g] = (torch.softmax(qh @ k.T * scale, -1) @ v).float()
    return out


# -- checks ---------------------------------------------------------------------------------
def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"block={block!r} must be a power of two")


def _check_q(q: torch.Tensor) -> None:
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16) or q.stride(-1) != 1:
        raise ValueError(f"q must be float32 [R, Hq, D] with unit last stride, got {q.dtype} {tuple(q.shape)}")


def _check_kv(name: str, t: torch.Tensor) -> None:
    if t.dim() != 4 or t.dtype not in (torch.float32, torch.bfloat16) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be float32/bfloat16 [pages, PAGE, Hkv, D] with unit last stride, got "
                         f"{t.dtype} {tuple(t.shape)}")


def _check_summ(summ, pages, page, block, S, Hkv, D, device) -> None:
    if page % block:
        raise ValueError(f"a page of {page} positions must hold whole blocks of {block}")
    want = (pages, page // block, S, Hkv, D)
    if tuple(summ.shape) != want or summ.dtype != torch.float32 or summ.stride(-1) != 1 or summ.device != device:
        raise ValueError(f"summ must be float32 {want} with unit last stride on {device}, got {summ.dtype} "
                         f"{tuple(summ.shape)}")


def _check_rows(seq, pos, device, rows: int, positions: int) -> int:
    """R; seq and pos int32/int64 [R] on device; on the CPU their values in range."""
    R = seq.shape[0] if seq.dim() == 1 else -1
    for name, t in (("seq", seq), ("pos", pos)):
        if t.shape != (R,) or t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise ValueError(f"{name} must be int32/int64 [R] on {device}, got {t.dtype} {tuple(t.shape)}")
    if device.type == "cpu" and R > 0:  # value checks only where they cost no device sync
        if not (0 <= int(seq.min()) and int(seq.max()) < rows):
            raise ValueError(f"seq must lie in [0, {rows})")
        if int(pos.max()) >= positions:
            raise ValueError(f"pos must lie below {positions}")
    return R
