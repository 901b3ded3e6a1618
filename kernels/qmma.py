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
* an epilogue that rides on the launch: ``GluEpilogue`` (a [gate | up] weight also writes
  act(gate) * up), by the last program of each column pair over acquire-release counters.
  (The QK-norm/rope and add+norm epilogues, the down product forming its own GLU input, the
  L2 prefetch of the head's tiles and fetching a step's bytes a step ahead were each measured
  on an H200 and lost: docs/GPU_NOTES.md; removed in session 13.)
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

from .pdl import enter, launch_kw
from .qmatmul import (
    _GEMV_GEOMETRY,
    GluEpilogue,
    PackedWeight,
    clamp_block_k,
    _packed_program,
    _step_planes,
    _x_offsets,
    check_x_out,
    gemv_config,
    glu_args,
    num_k_splits,
    packed_geometry,
    packed_launch_args,
    qgemv_item,
    steps_fit,
    sum_splits,
)
from .step_fused import glu_pair_epilogue

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
# Unsplit weights (N > QMATMUL_SPLIT_MAX_N: a head-sized weight; the runner's head takes
# kernels/dense_mma.py since session 5): unpipelined was the fastest of six tilings on an H200
# (session 3), at ~1 TB/s, bound by the decode's instructions, not memory.
QMMA_WIDE_CONFIGS: dict[str, MmaConfig] = {
    "Q8_0": MmaConfig(block_n=64, block_k=128, num_warps=4, num_stages=1),
}
QMMA_PRECISIONS = ("bf16", "tf32x3")
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
def _plane_dot(acc, w, x_ptr, xoff, xmask, m, mmask, stride_xm,
               GS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr):
    """acc[BN, BM] += W_plane[BN, GS] @ x^T[GS, BM], x^T gathered at K offsets ``xoff`` [GS]."""
    w = tl.reshape(w, [BLOCK_N, GS])
    offs = m[None, :] * stride_xm + xoff[:, None]
    mask = xmask[:, None] & mmask[None, :]
    xt = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return dot_acc(acc, w, xt, PREC, USE_DOT)


@triton.jit
def dot_acc(acc, w, xt, PREC: tl.constexpr, USE_DOT: tl.constexpr):
    """acc[BN, BM] += w[BN, K] @ xt[K, BM] at precision PREC (the module docstring's): w float32
    (rounded here for "bf16") or already bfloat16; tl.dot, or under the interpreter the same
    products summed with tl.sum."""
    if PREC == "bf16":
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


@triton.jit
def _qmma_program(
    pid, pid_k,
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
    qs_row, qh_row, sc_row, d_row,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (pid, pid_k)'s product over its K slice, stored as its split-K partial of y: its
    outputs x its rows. Returns (pid_m, m, mmask, n, nmask) for the kernels' epilogue."""
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
    # the first step's weights before waiting for x's producer (as in qmatmul's GEMV)
    w0, w1, w2, w3 = _step_planes(k_begin, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows, GW, QTYPE)
    enter(PDL)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        gg = k0 // GW + g  # global group index
        gval = k0 + g * GW < k_end
        xo = tl.reshape(_x_offsets(gg, s, QTYPE, GW), [GS])
        xm = tl.reshape(gval[:, None] & (s[None, :] >= 0), [GS])
        acc = _plane_dot(acc, w0, x_ptr, xo, xm, m, mmask, stride_xm, GS, BLOCK_N, PREC, USE_DOT)
        if NPLANE > 1:
            acc = _plane_dot(acc, w1, x_ptr, xo + PSTEP, xm, m, mmask, stride_xm, GS, BLOCK_N, PREC, USE_DOT)
        if NPLANE > 2:
            acc = _plane_dot(acc, w2, x_ptr, xo + 2 * PSTEP, xm, m, mmask, stride_xm, GS, BLOCK_N, PREC, USE_DOT)
            acc = _plane_dot(acc, w3, x_ptr, xo + 3 * PSTEP, xm, m, mmask, stride_xm, GS, BLOCK_N, PREC, USE_DOT)
        if k0 + BLOCK_K < k_end:  # the next step's weights
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
):
    qmma_item(tl.program_id(0), tl.program_id(1),
              x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
              M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o,
              count_ptr, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PREC, USE_DOT, GLU,
              NSPLIT, PDL)


@triton.jit
def qmma_item(
    pid, pid_k,
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o, count_ptr,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, GLU: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (pid, pid_k) of ``_qmma_kernel``'s grid: the kernel's body (the pair kernel's
    tensor-core programs too)."""
    pid_m, m, mmask, n, nmask = _qmma_program(
        pid, pid_k,
        x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_ym, stride_ys,
        qs_row, qh_row, sc_row, d_row, QTYPE, GW, S, NPLANE, PSTEP, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, PREC,
        USE_DOT, PDL)
    if GLU > 0:  # a fused [gate | up] weight: the pair's last program writes act(gate) * up
        pairs = (N // 2) // BLOCK_N
        pid_n = pid // tl.cdiv(M, BLOCK_M)
        glu_pair_epilogue(y_ptr, stride_ys, stride_ym, o_ptr, stride_o, count_ptr, pid_m * pairs + pid_n % pairs,
                          n, nmask, m, mmask, N // 2, NSPLIT, GLU - 1)


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
    LATE_REDUCE: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Two products of one x in one launch: programs [0, programs_a) are ``_qmma_kernel``'s for
    weight A, the rest ``_qgemv_kernel``'s for weight B, each running its kernel's body with its
    constexprs (one kernel boundary fewer where a fused q|k|v mixes formats)."""
    pid = tl.program_id(0)
    if pid < programs_a:
        qmma_item(pid, tl.program_id(1), x_ptr, qs_a, qh_a, sc_a, d_a, y_a,
                  M, N_a, K, k_split, stride_xm, stride_ym, stride_ys, qs_row_a, qh_row_a, sc_row_a, d_row_a, y_a, 0,
                  y_a, QTYPE_A, GW_A, S_A, NPLANE_A, PSTEP_A, BLOCK_M, BLOCK_N_A, BLOCK_K_A, NUM_STAGES_A, PREC,
                  USE_DOT, 0, NSPLIT, PDL)
    else:
        qgemv_item(pid - programs_a, tl.program_id(1), x_ptr, qs_b, qh_b, sc_b, d_b, y_b,
                   M, N_b, K, k_split, stride_xm, stride_ym, stride_ys, qs_row_b, qh_row_b, sc_row_b, d_row_b, y_b, 0,
                   y_b, QTYPE_B, GW_B, S_B, NPLANE_B, PSTEP_B, M_TILE, BLOCK_N_B, BLOCK_K_B, NUM_STAGES_B, LATE_REDUCE,
                   0, NSPLIT, PDL)


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
        LATE_REDUCE=cb.late_reduce, NSPLIT=splits, num_warps=ca.num_warps,
        **launch_kw(x),
    )


def _native(x: torch.Tensor) -> bool:
    """Whether a launch on x compiles for a GPU (inline PTX; never under the interpreter). Every
    kernel module asks here, so a compile-only check patches one function."""
    return x.is_cuda


def launch_qmma(x: torch.Tensor, w: PackedWeight, y: torch.Tensor, splits: int, stride_ys: int,
                prec: str = "bf16", config: MmaConfig | None = None, use_dot: bool | None = None,
                glu: GluEpilogue | None = None) -> None:
    """Launch ``_qmma_kernel``: y[s, m, n] (s < splits, at stride_ys; y's row stride is
    y.stride(-2)) = the K slice s of x[m] @ W[n]^T; with ``glu`` also act(gate) * up into glu.out
    (``step_fused.glu_pair_epilogue``). No value checks: callers check."""
    if prec not in QMMA_PRECISIONS:
        raise ValueError(f"prec={prec!r} is not allowed: allowed {', '.join(QMMA_PRECISIONS)}")
    cfg = config or mma_config(w.fmt.name, w.N, w.K, x.device, w.slice_k)
    gw, s = _GEMV_GEOMETRY[w.fmt.name][:2]
    groups = cfg.block_k // gw
    if not steps_fit(w, splits, cfg.block_k) or cfg.block_k % gw or groups & (groups - 1) or groups * s < 16:
        raise ValueError(f"bad qmma config {cfg} for {w.fmt.name}")
    M = x.shape[0]
    if cfg.block_m not in (16, 32):
        raise ValueError(f"bad qmma config {cfg} for {w.fmt.name}: block_m must be 16 or 32")
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(w.N, cfg.block_n), splits)
    _qmma_kernel[grid](
        *packed_launch_args(x, w, y, splits, stride_ys), *glu_args(glu, y, splits, cfg.block_n, M, cfg.block_m, w.N),
        **packed_geometry(w), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, PREC=prec, USE_DOT=x.is_cuda if use_dot is None else use_dot,
        GLU=glu.code if glu else 0, NSPLIT=splits, num_warps=cfg.num_warps, **launch_kw(x),
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
