"""y[M, N] = x[M, K] @ W^T on tensor cores, from packed GGUF weights; batch-invariant in M.

The third form of the quantized product (``qmatmul.py`` has the other two). It reads the same
``PackedWeight`` planes as the FMA GEMV and decodes them with the same expressions
(``qmatmul._decode_planes``), but multiplies on tensor cores with the operands swapped:

* a program owns BLOCK_N output features x a fixed tile of BLOCK_M rows of x (16; 32 where a
  config says so, fixed per weight), and computes ``y^T[BLOCK_N, 16] = W[BLOCK_N, K] @ x^T[K, 16]``:
  the weights are the MMA's wide operand, the batch is its narrow one. A decode step's 1..16
  rows therefore cost one tile, as in llama.cpp's MMQ kernels and TensorRT-LLM's "swap AB" GEMMs.
* the first K step's weights are fetched and decoded before ``pdl.enter`` (weights are never
  written by a step), so under programmatic dependent launch they overlap the producer of x.
* epilogues that ride on the launch: ``GluEpilogue`` (a [gate | up] weight also writes
  act(gate) * up) and ``HeadsEpilogue`` (a q|k|v weight also does QK-norm + rope + the KV write),
  and ``NormEpilogue`` (the attention-output and FFN-down weights also do the residual add and
  the next norm), each by the last program of its column group over acquire-release counters.
* per fixed BLOCK_K step of the program's K range the weight tile is decoded once in registers,
  plane by plane ([BLOCK_N, G*S] per plane, see ``PackedWeight``), and each plane is one
  ``tl.dot`` against the x values at that plane's K positions (gathered; x is small and cached).
* Precision (``prec``): "bf16": weights and x rounded to bfloat16, products exact in float32,
  float32 accumulation (the precision of the torch path's bfloat16 engine, and of cuBLAS bf16);
  "tf32x3": float32 operands, three TF32 products (about float32 accurate). The runner takes
  "bf16" for a bfloat16 engine and "tf32x3" for a float32 one.
* Invariance: tile shapes, the K slices (``PackedWeight.slice_k``, ``qmatmul.k_slice``'s
  shape-only rule as for the other forms, so the runner's split-K consumers are shared) and K
  order are fixed by the weight; M is not specialized; a row is one column of the MMA's output,
  computed by the same instructions whatever the other columns hold. Under the CPU interpreter tl.dot is
  numpy's sgemm, whose results depend on a column's neighbours, so there the same products are
  a broadcast multiply + ``tl.sum`` over the same (bf16-rounded) operands: each device's form is
  batch-invariant; they are not bitwise equal to each other, nor to the GEMV form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .pdl import enter_or_wait, launch_kw
from .qmatmul import (
    _GEMV_GEOMETRY,
    NORM_FOLD_MAX_N,
    GLU_ACTS,
    GluEpilogue,
    HeadsEpilogue,
    NormEpilogue,
    PackedWeight,
    clamp_block_k,
    _packed_program,
    _decode_loaded,
    _step_loads,
    _step_planes,
    _x_offsets,
    check_x_out,
    gemv_config,
    glu_args,
    heads_counters,
    norm_counters,
    num_k_splits,
    packed_geometry,
    packed_launch_args,
    qgemv_item,
    steps_fit,
    sum_splits,
)
from .step_fused import _glu_math, _sum_parts, add_norm_epilogue, glu_pair_epilogue, heads_epilogue

QMMA_BLOCK_M = 16  # rows of x per program (the MMA's narrow side) unless a config says otherwise


@dataclass(frozen=True)
class MmaConfig:
    block_n: int  # output features per program (the MMA's wide side)
    block_k: int  # weights along K per step: divides QMATMUL_SPLIT_K, a power-of-two number of groups
    num_warps: int = 4
    num_stages: int = 1
    # rows per program, fixed per weight (16 or 32): 32 rows take one tile instead of two (each
    # decoding the weights again), at the price of a 32-wide MMA for 1..16 rows (measured slower
    # at every slot count: docs/GPU_NOTES.md, session 5).
    block_m: int = QMMA_BLOCK_M
    # L2 prefetch (GPU only; unsplit weights, whose program tiles are contiguous bytes): None
    # off; 0: a program first asks L2 for its whole tile (every K step in flight at once, not one
    # step ahead); p > 0: also the tile p programs ahead (a later wave's weights during this one).
    prefetch: int | None = None
    # Fetch each K step's bytes one step ahead (the second step's before the PDL wait) and decode
    # them when the step comes, so that a program of two or more steps does not wait on a weight
    # load after its input is ready. Same bits: the same decode and products in the same order.
    preload: bool = False


# Per format; fixed (never chosen from M). Wide weights (the head, unsplit) may differ.
# Q5_0 (Gemma 3 270M's q|k|v and gate|up): 32 outputs per program, measured under PDL on an H200
# (docs/GPU_NOTES.md, session 4): 0.848 -> 0.831 ms at 1 slot, 1.125 -> 1.080 at 16 vs 64.
# Q4_K, Q6_K, Q8_0: one 256-weight K step per program (all its weights decoded before the PDL
# wait): with every layer on tensor cores 0.987 ms at 16 slots vs 1.060 with 128-weight steps.
QMMA_CONFIGS: dict[str, MmaConfig] = {
    "Q8_0": MmaConfig(block_n=64, block_k=256),
    "Q5_0": MmaConfig(block_n=32, block_k=128),
    "Q4_K": MmaConfig(block_n=64, block_k=256),
    "Q6_K": MmaConfig(block_n=64, block_k=256),
}
# The head (unsplit; when the runner keeps it packed): unpipelined was the fastest of six
# tilings on an H200 (session 3). It runs at ~1 TB/s (160-210 us of a step); an L2 prefetch of
# each program's tile first (``MmaConfig.prefetch`` 0) gained 1%, of tiles 132-1056 programs
# ahead nothing (session 5): the decode's instructions bound it, not memory.
QMMA_WIDE_CONFIGS: dict[str, MmaConfig] = {
    "Q8_0": MmaConfig(block_n=64, block_k=128, num_warps=4, num_stages=1, prefetch=0),
}
QMMA_PRECISIONS = ("bf16", "tf32x3")
# The dense head's products may also take float16 operands ("f16": dense_mma / q8_dense_mma only,
# where the runner has proved at load that x and the weights stay inside float16's range)
DENSE_PRECISIONS = (*QMMA_PRECISIONS, "f16")
QMMA_INTERPRETER_MIN_BLOCK_N = 128  # fewer, wider programs under the CPU interpreter


def mma_config(name: str, N: int, K: int, device: torch.device | str = "cuda",
               slice_k: int | None = None) -> MmaConfig:
    """The launch configuration for a packed weight of format ``name``, N x K (never M);
    ``slice_k`` (the weight's K slice, ``PackedWeight.slice_k``): steps of at most that."""
    wide = num_k_splits(N, K) == 1 and name in QMMA_WIDE_CONFIGS
    cfg = clamp_block_k(QMMA_WIDE_CONFIGS[name] if wide else QMMA_CONFIGS[name], K, slice_k)
    if torch.device(device).type == "cpu":
        cfg = replace(cfg, block_n=max(cfg.block_n, QMMA_INTERPRETER_MIN_BLOCK_N), num_stages=1)
    return cfg


@triton.jit
def _round_bf16(v, EXPLICIT: tl.constexpr):
    """float32 -> bfloat16, rounded to nearest even. On a GPU the conversion instruction does
    that; Triton's CPU interpreter truncates instead, so there (EXPLICIT) the rounding is done on
    the bits first (finite inputs), and the conversion of the rounded value is exact."""
    if EXPLICIT:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _x_tile(x_ptr, offs, mask, stride_xs, XF, XGLU: tl.constexpr, XSPLIT: tl.constexpr):
    """x at ``offs``: as stored, or (XGLU = 1 + the activation's index in GLU_ACTS) act(gate) * up
    formed from a fused [gate | up] product's split-K partials (x_ptr: split 0's gate columns,
    XF: where up's start, stride_xs: the split stride): both added in slice order, then
    ``_glu_math``, the arithmetic of the GLU fold and kernel: the values their float32 output
    held, bitwise under the interpreter (on a GPU the compiler may contract either kernel's
    expression into FMAs its own way)."""
    if XGLU > 0:
        g = _sum_parts(x_ptr, offs, mask, stride_xs, XSPLIT, "")
        u = _sum_parts(x_ptr + XF, offs, mask, stride_xs, XSPLIT, "")
        xt = _glu_math(g, u, XGLU - 1)
    else:
        xt = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return xt


@triton.jit
def _plane_dot(acc, w, x_ptr, xoff, xmask, m, mmask, stride_xm, stride_xs, XF,
               GS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr,
               XGLU: tl.constexpr, XSPLIT: tl.constexpr):
    """acc[BN, BM] += W_plane[BN, GS] @ x^T[GS, BM], x^T gathered at K offsets ``xoff`` [GS]
    (``_x_tile``: x, or the GLU of the partials it points at)."""
    w = tl.reshape(w, [BLOCK_N, GS])
    xt = _x_tile(x_ptr, m[None, :] * stride_xm + xoff[:, None], xmask[:, None] & mmask[None, :], stride_xs, XF,
                 XGLU, XSPLIT)
    return dot_acc(acc, w, xt, PREC, USE_DOT)


@triton.jit
def dot_acc(acc, w, xt, PREC: tl.constexpr, USE_DOT: tl.constexpr):
    """acc[BN, BM] += w[BN, K] @ xt[K, BM] at precision PREC (the module docstring's): w float32
    (rounded here for "bf16") or already bfloat16; tl.dot, or under the interpreter the same
    products summed with tl.sum."""
    if PREC == "f16":  # float16 operands (RN on both paths), exact float32 products
        wh = w if w.dtype == tl.float16 else w.to(tl.float16)
        xh = xt.to(tl.float32).to(tl.float16)
        if USE_DOT:
            acc = tl.dot(wh, xh, acc)
        else:
            acc += tl.sum(wh.to(tl.float32)[:, :, None] * xh.to(tl.float32)[None, :, :], axis=1)
    elif PREC == "bf16":
        if w.dtype == tl.bfloat16:
            wb = w
        else:
            wb = _round_bf16(w, not USE_DOT)
        xb = _round_bf16(xt.to(tl.float32), not USE_DOT)
        if USE_DOT:
            acc = tl.dot(wb, xb, acc)
        else:  # bf16 x bf16 products are exact in float32: only the summation order differs
            acc += tl.sum(wb.to(tl.float32)[:, :, None] * xb.to(tl.float32)[None, :, :], axis=1)
    else:
        xf = xt.to(tl.float32)
        if USE_DOT:
            acc = tl.dot(w, xf, acc, input_precision="tf32x3")
        else:
            acc += tl.sum(w[:, :, None] * xf[None, :, :], axis=1)
    return acc


PREFETCH_LANES = tl.constexpr(128)  # cache lines a prefetch asks for per instruction across the program


@triton.jit
def l2_prefetch_lines(ptrs):
    """``prefetch.global.L2`` of the line holding each pointer (a hint: nothing comes back, no
    result can change). Inline PTX: GPU launches only (``_native``)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _l2_prefetch(ptr, nelem, ELEM: tl.constexpr):
    """Ask L2 for ``nelem`` elements of ELEM bytes from ``ptr`` on: one ``prefetch.global.L2``
    per 128-byte line (lanes past the end repeat the last line). No data comes back to
    registers, so it costs a few instructions, and every line is in flight at once."""
    lanes = tl.arange(0, PREFETCH_LANES)
    lines = tl.cdiv(nelem * ELEM, 128)
    for l0 in range(0, lines, PREFETCH_LANES):
        li = tl.minimum(l0 + lanes, lines - 1).to(tl.int64)
        l2_prefetch_lines(ptr + li * (128 // ELEM))


@triton.jit
def _prefetch_tile(t, N, qs_ptr, qs_row, d_ptr, d_row, BLOCK_N: tl.constexpr, DBYTES: tl.constexpr):
    """L2 prefetch of N tile ``t``'s quant bytes and scales (rows t BLOCK_N .. + BLOCK_N of an
    unsplit weight: contiguous), if the tile exists."""
    rows = tl.minimum(BLOCK_N, N - t * BLOCK_N)
    if rows > 0:
        r0 = (t * BLOCK_N).to(tl.int64)
        _l2_prefetch(qs_ptr + r0 * qs_row, rows * qs_row, 1)
        _l2_prefetch(d_ptr + r0 * d_row, rows * d_row, DBYTES)


@triton.jit
def _qmma_program(
    pid, pid_k, wait_ptr, wait_need,
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
    qs_row, qh_row, sc_row, d_row,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, WAIT: tl.constexpr,
    PRELOAD: tl.constexpr, stride_xs, XF, XGLU: tl.constexpr, XSPLIT: tl.constexpr,
):
    """Program (pid, pid_k)'s product over its K slice, stored as its split-K partial of y: its
    outputs x its rows. Returns (pid_m, m, mmask, n, nmask) for the kernels' epilogues. PREFETCH
    >= 0 (``MmaConfig.prefetch``; GPU, unsplit): L2 prefetch of its tile and the one PREFETCH
    ahead. WAIT > 0 (an item of kernels/persistent.py): waits on wait_ptr >= wait_need where a
    kernel of the chain waits for its predecessor (``pdl.enter_or_wait``). PRELOAD
    (``MmaConfig.preload``): each step's bytes are fetched one step ahead, the second step's
    before the wait, and decoded when the step comes: the same decode and products in the same
    order, so the same bits. XGLU > 0 (``_qmma_glu_x_kernel``): x is act(gate) * up of a fused
    [gate | up] product's partials, formed as each step gathers it (``_x_tile``)."""
    G: tl.constexpr = BLOCK_K // GW
    GS: tl.constexpr = G * S
    pid_m, n, nmask, k_begin, k_end, qs_rows, qh_rows, sc_rows, d_rows = _packed_program(
        pid, pid_k, M, N, K, k_split, qs_ptr, qh_ptr, sc_ptr, d_ptr, qs_row, qh_row, sc_row, d_row, BLOCK_M, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    g = tl.arange(0, G)
    s = tl.arange(0, S)
    s3 = s[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PREFETCH >= 0:
        t = pid // tl.cdiv(M, BLOCK_M)
        DBYTES: tl.constexpr = d_ptr.dtype.element_ty.primitive_bitwidth // 8
        _prefetch_tile(t, N, qs_ptr, qs_row, d_ptr, d_row, BLOCK_N, DBYTES)
        if PREFETCH > 0:
            _prefetch_tile(t + PREFETCH, N, qs_ptr, qs_row, d_ptr, d_row, BLOCK_N, DBYTES)
    # the first step's weights before waiting for x's producer (as in qmatmul's GEMV)
    w0, w1, w2, w3 = _step_planes(k_begin, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows, GW, QTYPE)
    if PRELOAD:  # and the second step's bytes
        r0, r1, r2, r3, r4 = _step_loads(k_begin + BLOCK_K, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows,
                                         GW, QTYPE)
    enter_or_wait(PDL, WAIT, wait_ptr, wait_need)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        gg = k0 // GW + g  # global group index
        gval = k0 + g * GW < k_end
        xo = tl.reshape(_x_offsets(gg, s, QTYPE, GW), [GS])
        xm = tl.reshape(gval[:, None] & (s[None, :] >= 0), [GS])
        acc = _plane_dot(acc, w0, x_ptr, xo, xm, m, mmask, stride_xm, stride_xs, XF, GS, BLOCK_N, PREC, USE_DOT,
                         XGLU, XSPLIT)
        if NPLANE > 1:
            acc = _plane_dot(acc, w1, x_ptr, xo + PSTEP, xm, m, mmask, stride_xm, stride_xs, XF, GS, BLOCK_N, PREC,
                             USE_DOT, XGLU, XSPLIT)
        if NPLANE > 2:
            acc = _plane_dot(acc, w2, x_ptr, xo + 2 * PSTEP, xm, m, mmask, stride_xm, stride_xs, XF, GS, BLOCK_N,
                             PREC, USE_DOT, XGLU, XSPLIT)
            acc = _plane_dot(acc, w3, x_ptr, xo + 3 * PSTEP, xm, m, mmask, stride_xm, stride_xs, XF, GS, BLOCK_N,
                             PREC, USE_DOT, XGLU, XSPLIT)
        if k0 + BLOCK_K < k_end:  # the next step's weights
            if PRELOAD:
                w0, w1, w2, w3 = _decode_loaded(r0, r1, r2, r3, r4, s3, QTYPE)
                r0, r1, r2, r3, r4 = _step_loads(k0 + 2 * BLOCK_K, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows,
                                                 d_rows, GW, QTYPE)
            else:
                w0, w1, w2, w3 = _step_planes(k0 + BLOCK_K, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows,
                                              GW, QTYPE)
    yp = y_ptr + pid_k * stride_ys + m[None, :] * stride_ym + n[:, None]
    tl.store(yp, acc, mask=nmask[:, None] & mmask[None, :])
    return pid_m, m, mmask, n, nmask


@triton.jit(do_not_specialize=["M"])
def _qmma_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o, count_ptr,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, GLU: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PRELOAD: tl.constexpr,
):
    qmma_item(tl.program_id(0), tl.program_id(1), count_ptr, 0,
              x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
              M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o,
              count_ptr, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PREC, USE_DOT, GLU,
              NSPLIT, PDL, PREFETCH, PRELOAD, 0)


@triton.jit(do_not_specialize=["M"])
def _qmma_glu_x_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, stride_xs,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr,
    XGLU: tl.constexpr, XSPLIT: tl.constexpr,
):
    """``_qmma_kernel`` whose x is act(gate) * up of the [gate | up] partials at x_ptr
    (``launch_qmma(glu_x=)``: the FFN down product forming its input from gate|up's partials,
    K = F; up at column K)."""
    _qmma_program(tl.program_id(0), tl.program_id(1), y_ptr, 0,
                  x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
                  qs_row, qh_row, sc_row, d_row, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                  PREC, USE_DOT, PDL, -1, 0, PRELOAD, stride_xs, K, XGLU, XSPLIT)


@triton.jit
def qmma_item(
    pid, pid_k, wait_ptr, wait_need,
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o, count_ptr,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, GLU: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PRELOAD: tl.constexpr, WAIT: tl.constexpr,
):
    """Program (pid, pid_k) of ``_qmma_kernel``'s grid: the kernel's body, also an item of the
    persistent step kernel (kernels/persistent.py)."""
    pid_m, m, mmask, n, nmask = _qmma_program(
        pid, pid_k, wait_ptr, wait_need,
        x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
        qs_row, qh_row, sc_row, d_row, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PREC,
        USE_DOT, PDL, PREFETCH, WAIT, PRELOAD, 0, 0, 0, 1)
    if GLU > 0:  # a fused [gate | up] weight: the pair's last program writes act(gate) * up
        pairs = (N // 2) // BLOCK_N
        pid_n = pid // tl.cdiv(M, BLOCK_M)
        glu_pair_epilogue(y_ptr, stride_ys, stride_ym, o_ptr, stride_o, count_ptr, pid_m * pairs + pid_n % pairs,
                          n, nmask, m, mmask, N // 2, NSPLIT, GLU - 1)


@triton.jit(do_not_specialize=["M"])
def _qmma_heads_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, count_ptr, col0,
    q_ptr, stride_qr, k_ptr, v_ptr, stride_ks, stride_kl, seq_ptr, pos_ptr, qn_ptr, kn_ptr, inv_ptr, eps,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, NSPLIT: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
):
    """``_qmma_kernel`` for (a member of) the q|k|v product with ``step_fused.heads_epilogue``."""
    pid_m, m, mmask, n, nmask = _qmma_program(
        tl.program_id(0), tl.program_id(1), count_ptr, 0,
        x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
        qs_row, qh_row, sc_row, d_row, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PREC,
        USE_DOT, PDL, -1, 0, False, 0, 0, 0, 1)
    heads = N // D
    head = (tl.program_id(0) // tl.cdiv(M, BLOCK_M)) * BLOCK_N // D
    heads_epilogue(y_ptr, stride_ys, stride_ym, count_ptr, pid_m * heads + head, head, m, mmask, col0,
                   q_ptr, stride_qr, k_ptr, v_ptr, stride_ks, stride_kl, seq_ptr, pos_ptr, qn_ptr, kn_ptr, inv_ptr,
                   eps, (D // BLOCK_N) * NSPLIT, NSPLIT, HQ, HKV, D, HALF, HALF_P, HAS_NORM)


NORM_ROWS = 4  # rows the add+norm epilogue handles at once ([4, E] tiles)


@triton.jit(do_not_specialize=["M"])
def _qmma_norm_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, count_ptr,
    r_ptr, stride_r, h_ptr, stride_h, wpost_ptr, wn_ptr, eps,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, NSPLIT: tl.constexpr, HAS_POST: tl.constexpr,
    BLOCK_E: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """``_qmma_kernel`` with ``step_fused.add_norm_epilogue`` (residual r, next input h)."""
    pid_m, m, mmask, n, nmask = _qmma_program(
        tl.program_id(0), tl.program_id(1), count_ptr, 0,
        x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
        qs_row, qh_row, sc_row, d_row, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PREC,
        USE_DOT, PDL, -1, 0, False, 0, 0, 0, 1)
    ntiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0) // tl.cdiv(M, BLOCK_M)
    add_norm_epilogue(y_ptr, stride_ys, stride_ym, count_ptr, pid_m * ntiles + pid_n,
                      tl.cdiv(M, BLOCK_M) * ntiles + pid_m, ntiles, pid_m * BLOCK_M, M, n, nmask,
                      r_ptr, stride_r, h_ptr, stride_h, wpost_ptr, wn_ptr, N, eps,
                      NSPLIT, HAS_POST, BLOCK_M, BLOCK_E, ROWS)


@triton.jit(do_not_specialize=["M"])
def _mma_gemv_pair_kernel(
    x_ptr, qs_a, qh_a, sc_a, d_a, y_a, M, N_a, K, k_split, stride_xm, stride_ym, stride_ys,
    qs_row_a, qh_row_a, sc_row_a, d_row_a,
    qs_b, qh_b, sc_b, d_b, y_b, N_b, qs_row_b, qh_row_b, sc_row_b, d_row_b, programs_a,
    QTYPE_A: tl.constexpr, GW_A: tl.constexpr, S_A: tl.constexpr, NPLANE_A: tl.constexpr, PSTEP_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N_A: tl.constexpr, BLOCK_K_A: tl.constexpr, NUM_STAGES_A: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr,
    QTYPE_B: tl.constexpr, GW_B: tl.constexpr, S_B: tl.constexpr, NPLANE_B: tl.constexpr, PSTEP_B: tl.constexpr,
    M_TILE: tl.constexpr, BLOCK_N_B: tl.constexpr, BLOCK_K_B: tl.constexpr, NUM_STAGES_B: tl.constexpr,
    LATE_REDUCE: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr, PRELOAD_A: tl.constexpr,
):
    """Two products of one x in one launch: programs [0, programs_a) are ``_qmma_kernel``'s for
    weight A, the rest ``_qgemv_kernel``'s for weight B, each running its kernel's body with its
    constexprs (one kernel boundary fewer where a fused q|k|v mixes formats)."""
    pid = tl.program_id(0)
    if pid < programs_a:
        qmma_item(pid, tl.program_id(1), y_a, 0, x_ptr, qs_a, qh_a, sc_a, d_a, y_a,
                  M, N_a, K, k_split, stride_xm, stride_ym, stride_ys, qs_row_a, qh_row_a, sc_row_a, d_row_a, y_a, 0,
                  y_a, QTYPE_A, GW_A, S_A, NPLANE_A, PSTEP_A, BLOCK_M, BLOCK_N_A, BLOCK_K_A, NUM_STAGES_A, PREC,
                  USE_DOT, 0, NSPLIT, PDL, -1, PRELOAD_A, 0)
    else:
        qgemv_item(pid - programs_a, tl.program_id(1), y_b, 0, x_ptr, qs_b, qh_b, sc_b, d_b, y_b,
                   M, N_b, K, k_split, stride_xm, stride_ym, stride_ys, qs_row_b, qh_row_b, sc_row_b, d_row_b, y_b, 0,
                   y_b, QTYPE_B, GW_B, S_B, NPLANE_B, PSTEP_B, M_TILE, BLOCK_N_B, BLOCK_K_B, NUM_STAGES_B, LATE_REDUCE,
                   0, NSPLIT, PDL, 0)


def launch_mma_gemv_pair(x: torch.Tensor, wa: PackedWeight, ya: torch.Tensor, wb: PackedWeight, yb: torch.Tensor,
                         splits: int, stride_ys: int, prec: str = "bf16", use_dot: bool | None = None) -> None:
    """``launch_qmma(x, wa, ya, ...)`` and ``qmatmul.launch_qgemv(x, wb, yb, ...)`` as one launch
    (``_mma_gemv_pair_kernel``) at the tensor-core config's warps: the same K split for both
    (one shape-only split: same K), ya and yb the same partial buffer's column ranges (one row
    and split stride). The GEMV runs at those warps, so its bits are those of ``launch_qgemv``
    with ``num_warps`` set so: one fixed choice per runner."""
    if prec not in QMMA_PRECISIONS:
        raise ValueError(f"prec={prec!r} is not allowed: allowed {', '.join(QMMA_PRECISIONS)}")
    if wa.K != wb.K or ya.stride(-2) != yb.stride(-2) or wa.slice_k != wb.slice_k \
            or triton.cdiv(wa.K, wa.slice_k) != splits:
        raise ValueError("a pair needs one K, one K split and one partial buffer")
    ca = mma_config(wa.fmt.name, wa.N, wa.K, x.device, wa.slice_k)
    cb = gemv_config(wb.fmt.name, wb.N, wb.K, x.device, wb.slice_k)
    M = x.shape[0]
    programs_a = triton.cdiv(M, ca.block_m) * triton.cdiv(wa.N, ca.block_n)
    programs_b = triton.cdiv(M, cb.m_tile) * triton.cdiv(wb.N, cb.block_n)
    la, lb = packed_launch_args(x, wa, ya, splits, stride_ys), packed_launch_args(x, wb, yb, splits, stride_ys)
    ga, gb = packed_geometry(wa), packed_geometry(wb)
    _mma_gemv_pair_kernel[(programs_a + programs_b, splits)](
        *la, *lb[1:6], wb.N, *lb[13:], programs_a,
        QTYPE_A=ga["QTYPE"], GW_A=ga["GW"], S_A=ga["S"], NPLANE_A=ga["NPLANE"], PSTEP_A=ga["PSTEP"],
        BLOCK_M=ca.block_m, BLOCK_N_A=ca.block_n, BLOCK_K_A=ca.block_k, NUM_STAGES_A=ca.num_stages, PREC=prec,
        USE_DOT=x.is_cuda if use_dot is None else use_dot,
        QTYPE_B=gb["QTYPE"], GW_B=gb["GW"], S_B=gb["S"], NPLANE_B=gb["NPLANE"], PSTEP_B=gb["PSTEP"],
        M_TILE=cb.m_tile, BLOCK_N_B=cb.block_n, BLOCK_K_B=cb.block_k, NUM_STAGES_B=cb.num_stages,
        LATE_REDUCE=cb.late_reduce, NSPLIT=splits, PRELOAD_A=ca.preload, num_warps=ca.num_warps,
        **launch_kw(x),
    )


def _native(x: torch.Tensor) -> bool:
    """Whether a launch on x compiles for a GPU (inline PTX; never under the interpreter). Every
    kernel module asks here, so a compile-only check patches one function."""
    return x.is_cuda


def launch_qmma(x: torch.Tensor, w: PackedWeight, y: torch.Tensor, splits: int, stride_ys: int,
                prec: str = "bf16", config: MmaConfig | None = None, use_dot: bool | None = None,
                glu: GluEpilogue | None = None, heads: HeadsEpilogue | None = None, col0: int = 0,
                norm: NormEpilogue | None = None, glu_x: str | None = None) -> None:
    """Launch ``_qmma_kernel``: y[s, m, n] (s < splits, at stride_ys; y's row stride is
    y.stride(-2)) = the K slice s of x[m] @ W[n]^T; with ``glu`` also act(gate) * up into glu.out
    (``step_fused.glu_pair_epilogue``); with ``heads`` (this weight's columns start at column
    ``col0`` of q|k|v) also q, k, v as ``step_fused.qk_rope_kv`` makes them
    (``step_fused.heads_epilogue``); with ``norm`` also the residual add + next norm
    (``step_fused.add_norm_epilogue``). ``glu_x`` (an activation of GLU_ACTS): x is not the
    product's input but a fused [gate | up] product's partials [splits', M, 2K] (float32), and
    each program forms act(gate) * up from them as it gathers x (``_x_tile``): the GLU's
    arithmetic without its launch or fold. No value checks: callers check."""
    if prec not in QMMA_PRECISIONS:
        raise ValueError(f"prec={prec!r} is not allowed: allowed {', '.join(QMMA_PRECISIONS)}")
    cfg = config or mma_config(w.fmt.name, w.N, w.K, x.device, w.slice_k)
    gw, s = _GEMV_GEOMETRY[w.fmt.name][:2]
    groups = cfg.block_k // gw
    if not steps_fit(w, splits, cfg.block_k) or cfg.block_k % gw or groups & (groups - 1) or groups * s < 16:
        raise ValueError(f"bad qmma config {cfg} for {w.fmt.name}")
    xparts = None
    if glu_x is not None:
        if glu_x not in GLU_ACTS or x.dim() != 3 or x.shape[2] != 2 * w.K or x.dtype != torch.float32 \
                or x.stride(2) != 1 or (glu, heads, norm) != (None, None, None):
            raise ValueError(f"glu_x takes float32 [gate | up] partials [splits, M, {2 * w.K}] with unit stride, "
                             f"an activation of {', '.join(GLU_ACTS)} and no epilogue")
        xparts, x = x, x[0]
    M = x.shape[0]
    if cfg.block_m not in (16, 32):
        raise ValueError(f"bad qmma config {cfg} for {w.fmt.name}: block_m must be 16 or 32")
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(w.N, cfg.block_n), splits)
    common = dict(**packed_geometry(w), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  NUM_STAGES=cfg.num_stages, PREC=prec, USE_DOT=x.is_cuda if use_dot is None else use_dot,
                  NSPLIT=splits, num_warps=cfg.num_warps, **launch_kw(x))
    if norm is not None:
        _launch_norm(packed_launch_args(x, w, y, splits, stride_ys), common, M, w.N, cfg, norm, grid)
        return
    if heads is not None:
        _launch_heads(packed_launch_args(x, w, y, splits, stride_ys), common, M, w.N, cfg, heads, col0, grid)
        return
    if xparts is not None:
        _qmma_glu_x_kernel[grid](*packed_launch_args(x, w, y, splits, stride_ys), xparts.stride(0),
                                 PRELOAD=cfg.preload, XGLU=1 + GLU_ACTS.index(glu_x), XSPLIT=xparts.shape[0], **common)
        return
    prefetch = cfg.prefetch if cfg.prefetch is not None and splits == 1 and _native(x) else -1
    _qmma_kernel[grid](
        *packed_launch_args(x, w, y, splits, stride_ys), *glu_args(glu, y, splits, cfg.block_n, M, cfg.block_m, w.N),
        GLU=glu.code if glu else 0, PREFETCH=prefetch, PRELOAD=cfg.preload, **common,
    )


def _launch_norm(args: tuple, common: dict, M: int, N: int, cfg: MmaConfig, e: NormEpilogue, grid) -> None:
    need = norm_counters(M, N, cfg.block_n, cfg.block_m)
    if need is None or e.counters.dtype != torch.int32 or e.counters.numel() < need:
        raise ValueError(f"the add+norm fold needs rows of at most {NORM_FOLD_MAX_N} and {need} int32 counters")
    if e.x.shape != (M, N) or e.h.shape != (M, N) or e.x.dtype != torch.float32 or e.x.stride(1) != 1 \
            or e.h.stride(1) != 1:
        raise ValueError(f"the add+norm fold needs x float32 [{M}, {N}] and h [{M}, {N}] with unit stride")
    _qmma_norm_kernel[grid](
        *args, e.counters, e.x, e.x.stride(0), e.h, e.h.stride(0),
        e.w_post if e.w_post is not None else e.w_next, e.w_next, float(e.eps),
        HAS_POST=e.w_post is not None, BLOCK_E=triton.next_power_of_2(N), ROWS=NORM_ROWS, **common,
    )


def _launch_heads(args: tuple, common: dict, M: int, N: int, cfg: MmaConfig, h: HeadsEpilogue, col0: int,
                  grid) -> None:
    _, Hq, D = h.q_out.shape
    Hkv = h.k_pool.shape[2]
    need = heads_counters(M, N, col0, D, cfg.block_n, cfg.block_m)
    if need is None or h.counters.dtype != torch.int32 or h.counters.numel() < need:
        raise ValueError(f"the heads fold needs whole heads of {D} per launch, head dim a multiple of "
                         f"{cfg.block_n} and {need} int32 counters")
    if h.q_out.shape[0] != M or not h.q_out.is_contiguous() or not h.k_pool.is_contiguous() or D % 2:
        raise ValueError("the heads fold needs a contiguous q_out [M, Hq, D] (D even) and contiguous pools")
    if (h.q_norm is None) != (h.k_norm is None):
        raise ValueError("need both QK-norm weights or neither")
    has_norm = h.q_norm is not None
    _qmma_heads_kernel[grid](
        *args, h.counters, col0, h.q_out, h.q_out.stride(0), h.k_pool, h.v_pool, h.k_pool.stride(0), h.k_pool.stride(1),
        h.seq, h.pos, h.q_norm if has_norm else h.inv_freq, h.k_norm if has_norm else h.inv_freq, h.inv_freq,
        float(h.eps),
        HQ=Hq, HKV=Hkv, D=D, HALF=D // 2, HALF_P=max(2, triton.next_power_of_2(D // 2)), HAS_NORM=has_norm,
        **common,
    )


def qmma(x: torch.Tensor, w: PackedWeight, prec: str = "bf16", out: torch.Tensor | None = None,
         config: MmaConfig | None = None, use_dot: bool | None = None) -> torch.Tensor:
    """float32 [M, N] = x[M, K] @ W^T on tensor cores (see the module docstring for precision).

    x: float32 or bfloat16 [M, K], unit stride along K, on the weight's device. Batch-invariant:
    row i equals ``qmma(x[i:i+1], w, prec)`` bitwise. ``use_dot`` picks the product form
    (default: tl.dot on a GPU, the tl.sum form under the CPU interpreter)."""
    if not isinstance(w, PackedWeight):
        raise TypeError("qmma takes a PackedWeight (kernels.qmatmul.pack_weights)")
    N, K = w.N, w.K
    out = check_x_out(x, N, K, w.device, out)
    M = x.shape[0]
    if M == 0:
        return out
    splits = triton.cdiv(K, w.slice_k)
    if splits == 1:
        launch_qmma(x, w, out, 1, 0, prec, config, use_dot)
        return out
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    launch_qmma(x, w, part, splits, part.stride(0), prec, config, use_dot)
    sum_splits(part, out)  # in slice order, as the runner's consumers add them
    return out
