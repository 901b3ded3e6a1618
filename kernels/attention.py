"""Decode and prefill attention for many sequences in one launch; a row's result depends only on it.

A *row* is one query token (all its heads) of some sequence, described by the cache it reads
(``row_seq``), its absolute position (``row_pos``: it sees keys 0..pos) and its sliding window
(``row_window``: 0 = global, else keys j with pos - j < window). Decode is one row per sequence
at pos = len - 1; a prefill chunk is C rows of one sequence at start..start+C-1; a mixed step is
any mix of both. All of them go through the same two kernels:

1. ``_attention_partial_kernel``, one program per (row, kv head, segment): the keys are cut into
   segments of ``segment`` positions (one value per caller; ATTENTION_SEGMENT by default) at
   ABSOLUTE positions [s*SEG, (s+1)*SEG) (split-K for parallelism, but never chosen from the
   batch). A program walks its segment in blocks of
   BLOCK_N keys, also at absolute positions, in increasing order, with an online softmax (exp2,
   scale in log2 units), and writes the unnormalized (max, sum, acc) of the segment. Keys
   outside [lo, pos] are masked and never loaded. The GROUP = Hq / Hkv query heads that share a
   kv head are scored together, so each K/V block is read once per kv head (GQA).
2. ``_attention_combine_kernel``, one program per (row, kv head), merges the row's segments in
   increasing order and normalizes.

The arithmetic for a row is therefore a function of (q row, its cache, pos, window) only:

* decode: row b of a batch is bitwise equal to the solo call;
* prefill: chunking a sequence differently gives bitwise-equal outputs per position, AND equal
  to decode attention at the same position (same kernels, same segments, blocks and order).

Precision: q, K, V float32 or bfloat16, upcast; scores, softmax and P@V in float32; output in
q's dtype. On a GPU the two products are ``tl.dot`` with ATTENTION_INPUT_PRECISION ("tf32x3",
about fp32 accurate; the query heads padded to 16 rows), or, where the caller asks for "bf16",
one bfloat16 MMA each (q and the softmax weights rounded to bfloat16); under the CPU interpreter tl.dot is
numpy sgemm, which is not row-invariant, so there they are written as broadcast multiply +
``tl.sum`` (see qmatmul.py).
Cache entries beyond a row's position are never read, so they may hold anything (the tests fill
them with NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import enter, launch_kw
from .qmma import dot_acc
from .kv_pages import block_table_args
from .step_fused import qk_rope_kv_row, qk_rope_row_args

# Keys per block, by padded head dim and the KV cache's element size, at most the segment (a
# shorter segment is one block): fixed per model shape and runner, never per batch or chunk.
# 4-byte K/V (a float32 engine's pool): tiles near 16K floats.
ATTENTION_BLOCK_N: dict[int, int] = {16: 32, 32: 32, 64: 32, 128: 32, 256: 16, 512: 8}
# 2-byte K/V (the bfloat16 pool): at D = 256 (Gemma 3) 64, so a 64-key segment is one block
# rather than four serial ones (H200, session 9, runs 47-48: with the runner's 64-key segments
# the step went 0.615 / 0.642 / 0.692 / 0.875 -> 0.609 / 0.626 / 0.668 / 0.843 ms at 1 / 4 / 16 /
# 32 slots; 141 KB of shared memory at 4 warps, so float32 K/V keeps 16).
ATTENTION_BLOCK_N_16BIT: dict[int, int] = {**ATTENTION_BLOCK_N, 256: 64}
ATTENTION_SEGMENT = 256  # keys per partial program by default (attention_rows(segment=); a multiple of BLOCK_N)
ATTENTION_SMALL_TILE = 8192  # QROWS * BLOCK_N * D_P up to this: 4 warps, above: 8
# tl.dot precision on a GPU: "tf32x3" (about fp32; on an H200 1.5-2.5x faster than "ieee" for
# Gemma's 4x256 heads at long contexts). Never "tf32". A call may ask for "bf16" instead (a
# bfloat16 engine: q and the softmax weights rounded to bfloat16, K and V taken as bfloat16,
# products exact in float32, float32 accumulation: one MMA per product instead of three).
ATTENTION_INPUT_PRECISION = "tf32x3"
ATTENTION_PRECISIONS = ("tf32x3", "ieee", "bf16")
_LOG2E = 1.4426950408889634
# (Removed in session 13, measured on an H200 and not faster: the segment's K/V lines asked of
# L2 before the PDL wait, session 7 run 32 and session 10 run 50, within the spread; 1 or 2
# pipelining stages for the key-block loop, run 50: 0.680 / 0.669 ms at 16 slots against 0.668.)


def _attention_config(qrows: int, d_p: int, kv_bytes: int = 4, segment: int = ATTENTION_SEGMENT) -> tuple[int, int]:
    """(BLOCK_N, num_warps): a function of the model's head shape, KV element size and the
    caller's segment only."""
    table = ATTENTION_BLOCK_N_16BIT if kv_bytes == 2 else ATTENTION_BLOCK_N
    if d_p not in table:
        raise ValueError(f"head dim up to {max(table)} supported, got padded {d_p}")
    block_n = min(table[d_p], segment)
    if segment % block_n:
        raise ValueError(f"segment={segment} must be a multiple of BLOCK_N={block_n}")
    return block_n, (4 if qrows * block_n * d_p <= ATTENTION_SMALL_TILE else 8)


@triton.jit
def _row_key_range(row_pos_ptr, row_win_ptr, r):
    """[lo, hi): the keys row r sees."""
    pos = tl.load(row_pos_ptr + r).to(tl.int32)
    win = tl.load(row_win_ptr + r).to(tl.int32)
    hi = pos + 1
    lo = tl.where(win > 0, tl.maximum(hi - win, 0), 0)
    return lo, hi


@triton.jit
def _attention_partial_kernel(
    q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr, stride_bt,
    stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
    qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG: tl.constexpr, PAGE: tl.constexpr, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr,
    REL: tl.constexpr, RUN: tl.constexpr = 1, GROUP_P: tl.constexpr = 1, TROWS: tl.constexpr = 16,
):
    enter(PDL)
    if RUN > 1:
        attention_run_item(
            tl.program_id(0), tl.program_id(1), tl.program_id(2),
            q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr,
            stride_bt, stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
            qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
            GROUP, QROWS, D_P, BLOCK_N, SEG, PAGE, USE_DOT, INPUT_PRECISION, FUSED, REL, RUN, GROUP_P, TROWS)
    else:
        attention_item(
            tl.program_id(0), tl.program_id(1), tl.program_id(2),
            q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr,
            stride_bt, stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
            qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
            GROUP, QROWS, D_P, BLOCK_N, SEG, PAGE, USE_DOT, INPUT_PRECISION, FUSED, REL)


@triton.jit
def _attention_rope_kernel(
    q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr, stride_bt,
    stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
    qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
    p_ptr, qn_ptr, kn_ptr, inv_ptr, eps, stride_ps, stride_pm,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG: tl.constexpr, PAGE: tl.constexpr, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, HQ_P: tl.constexpr,
    HKV_P: tl.constexpr, HALF_P: tl.constexpr, NSPLIT: tl.constexpr, HAS_NORM: tl.constexpr,
    PRELOAD: tl.constexpr, REL: tl.constexpr,
):
    """``_attention_partial_kernel`` with ``step_fused.qk_rope_kv`` as every program's prologue:
    the program first runs row r's ``qk_rope_kv_row`` (the separate kernel's body: q into q_ptr,
    K/V into the pools at the row's position), then, after a barrier, its attention program,
    which reads them back. Every program of a row writes the same bytes, and a row's keys are
    read only by its own programs, so this holds where each row's slot has exactly one row in
    the launch (decode). One kernel boundary fewer per layer. PRELOAD (where a segment is one
    block, as the runner's 64-key segments are): before the PDL wait a program loads its
    segment's K and V rows older than the row's position into registers (earlier steps wrote
    them; nothing of this step does), so after the prologue only q and the current row's K/V,
    just stored by the program itself, are read: the same values in the same arithmetic as the
    loads after the barrier (masked lanes 0, the current row from the pool). H200, session 11,
    run 61: 0.570 / 0.623 / 0.790 -> 0.567 / 0.619 / 0.777 ms per step at 1 / 16 / 32 slots."""
    r = tl.program_id(0)
    if PRELOAD:
        k_old, v_old, lo, hi, page = _segment_kv_before(
            r, tl.program_id(1), tl.program_id(2), k_ptr, v_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr,
            stride_bt, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh, D, D_P, BLOCK_N, SEG, PAGE, REL)
    # (the rope's positions, cos / sin and QK-norm weights right after the PDL wait)
    qk_rope_kv_row(r, p_ptr, q_ptr, k_ptr, v_ptr, row_seq_ptr, row_pos_ptr, bt_ptr, stride_bt, qn_ptr, kn_ptr,
                   inv_ptr, eps, stride_ps, stride_pm, stride_qr, stride_ks, stride_kl,
                   HQ, HKV, HD, HALF, HQ_P, HKV_P, HALF_P, NSPLIT, HAS_NORM, PAGE, PDL)
    tl.debug_barrier()  # this program's q, K, V stores before its loads of them
    if PRELOAD:
        attention_item_preloaded(
            r, tl.program_id(1), tl.program_id(2), k_old, v_old, lo, hi, page,
            q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
            stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
            qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
            GROUP, QROWS, D_P, BLOCK_N, SEG, PAGE, USE_DOT, INPUT_PRECISION, FUSED, REL)
    else:
        attention_item(
            r, tl.program_id(1), tl.program_id(2),
            q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr, stride_bt,
            stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
            qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
            GROUP, QROWS, D_P, BLOCK_N, SEG, PAGE, USE_DOT, INPUT_PRECISION, FUSED, REL)


@dataclass(frozen=True)
class RopePrologue:
    """``attention_rows(rope=)``: run ``step_fused.qk_rope_kv(part, q, k_cache, v_cache, row_seq,
    row_pos, q_norm, k_norm, inv_freq, eps)`` inside the attention launch (each program's
    prologue) instead of as a kernel before it. Only where each row's slot has one row in the
    launch; same function, same warps as the separate kernel."""

    part: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    inv_freq: torch.Tensor
    eps: float


@triton.jit
def _load_q(q_ptr, r, kvh, stride_qr, stride_qh, D, GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr):
    """Row r's query heads of kv head kvh, float32 [QROWS, D_P] (padding rows and dims 0)."""
    g = tl.arange(0, QROWS)
    d = tl.arange(0, D_P)
    return tl.load(
        q_ptr + r * stride_qr + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None] & (d < D)[None, :], other=0.0,
    ).to(tl.float32)


@triton.jit
def _attend_block(q, k, v, jmask, m_i, l_i, acc, qk_scale_log2, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """The online softmax's step over one block of keys (k, v float32 [BLOCK_N, D_P], lanes
    outside jmask 0): the updated (m_i, l_i, acc)."""
    return _attend_block_rows(q, k, v, jmask[None, :], m_i, l_i, acc, qk_scale_log2, USE_DOT, INPUT_PRECISION)


@triton.jit
def _attend_block_rows(q, k, v, smask, m_i, l_i, acc, qk_scale_log2, USE_DOT: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr):
    """``_attend_block`` with a mask per query row and key (smask [QROWS or 1, BLOCK_N])."""
    QROWS: tl.constexpr = q.shape[0]
    BLOCK_N: tl.constexpr = k.shape[0]
    D_P: tl.constexpr = k.shape[1]
    if INPUT_PRECISION == "bf16":
        s = dot_acc(tl.zeros([QROWS, BLOCK_N], dtype=tl.float32), q, tl.trans(k), "bf16", USE_DOT)
    elif USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [QROWS, BN]
    else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    s = tl.where(smask, s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if INPUT_PRECISION == "bf16":
        pv = dot_acc(tl.zeros([QROWS, D_P], dtype=tl.float32), p, v, "bf16", USE_DOT)
    elif USE_DOT:
        pv = tl.dot(p, v, input_precision=INPUT_PRECISION)  # [QROWS, D]
    else:
        pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _first_segment(lo, SEG: tl.constexpr, REL: tl.constexpr):
    """The segment a row's workspace slot 0 holds: its first (lo // SEG) in a grid as wide as a
    row's keys span (REL, ``attention_rows(span=)``), segment 0 in one as wide as the context."""
    if REL:
        return lo // SEG
    else:
        return lo * 0


@triton.jit
def _finish_item(r, kvh, sg, m_i, l_i, acc, lo, hi, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, o_ptr,
                 stride_or, stride_oh, D, Hkv, num_seg,
                 GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, SEG: tl.constexpr, FUSED: tl.constexpr,
                 REL: tl.constexpr):
    """Store program (r, kvh, sg)'s segment partial at workspace slot sg; FUSED: the row's last
    program merges them. REL: slot sg holds the row's segment lo // SEG + sg (a grid as wide as
    the most segments a row's keys span, not as the context: ``attention_rows(span=)``)."""
    g = tl.arange(0, QROWS)
    d = tl.arange(0, D_P)
    slot = ((r * Hkv + kvh) * num_seg + sg) * QROWS + g  # [QROWS]
    tl.store(ws_m_ptr + slot, m_i)
    tl.store(ws_l_ptr + slot, l_i)
    # (only the GROUP real query rows of the QROWS tile: the padding rows are never read)
    tl.store(ws_acc_ptr + slot[:, None].to(tl.int64) * D_P + d[None, :], acc, mask=(g < GROUP)[:, None])
    if FUSED:
        # the last of the row's num_seg programs to finish merges them (in segment order, so the
        # same arithmetic as _attention_combine_kernel) and re-arms the counter for the next launch
        tl.debug_barrier()  # every thread's partial stores before the release below
        done = tl.atomic_add(count_ptr + r * Hkv + kvh, 1, sem="acq_rel")
        if done == num_seg - 1:
            _combine_row(ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, r, kvh, lo, hi, stride_or, stride_oh, D, Hkv,
                         num_seg, GROUP, QROWS, D_P, SEG, ".cg", REL)  # (.cg: from L2, never a stale L1 line)
            tl.store(count_ptr + r * Hkv + kvh, 0)


@triton.jit
def _kv_block(k_ptr, v_ptr, table, first, j, jmask, kvh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl,
              stride_vh, d, dmask, PAGE: tl.constexpr):
    """K and V of the block of keys j = first.. (float32 [BLOCK_N, D_P], lanes outside jmask 0):
    the block lies in one page (BLOCK_N divides PAGE), its page from the row's block table."""
    page = tl.load(table + first // PAGE).to(tl.int64)
    kvmask = jmask[:, None] & dmask[None, :]
    jp = (j - (first // PAGE) * PAGE)[:, None].to(tl.int64)  # offsets in the page
    k = tl.load(k_ptr + page * stride_ks + kvh * stride_kh + jp * stride_kl + d[None, :], mask=kvmask,
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + page * stride_vs + kvh * stride_vh + jp * stride_vl + d[None, :], mask=kvmask,
                other=0.0).to(tl.float32)
    return k, v


@triton.jit
def attention_item(
    r, kvh, sg,
    q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr, stride_bt,
    stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
    qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG: tl.constexpr, PAGE: tl.constexpr, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED: tl.constexpr,
    REL: tl.constexpr,
):
    """Program (r, kvh, sg) of ``_attention_partial_kernel``: the kernel's body (the rope
    kernel's too, where its segments are not one block). REL: the program's segment is the
    row's lo // SEG + sg (the same keys, the same arithmetic, as the absolute grid's program of
    that segment)."""
    lo, hi = _row_key_range(row_pos_ptr, row_win_ptr, r)
    sga = sg + _first_segment(lo, SEG, REL)
    seg_lo = tl.maximum(lo, sga * SEG)
    seg_hi = tl.minimum(hi, (sga + 1) * SEG)  # empty segments run no block; the combine skips them
    table = bt_ptr + tl.load(row_seq_ptr + r).to(tl.int64) * stride_bt
    d = tl.arange(0, D_P)
    dmask = d < D
    q = _load_q(q_ptr, r, kvh, stride_qr, stride_qh, D, GROUP, QROWS, D_P)  # [QROWS, D]
    m_i = tl.full([QROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QROWS], dtype=tl.float32)
    acc = tl.zeros([QROWS, D_P], dtype=tl.float32)
    for blk in range(seg_lo // BLOCK_N, tl.cdiv(seg_hi, BLOCK_N)):
        first = blk * BLOCK_N
        j = first + tl.arange(0, BLOCK_N)
        jmask = (j >= seg_lo) & (j < seg_hi)
        k, v = _kv_block(k_ptr, v_ptr, table, first, j, jmask, kvh, stride_ks, stride_kl, stride_kh, stride_vs,
                         stride_vl, stride_vh, d, dmask, PAGE)
        m_i, l_i, acc = _attend_block(q, k, v, jmask, m_i, l_i, acc, qk_scale_log2, USE_DOT, INPUT_PRECISION)
    _finish_item(r, kvh, sg, m_i, l_i, acc, lo, hi, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, o_ptr,
                 stride_or, stride_oh, D, Hkv, num_seg, GROUP, QROWS, D_P, SEG, FUSED, REL)


@triton.jit
def _run_of(r, row_seq_ptr, row_pos_ptr, row_win_ptr, RUN: tl.constexpr):
    """(follows, n) for row r: whether r continues row r - 1's run (then r's programs do
    nothing: the run's first row computes it), and how many rows from r its run holds (1..RUN).
    A run: consecutive rows of one sequence at consecutive positions with one window (a prefill
    chunk's, a verify's), cut where a position is a multiple of RUN (so a row knows from row r - 1
    alone whether it leads)."""
    R = tl.num_programs(0)
    i = tl.arange(0, RUN)
    rr = r + i
    inside = rr < R
    seq0 = tl.load(row_seq_ptr + r)
    pos0 = tl.load(row_pos_ptr + r)
    win0 = tl.load(row_win_ptr + r)
    seq = tl.load(row_seq_ptr + rr, mask=inside, other=0)
    pos = tl.load(row_pos_ptr + rr, mask=inside, other=0)
    win = tl.load(row_win_ptr + rr, mask=inside, other=0)
    cont = inside & (seq == seq0) & (win == win0) & (pos == pos0 + i) & ((i == 0) | (pos % RUN != 0))
    n = tl.min(tl.where(cont, RUN, i))  # (row r itself always continues: n >= 1)
    prev = tl.maximum(r - 1, 0)
    follows = (r > 0) & (pos0 % RUN != 0) & (tl.load(row_seq_ptr + prev) == seq0) \
        & (tl.load(row_win_ptr + prev) == win0) & (tl.load(row_pos_ptr + prev) + 1 == pos0)
    return follows, n


@triton.jit
def attention_run_item(
    r, kvh, sg,
    q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr, stride_bt,
    stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
    qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG: tl.constexpr, PAGE: tl.constexpr, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED: tl.constexpr,
    REL: tl.constexpr, RUN: tl.constexpr, GROUP_P: tl.constexpr, TROWS: tl.constexpr,
):
    """Program (r, kvh, sg) where rows run together (``attention_rows(runs=True)``): if row r
    leads a run of n rows (``_run_of``), the program computes segment sg of all n rows at once,
    their query heads stacked in one [TROWS, D_P] tile (row i's heads at tile rows i * GROUP_P ..),
    so each K/V block is read once for the run instead of once a row, and the tile's rows are
    other rows' heads instead of padding. Each tile row's result is its own row's: the products
    give a row of their output from that row of q alone (as the query heads' padding relies on
    in ``attention_item``); each row masks the keys outside its own [lo, hi) in this segment,
    exactly as its own program would; and a block outside a row's range (the union of the run's
    ranges is walked) leaves that row's (m, l, acc) untouched (selected, not updated), where its
    own program would not have visited the block. So every row's partials, and its output, are
    bitwise those of ``attention_item``. Masked lanes of K/V inside the union hold other rows'
    keys instead of 0: a row's softmax weight there is exactly 0, so they add nothing. REL: the
    grid starts at the first row's first segment; the caller widens it by RUN - 1 keys, so the
    last row's last segment is in it; a row's partial of absolute segment a goes to its slot
    a - (its own first), as its own program would store it."""
    follows, n = _run_of(r, row_seq_ptr, row_pos_ptr, row_win_ptr, RUN)
    if not follows:
        t = tl.arange(0, TROWS)
        ti = t // GROUP_P  # the run row of each tile row
        th = t % GROUP_P  # its query head within the kv head's group
        real = (ti < n) & (th < GROUP)
        lo0, hi0 = _row_key_range(row_pos_ptr, row_win_ptr, r)
        lo_t, hi_t = _row_key_range(row_pos_ptr, row_win_ptr, r + tl.minimum(ti, n - 1))  # (each tile row's own)
        sga = sg + _first_segment(lo0, SEG, REL)
        seg_lo_t = tl.maximum(lo_t, sga * SEG)
        seg_hi_t = tl.where(ti < n, tl.minimum(hi_t, (sga + 1) * SEG), 0)
        seg_lo = tl.maximum(lo0, sga * SEG)  # the run's keys in this segment (their union)
        seg_hi = tl.minimum(hi0 + n - 1, (sga + 1) * SEG)
        table = bt_ptr + tl.load(row_seq_ptr + r).to(tl.int64) * stride_bt
        d = tl.arange(0, D_P)
        dmask = d < D
        q = tl.load(q_ptr + (r + ti)[:, None] * stride_qr + (kvh * GROUP + th)[:, None] * stride_qh + d[None, :],
                    mask=real[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [TROWS, D]
        m_i = tl.full([TROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([TROWS], dtype=tl.float32)
        acc = tl.zeros([TROWS, D_P], dtype=tl.float32)
        for blk in range(seg_lo // BLOCK_N, tl.cdiv(seg_hi, BLOCK_N)):
            first = blk * BLOCK_N
            j = first + tl.arange(0, BLOCK_N)
            k, v = _kv_block(k_ptr, v_ptr, table, first, j, (j >= seg_lo) & (j < seg_hi), kvh, stride_ks, stride_kl,
                             stride_kh, stride_vs, stride_vl, stride_vh, d, dmask, PAGE)
            own = (j[None, :] >= seg_lo_t[:, None]) & (j[None, :] < seg_hi_t[:, None])
            m_new, l_new, acc_new = _attend_block_rows(q, k, v, own, m_i, l_i, acc, qk_scale_log2, USE_DOT,
                                                       INPUT_PRECISION)
            seen = (seg_lo_t < seg_hi_t) & (first < seg_hi_t) & (first + BLOCK_N > seg_lo_t)  # the row's own blocks
            m_i = tl.where(seen, m_new, m_i)
            l_i = tl.where(seen, l_new, l_i)
            acc = tl.where(seen[:, None], acc_new, acc)
        slot_t = sga - _first_segment(lo_t, SEG, REL)
        keep = real & (slot_t >= 0) & (slot_t < num_seg)
        slot = (((r + ti) * Hkv + kvh) * num_seg + slot_t) * QROWS + th
        tl.store(ws_m_ptr + slot, m_i, mask=keep)
        tl.store(ws_l_ptr + slot, l_i, mask=keep)
        tl.store(ws_acc_ptr + slot[:, None].to(tl.int64) * D_P + d[None, :], acc, mask=keep[:, None])
        if FUSED:  # (as _finish_item: the run's last program merges each of its rows, in order)
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + r * Hkv + kvh, 1, sem="acq_rel")
            if done == num_seg - 1:
                for i in range(n):
                    lo, hi = _row_key_range(row_pos_ptr, row_win_ptr, r + i)
                    _combine_row(ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, r + i, kvh, lo, hi, stride_or, stride_oh,
                                 D, Hkv, num_seg, GROUP, QROWS, D_P, SEG, ".cg", REL)
                tl.store(count_ptr + r * Hkv + kvh, 0)


@triton.jit
def _segment_kv_before(r, kvh, sg, k_ptr, v_ptr, row_seq_ptr, row_pos_ptr, row_win_ptr, bt_ptr, stride_bt,
                       stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh, D,
                       D_P: tl.constexpr, BLOCK_N: tl.constexpr, SEG: tl.constexpr, PAGE: tl.constexpr,
                       REL: tl.constexpr):
    """Program (r, kvh, sg)'s one-block segment of K and V in the pools' dtype, the rows the
    step does not write (below the row's position; masked lanes 0): loadable before the PDL
    wait (the row and block tables are written before the step's first kernel). Returns (k, v,
    lo, hi, page): with the row's key range and the segment's page (the segment lies in one page;
    0 where the row sees none of it, a page it never reads), which ``attention_item_preloaded``
    takes."""
    tl.static_assert(SEG == BLOCK_N, "the preloaded form takes one-block segments")
    lo, hi = _row_key_range(row_pos_ptr, row_win_ptr, r)
    first = (sg + _first_segment(lo, SEG, REL)) * SEG
    seen = (first < hi) & (first + SEG > lo)  # (else the table may have no entry here)
    page = tl.load(bt_ptr + tl.load(row_seq_ptr + r).to(tl.int64) * stride_bt + first // PAGE, mask=seen,
                   other=0).to(tl.int64)
    j = first + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_P)
    old = ((j >= lo) & (j < hi - 1))[:, None] & (d < D)[None, :]
    jp = (j - (first // PAGE) * PAGE)[:, None].to(tl.int64)
    k = tl.load(k_ptr + page * stride_ks + kvh * stride_kh + jp * stride_kl + d[None, :], mask=old, other=0.0)
    v = tl.load(v_ptr + page * stride_vs + kvh * stride_vh + jp * stride_vl + d[None, :], mask=old, other=0.0)
    return k, v, lo, hi, page


@triton.jit
def attention_item_preloaded(
    r, kvh, sg, k_old, v_old, lo, hi, page,
    q_ptr, k_ptr, v_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    stride_qr, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
    qk_scale_log2, D, Hkv, num_seg, count_ptr, o_ptr, stride_or, stride_oh,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG: tl.constexpr, PAGE: tl.constexpr, USE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED: tl.constexpr,
    REL: tl.constexpr,
):
    """``attention_item`` for a one-block segment whose older K/V rows are k_old / v_old
    (``_segment_kv_before``, with the row's key range [lo, hi) and the segment's page): the row's
    current K/V row (the position, just stored) is read from the pools and put in its lane; then
    the same block step and finish, so the same values."""
    sga = sg + _first_segment(lo, SEG, REL)
    seg_lo = tl.maximum(lo, sga * SEG)
    seg_hi = tl.minimum(hi, (sga + 1) * SEG)
    d = tl.arange(0, D_P)
    j = sga * SEG + tl.arange(0, BLOCK_N)
    cur = hi - 1
    here = (d < D) & ((cur + 0 * d) >= sga * SEG) & ((cur + 0 * d) < (sga + 1) * SEG)  # (vector masks: interpreter)
    q = _load_q(q_ptr, r, kvh, stride_qr, stride_qh, D, GROUP, QROWS, D_P)
    cp = (cur - (sga * SEG // PAGE) * PAGE).to(tl.int64)  # (where here: the current row lies in this page)
    kc = tl.load(k_ptr + page * stride_ks + kvh * stride_kh + cp * stride_kl + d, mask=here, other=0.0)
    vc = tl.load(v_ptr + page * stride_vs + kvh * stride_vh + cp * stride_vl + d, mask=here, other=0.0)
    at = (j == cur)[:, None]
    k = tl.where(at, kc[None, :], k_old).to(tl.float32)
    v = tl.where(at, vc[None, :], v_old).to(tl.float32)
    m_i = tl.full([QROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QROWS], dtype=tl.float32)
    acc = tl.zeros([QROWS, D_P], dtype=tl.float32)
    if seg_lo < seg_hi:  # (an empty segment runs no block, as in attention_item)
        m_i, l_i, acc = _attend_block(q, k, v, (j >= seg_lo) & (j < seg_hi), m_i, l_i, acc, qk_scale_log2,
                                      USE_DOT, INPUT_PRECISION)
    _finish_item(r, kvh, sg, m_i, l_i, acc, lo, hi, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, o_ptr,
                 stride_or, stride_oh, D, Hkv, num_seg, GROUP, QROWS, D_P, SEG, FUSED, REL)


@triton.jit
def _combine_row(ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, r, kvh, lo, hi, stride_or, stride_oh, D, Hkv, num_seg,
                 GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, SEG: tl.constexpr,
                 CACHE: tl.constexpr, REL: tl.constexpr):
    """Merge row r's segment partials in increasing segment order, normalize, store (REL: the
    partial of segment sg at slot sg - lo // SEG)."""
    g = tl.arange(0, QROWS)
    d = tl.arange(0, D_P)
    m_i = tl.full([QROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QROWS], dtype=tl.float32)
    acc = tl.zeros([QROWS, D_P], dtype=tl.float32)
    first = _first_segment(lo, SEG, REL)
    for sg in range(lo // SEG, tl.cdiv(hi, SEG)):
        slot = ((r * Hkv + kvh) * num_seg + sg - first) * QROWS + g
        m_s = tl.load(ws_m_ptr + slot, cache_modifier=CACHE)
        m_new = tl.maximum(m_i, m_s)
        a = tl.exp2(m_i - m_new)
        b = tl.exp2(m_s - m_new)
        l_i = l_i * a + tl.load(ws_l_ptr + slot, cache_modifier=CACHE) * b
        acc = acc * a[:, None] + tl.load(ws_acc_ptr + slot[:, None].to(tl.int64) * D_P + d[None, :],
                                         mask=(g < GROUP)[:, None], other=0.0, cache_modifier=CACHE) * b[:, None]
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + r * stride_or + (kvh * GROUP + g)[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (d < D)[None, :],
    )


@triton.jit
def _attention_combine_kernel(
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, row_pos_ptr, row_win_ptr,
    stride_or, stride_oh, D, Hkv, num_seg,
    GROUP: tl.constexpr, QROWS: tl.constexpr, D_P: tl.constexpr, SEG: tl.constexpr, PDL: tl.constexpr,
    REL: tl.constexpr,
):
    enter(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    lo, hi = _row_key_range(row_pos_ptr, row_win_ptr, r)
    _combine_row(ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, r, kvh, lo, hi, stride_or, stride_oh, D, Hkv, num_seg,
                 GROUP, QROWS, D_P, SEG, "", REL)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along the head dim")


def attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    row_window: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_pos: int | None = None,
    use_dot: bool | None = None,
    counters: torch.Tensor | None = None,
    precision: str | None = None,
    num_warps: int | None = None,
    rope: RopePrologue | None = None,
    segment: int | None = None,
    block_table: torch.Tensor | None = None,
    span: int | None = None,
    mass: torch.Tensor | None = None,
    runs: bool = False,
) -> torch.Tensor:
    """Attention of R query rows, each against its own sequence's cache.

    q [R, Hq, D]; k_cache, v_cache [S, L_max, Hkv, D] (a pool of S sequences); row_seq [R] in
    [0, S); row_pos [R] in [0, L_max) (the row's K/V must already be in the cache at row_pos);
    row_window [R] (0 = global). With ``block_table`` (int32 [S, W], kernels/kv_pages.py) the
    caches are pages [P, PAGE, Hkv, D] instead, row_seq picks a table row and row_pos lies in
    [0, W * PAGE). Hq must be a multiple of Hkv. Returns [R, Hq, D] in q's dtype.
    ``max_pos`` (a bound on row_pos, optional) only sizes the launch and workspace; ``use_dot``
    picks the product form (default: tl.dot on a GPU; see the module docstring). ``counters``:
    int32 zeros, at least R * Hkv of them, owned by the caller and reusable across calls (each
    call leaves them zero): the last partial program of a row merges the row itself (one launch
    instead of two; bitwise the same result). ``precision``: the products' (ATTENTION_PRECISIONS;
    default ATTENTION_INPUT_PRECISION), one choice per caller, so rows stay invariant.
    ``num_warps``: the partial kernel's (default: by tile size; a reduction's order follows the
    warps, so one value per caller). ``rope`` (a RopePrologue; the fused combine only): q is
    first written from the q|k|v partials, and K/V at the rows' positions, by QK-norm + rope
    inside this launch (``_attention_rope_kernel``); each row's slot must have exactly one row
    here (a decode step). ``segment``: keys per partial program (default ATTENTION_SEGMENT), one
    value per caller (prefill and decode alike), so rows stay invariant. ``span`` (optional): the
    most keys any row sees (a sliding window; QSA's boundary): the grid is then as wide as the
    segments such a range can touch, each row's programs starting at its first segment, instead
    of one program per segment of the context (H200 run 85: at 32K positions and 16 rows the
    sliding layers' empty programs and their workspace stores took most of the step). Which
    program computes a segment changes, what it computes does not: bitwise the same.
    ``mass`` (float32 [pages], with ``block_table``): each page's share of every row's and query
    head's softmax is added to it (``segment_mass``, from the partials' (max, sum) after the
    launches; the output's bits do not depend on it).
    ``runs``: rows that run together (consecutive rows of one sequence at consecutive positions:
    a prefill chunk's, a speculative verify's) are computed by their run's first row's programs,
    RUN = 16 // (the query heads per kv head, rounded up to a power of two) rows at a time, their
    heads filling the products' 16-row tile that one row's heads pad (``attention_run_item``):
    each K/V block read once a run instead of once a row. Bitwise the same output (each row
    computed as its own programs would); not with ``rope`` (one row per slot there) nor ``mass``
    (it reads every row's partial of every segment, which a run leaves unwritten outside each
    row's keys).
    """
    segment = segment or ATTENTION_SEGMENT
    precision = precision or ATTENTION_INPUT_PRECISION
    if precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed: allowed {', '.join(ATTENTION_PRECISIONS)}")
    _check_float("q", q)
    _check_float("k_cache", k_cache)
    _check_float("v_cache", v_cache)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [R, Hq, D] and k/v caches [S, L_max, Hkv, D] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    R, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    bt, page, S, L_max = block_table_args(k_cache, block_table, segment)
    if Dk != D or Hq % Hkv:
        raise ValueError(f"head dims {D} vs {Dk} must match and Hq={Hq} be a multiple of Hkv={Hkv}")
    for name, t in (("row_seq", row_seq), ("row_pos", row_pos), ("row_window", row_window)):
        if t.shape != (R,) or t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
            raise ValueError(f"{name} must be int32/int64 [{R}] on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError("q and the caches must be on one device")
    if q.device.type == "cpu" and R:  # value checks only where they cost no device sync
        if not (0 <= int(row_seq.min()) and int(row_seq.max()) < S):
            raise ValueError(f"row_seq must lie in [0, {S})")
        if not (0 <= int(row_pos.min()) and int(row_pos.max()) < L_max):
            raise ValueError(f"row_pos must lie in [0, {L_max})")
        if int(row_window.min()) < 0:
            raise ValueError("row_window must be >= 0")
        if max_pos is not None and int(row_pos.max()) > max_pos:
            raise ValueError(f"max_pos={max_pos} is below a row_pos")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with unit stride on {q.device}")
    if R == 0:
        return out
    use_dot = q.is_cuda if use_dot is None else use_dot
    group = Hq // Hkv
    qrows = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    d_p = max(16, triton.next_power_of_2(D))
    block_n, warps = _attention_config(qrows, d_p, k_cache.element_size(), segment)
    num_warps = num_warps or warps
    group_p = triton.next_power_of_2(group)
    run = max(1, 16 // group_p) if runs and rope is None and mass is None else 1
    num_seg = triton.cdiv(min(L_max, L_max if max_pos is None else max_pos + 1), segment)
    rel = False
    if span is not None:
        if span < 1:
            raise ValueError(f"span={span} must be >= 1")
        wide = span + run - 1  # (a run's programs start at its first row's first segment)
        if triton.cdiv(wide + segment - 1, segment) < num_seg:
            num_seg, rel = triton.cdiv(wide + segment - 1, segment), True
    ws_m = torch.empty((R, Hkv, num_seg, qrows), dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty((R, Hkv, num_seg, qrows, d_p), dtype=torch.float32, device=q.device)
    fused = counters is not None
    if fused and (counters.dtype != torch.int32 or counters.numel() < R * Hkv or counters.device != q.device):
        raise ValueError(f"counters must be int32 zeros, at least {R * Hkv} of them, on {q.device}")
    common = (q, k_cache, v_cache, ws_m, ws_l, ws_acc, row_seq, row_pos, row_window, bt, bt.stride(0),
              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
              float(scale) * _LOG2E, D, Hkv, num_seg, counters if fused else ws_m, out, out.stride(0), out.stride(1))
    consts = dict(GROUP=group, QROWS=qrows, D_P=d_p, BLOCK_N=block_n, SEG=segment, PAGE=page, USE_DOT=use_dot,
                  INPUT_PRECISION=precision, FUSED=fused, REL=rel, num_warps=num_warps)
    if mass is not None and block_table is None:
        raise ValueError("mass= needs a block_table: it is counted per page")
    if rope is not None:
        _launch_rope(common, consts, rope, q, k_cache, v_cache, num_seg)
    else:
        # (a run's tile: RUN rows' heads, 16 rows as one row's padded heads on a GPU, so the same shapes)
        _attention_partial_kernel[(R, Hkv, num_seg)](*common, **consts, RUN=run, GROUP_P=group_p,
                                                     TROWS=run * group_p, **launch_kw(q))
        if not fused:
            _attention_combine_kernel[(R, Hkv)](
                ws_m, ws_l, ws_acc, out, row_pos, row_window, out.stride(0), out.stride(1), D, Hkv, num_seg,
                GROUP=group, QROWS=qrows, D_P=d_p, SEG=segment, REL=rel, num_warps=4, **launch_kw(q),
            )
    if mass is not None:
        segment_mass(ws_m, ws_l, group, row_seq, row_pos, row_window, bt, page, segment, rel, mass)
    return out


def segment_mass(ws_m, ws_l, group: int, row_seq, row_pos, row_window, block_table, page: int, segment: int,
                 rel: bool, mass: torch.Tensor) -> None:
    """Add each page's attention mass to ``mass``: from the partial programs' per-segment
    (max, sum) of every row and query head (base-2 logits), a segment's share of the row's
    softmax is sum_s * 2^(max_s - M) / L, M the row's largest max and L the rescaled sums'
    total; shares of the segments a page holds go to that page through the row's table. Torch
    ops on the device (no sync, fixed shapes: CUDA graphs capture them); padding rows land on
    the scratch page, slots outside a row's keys hold a zero share (an empty segment's sum is 0)."""
    R, _, num_seg, _ = ws_m.shape
    m, l = ws_m[..., :group], ws_l[..., :group]
    w = l * torch.exp2(m - m.amax(dim=2, keepdim=True))
    share = (w / w.sum(dim=2, keepdim=True)).sum(dim=(1, 3))  # [R, num_seg]
    slots = torch.arange(num_seg, device=ws_m.device)
    first = torch.zeros_like(row_pos, dtype=torch.int64)
    if rel:
        hi = row_pos.long() + 1
        lo = torch.where(row_window > 0, (hi - row_window.long()).clamp(min=0), torch.zeros_like(hi))
        first = lo // segment
    logical = ((first[:, None] + slots[None, :]) * segment // page).clamp(max=block_table.shape[1] - 1)
    pages = block_table.long()[row_seq.long()[:, None], logical].clamp(0, mass.shape[0] - 1)
    mass.index_add_(0, pages.flatten(), share.flatten().to(mass.dtype))


def _launch_rope(common: tuple, consts: dict, rope: RopePrologue, q, k_cache, v_cache, num_seg: int) -> None:
    if not consts["FUSED"] or q.dtype != torch.float32 or not q.is_contiguous() or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous():
        raise ValueError("the rope prologue needs the fused combine (counters), a contiguous float32 q [R, Hq, D] "
                         "and contiguous caches")
    args, row = qk_rope_row_args(rope.part, q, k_cache, rope.q_norm, rope.k_norm, rope.inv_freq, rope.eps)
    row["HD"] = row.pop("D")  # (the partial kernel's D is its runtime head dim)
    _attention_rope_kernel[(q.shape[0], k_cache.shape[2], num_seg)](
        *common, rope.part, *args, **consts, **row, PRELOAD=consts["SEG"] == consts["BLOCK_N"], **launch_kw(q),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    window: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
    segment: int | None = None,
) -> torch.Tensor:
    """One decode token per sequence: q [B, Hq, D] against caches [B, L_max, Hkv, D].

    lens [B]: valid cache length per sequence, the current token included (query at lens - 1);
    window [B]: sliding window per sequence, 0 = global.
    """
    B = q.shape[0]
    if k_cache.dim() != 4 or k_cache.shape[0] != B:
        raise ValueError(f"k_cache must be [{B}, L_max, Hkv, D], got {tuple(k_cache.shape)}")
    row_seq = torch.arange(B, device=q.device, dtype=torch.int32)
    return attention_rows(q, k_cache, v_cache, row_seq, lens - 1, window, scale, out, use_dot=use_dot,
                          segment=segment)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    window: int,
    scale: float,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
    segment: int | None = None,
) -> torch.Tensor:
    """A chunk of C queries at positions start..start+C-1 of one sequence (causal, windowed).

    q [C, Hq, D]; k_cache, v_cache [L_max, Hkv, D] already holding positions 0..start+C-1.
    """
    if k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"prefill caches must be [L_max, Hkv, D], got {tuple(k_cache.shape)}")
    C = q.shape[0]
    if start < 0 or window < 0:
        raise ValueError(f"start={start} and window={window} must be >= 0")
    row_pos = torch.arange(start, start + C, device=q.device, dtype=torch.int32)
    row_seq = torch.zeros(C, device=q.device, dtype=torch.int32)
    row_win = torch.full((C,), window, device=q.device, dtype=torch.int32)
    return attention_rows(q, k_cache[None], v_cache[None], row_seq, row_pos, row_win, scale, out,
                          max_pos=start + C - 1, use_dot=use_dot, segment=segment)


def attention_rows_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    row_window: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference: per row, softmax(q K^T * scale + mask) V in float32 with an explicit mask."""
    R, Hq, D = q.shape
    L_max, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty(R, Hq, D, dtype=torch.float32, device=q.device)
    j = torch.arange(L_max, device=q.device)
    for r in range(R):
        seq, pos, win = int(row_seq[r]), int(row_pos[r]), int(row_window[r])
        visible = (j <= pos) & ((win == 0) | (pos - j < win))
        k = k_cache[seq].float()[visible].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[seq].float()[visible].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].float(), k) * scale
        out[r] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def decode_attention_ref(q, k_cache, v_cache, lens, window, scale) -> torch.Tensor:
    row_seq = torch.arange(q.shape[0], device=q.device)
    return attention_rows_ref(q, k_cache, v_cache, row_seq, lens - 1, window, scale)


def prefill_attention_ref(q, k_cache, v_cache, start: int, window: int, scale: float) -> torch.Tensor:
    C = q.shape[0]
    row_pos = torch.arange(start, start + C, device=q.device)
    return attention_rows_ref(q, k_cache[None], v_cache[None], torch.zeros_like(row_pos), row_pos,
                              torch.full_like(row_pos, window), scale)
