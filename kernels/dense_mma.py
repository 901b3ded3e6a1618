"""y[M, N] = x[M, K] @ W^T on tensor cores from a dense (already dequantized) W; batch-invariant.

The head's alternative to decoding GGUF blocks in registers (``qmma.py``). On an H200 the Q8_0
head (262,144 x 640, 178 MB) took 160-210 us of a 0.87-0.98 ms decode step in ``qmma``
(docs/GPU_NOTES.md, session 5): about 1 TB/s, bound by the decode's instructions per weight, not
by memory (an L2 prefetch of every tile changed nothing). Here the weights are the bfloat16
values that decode produces (``bf16(d * q)``, dequantized once at load: 335 MB instead of
178), so a K step is a plain load that Triton pipelines (``num_stages``) straight into the MMA.

* Operands swapped as in ``qmma``: a program owns BLOCK_N outputs x a fixed tile of BLOCK_M rows
  (32; ``DenseConfig.block_m``) and computes ``y^T[BLOCK_N, BM] = W[BLOCK_N, K] @ x^T[K, BM]``.
* Precision as ``qmma``'s: "bf16" (x rounded to bfloat16, products exact in float32, float32
  accumulation; W bfloat16) or "tf32x3" (float32 W and x, three TF32 products). x may come
  already rounded to the operand type (the same bits, half the bytes read).
* ``q8i8_mma``: a Q8_0 weight's packed planes against x quantized per row to Q8_0 blocks, one
  exact integer product per 32-weight block (the runner's int8 head, its default since session
  12). (The Q8_0 planes' products with bf16 or float16 operands formed per K step, ``q8dense`` /
  ``q8f16``, were no faster than the dense copy, sessions 7 and 9, and slower than the int8 form;
  removed in session 13.)
* Invariance: tiles, K steps and their order are fixed by the weight's shape, M is not
  specialized, a row is one column of the MMA's output. Under the CPU interpreter the same
  products are a broadcast multiply + ``tl.sum`` (``qmma._plane_dot``'s reason).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .pdl import enter, launch_kw
from . import qmma as _qmma
from .qmma import QMMA_PRECISIONS, dot_acc
from .sampling import best_of, running_best


@dataclass(frozen=True)
class DenseConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # rows per program (16 or 32), fixed per weight: 32 reads the head once for 17..32 rows
    # instead of twice, at the price of a 32-wide MMA for 1..16. H200 (session 6, run 25):
    # 32 slots 0.993 -> 0.974 ms, 1..16 slots +14 us (0.691 -> 0.705 at 1). Chosen for the
    # 32-slot batch-invariance cost (10.2% -> 8.1% against cuBLAS bf16; docs/GPU_NOTES.md).
    block_m: int = 32
    # > 0: the streaming form (``_dense_stream_kernel``): this many programs per multiprocessor,
    # each walking tiles p, p + P, ... in one flattened, pipelined loop, so the next tile's
    # weights arrive during this tile's last steps and store (a tile's arithmetic is the same
    # whichever program runs it). 0: one program per tile. H200 (session 7, run 34): 2 took the
    # step from 0.701 / 0.798 / 0.963 to 0.686 / 0.787 / 0.951 ms at 1 / 16 / 32 slots, exact.
    programs_per_sm: int = 2


DENSE_CONFIG = DenseConfig()
OPERAND_DTYPES = {"bf16": torch.bfloat16, "tf32x3": torch.float32}  # the weight's dtype, by precision
STREAM_INTERPRETER_PROGRAMS = 3  # the streaming form's grid under the CPU interpreter
# q8i8's K step: a step's four Q8_0 blocks in ONE batched integer dot (``_k_step_i8``, mma.sync),
# then the same per-block scaling and additions in block order. H200, session 11 (the head
# alone, 16 rows): 66 us against 80 for four dots each scaled before the next is issued (a
# wgmma waited for per block; that form removed in session 13, ``q8i8_mma_ref`` keeps its
# arithmetic as the reference). 128-weight K steps only.
# q8i8's tiles by row count, ((rows up to, block_m, programs per SM), ...; None: any). Its
# arithmetic per output is an exact integer dot followed by elementwise float32 operations, so,
# unlike the float forms (whose MMA sums follow the tile), the row tile may follow M without
# changing a bit (tests: rows of a 32-row launch bitwise the solo row's). The per-block scaling
# costs ALU in proportion to the tile's rows: H200, session 11 (the head alone, batched step):
# 16 rows in 16-row tiles at 4 programs per SM 66 us, in 32-row tiles 93; 32 rows in 32-row
# tiles at 3 programs 96, in two 16-row tiles 117.
I8_TILES: tuple = ((16, 16, 4), (None, 32, 3))
# 32-bit registers per multiprocessor (sm_80 / sm_90): ``_register_cap``'s budget. Without the
# cap, best= took the batched int8 step's 16-row tile from 128 registers to 194, so 2 programs per
# SM instead of 4 (the head alone 102 us instead of 66, H200 session 11); capped at 128: 12 bytes
# spilled.
STREAM_REGISTER_FILE = 65536
DENSE_INTERPRETER_MIN_BLOCK_N = 128  # fewer, wider programs under the CPU interpreter


@triton.jit
def _tile(t, M, N, w_ptr, d_ptr, stride_wn, stride_dn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile t's outputs n (and mask), rows m (and mask), and its weight (and scale) row pointers."""
    num_m = tl.cdiv(M, BLOCK_M)
    n = (t // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (t % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    d_rows = d_ptr + n.to(tl.int64)[:, None] * stride_dn
    return n, n < N, m, m < M, w_rows, d_rows


@triton.jit
def _i32_as_f32(p):
    """int32 p with |p| < 2^22 as float32, exactly, without a conversion instruction: its bits
    added to those of 1.5 * 2^23 (whose ulp is 1), then 1.5 * 2^23 subtracted."""
    return (p + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _k_step_i8(acc, k0, K, xq_ptr, stride_xm, xd_ptr, stride_xdm, m, mmask, w_rows, d_rows, nmask,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """PREC "i8": acc += the K step at k0, its four Q8_0 blocks (32 weights each) in ONE batched
    integer dot ([4, BN, 32] x [4, 32, BM] -> [4, BN, BM]) of the int8 quants of W and of x
    (``quantize_rows_q8``; exact: |sum| <= 32 * 127 * 128 < 2^22), so the MMAs of a step can be
    in flight together; each block's int32 made float32 without a conversion instruction
    (``_i32_as_f32``), times d_w * d_x (float32), added in block order (the blocks taken apart by
    two splits): ``q8i8_mma_ref``'s arithmetic. BLOCK_K 128 only."""
    tl.static_assert(BLOCK_K == 128, "the batched int8 step takes 128-weight K steps")
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0).to(tl.int8, bitcast=True)
    xt = tl.load(xq_ptr + m[None, :] * stride_xm + k[:, None], mask=kmask[:, None] & mmask[None, :], other=0)
    BM: tl.constexpr = xt.shape[1]
    w3 = tl.permute(tl.reshape(w, [BLOCK_N, 4, 32]), [1, 0, 2])  # [4, BN, 32]
    x3 = tl.reshape(xt, [4, 32, BM])  # [4, 32, BM]
    if USE_DOT:
        p = tl.dot(w3, x3, out_dtype=tl.int32)
    else:  # (the interpreter) the same integer sums
        p = tl.sum(w3.to(tl.int32)[:, :, :, None] * x3.to(tl.int32)[:, None, :, :], axis=2)
    pf = _i32_as_f32(p)
    j = k0 // 32 + tl.arange(0, 4)
    jmask = j * 32 < K
    dw = tl.load(d_rows + j[None, :], mask=nmask[:, None] & jmask[None, :], other=0.0).to(tl.float32)  # [BN, 4]
    dx = tl.load(xd_ptr + m[None, :] * stride_xdm + j[:, None], mask=jmask[:, None] & mmask[None, :], other=0.0)
    t = pf * (tl.permute(dw, [1, 0])[:, :, None] * dx[:, None, :])  # [4, BN, BM]: block j's term
    even, odd = tl.split(tl.reshape(tl.permute(t, [1, 2, 0]), [BLOCK_N, BM, 2, 2]))  # j = 2 * i + (0 | 1)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return (((acc + t0) + t1) + t2) + t3


@triton.jit
def _k_step(acc, k0, K, x_ptr, stride_xm, xd_ptr, stride_xdm, m, mmask, w_rows, d_rows, nmask,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr):
    """acc += the K step at k0 of the tile's product (the weight tile, x^T, one dot_acc; PREC
    "i8": ``_k_step_i8``)."""
    if PREC == "i8":
        acc = _k_step_i8(acc, k0, K, x_ptr, stride_xm, xd_ptr, stride_xdm, m, mmask, w_rows, d_rows, nmask,
                         BLOCK_N, BLOCK_K, USE_DOT)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
        xt = tl.load(x_ptr + m[None, :] * stride_xm + k[:, None], mask=(k < K)[:, None] & mmask[None, :], other=0.0)
        acc = dot_acc(acc, w, xt, PREC, USE_DOT)
    return acc


@triton.jit(do_not_specialize=["M"])
def _dense_mma_kernel(
    x_ptr, w_ptr, d_ptr, y_ptr, xd_ptr, M, N, K, stride_xm, stride_wn, stride_dn, stride_ym, stride_xdm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    n, nmask, m, mmask, w_rows, d_rows = _tile(tl.program_id(0), M, N, w_ptr, d_ptr, stride_wn, stride_dn,
                                               BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    enter(PDL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = _k_step(acc, k0, K, x_ptr, stride_xm, xd_ptr, stride_xdm, m, mmask, w_rows, d_rows, nmask,
                      BLOCK_N, BLOCK_K, PREC, USE_DOT)
    tl.store(y_ptr + m[None, :] * stride_ym + n[:, None], acc, mask=nmask[:, None] & mmask[None, :])


@triton.jit(do_not_specialize=["M"])
def _dense_stream_kernel(
    x_ptr, w_ptr, d_ptr, y_ptr, xd_ptr, bv_ptr, bi_ptr, M, N, K, stride_xm, stride_wn, stride_dn, stride_ym, stride_xdm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREC: tl.constexpr, USE_DOT: tl.constexpr, BEST: tl.constexpr, PDL: tl.constexpr,
):
    """``_dense_mma_kernel``'s tiles (same products, same K order), program p taking tiles p,
    p + P, ... in one flattened loop that Triton pipelines across tile boundaries. BEST (one row
    tile: M <= BLOCK_M, so a program's tiles run in increasing n): each program also keeps every
    lane's running (value, index) best and stores, per row, its best over its tiles at
    bv/bi[row, p] (``sampling.argmax_from_partials`` finishes the argmax)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if BEST and PREC == "i8":
        # the running best born in the tile store's layout: loads through the store's pointer
        # pattern under a mask that is never true (M < 0; a constant mask would fold away) read
        # nothing and give the initial values. From tl.full, the batched int8 step's accumulation
        # was carried in both layouts, each K step's product converted twice (GPU_NOTES session
        # 11). H200, session 12, run 65: the head alone 66 us at 16 rows with its argmax, as
        # without it (95 from tl.full); the step 0.628 -> 0.601 ms at 16 slots. The same values.
        c0 = tl.arange(0, BLOCK_M)[None, :] * stride_ym + tl.arange(0, BLOCK_N)[:, None]
        never = (c0 < 0) & ((c0 * 0 + M) < 0)
        bv = tl.load(y_ptr + c0, mask=never, other=float("-inf"))
        bi = tl.load(bi_ptr + c0, mask=never, other=2147483647)
    else:
        bv = tl.full([BLOCK_N, BLOCK_M], float("-inf"), tl.float32)
        bi = tl.full([BLOCK_N, BLOCK_M], 2147483647, tl.int32)
    enter(PDL)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True, num_stages=NUM_STAGES):
        n, nmask, m, mmask, w_rows, d_rows = _tile(t, M, N, w_ptr, d_ptr, stride_wn, stride_dn, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _k_step(acc, k0, K, x_ptr, stride_xm, xd_ptr, stride_xdm, m, mmask, w_rows, d_rows, nmask,
                          BLOCK_N, BLOCK_K, PREC, USE_DOT)
        tl.store(y_ptr + m[None, :] * stride_ym + n[:, None], acc, mask=nmask[:, None] & mmask[None, :])
        if BEST:
            bv, bi = running_best(bv, bi, acc, (n[:, None] + 0 * m[None, :]).to(tl.int32),
                                  nmask[:, None] & mmask[None, :])
    if BEST:
        rows = tl.arange(0, BLOCK_M)
        v, i = best_of(bv, bi, bi != 2147483647)
        P = tl.num_programs(0)
        tl.store(bv_ptr + rows * P + tl.program_id(0), v, mask=rows < M)
        tl.store(bi_ptr + rows * P + tl.program_id(0), i, mask=rows < M)


def dense_config(device: torch.device | str = "cuda") -> DenseConfig:
    cfg = DENSE_CONFIG
    if torch.device(device).type == "cpu":
        cfg = replace(cfg, block_n=max(cfg.block_n, DENSE_INTERPRETER_MIN_BLOCK_N))
    return cfg


def dense_mma(x: torch.Tensor, w: torch.Tensor, prec: str = "bf16", out: torch.Tensor | None = None,
              config: DenseConfig | None = None, use_dot: bool | None = None, best=None) -> torch.Tensor:
    """float32 [M, N] = x[M, K] @ w^T. w: bfloat16 [N, K] for prec "bf16", float32 for "tf32x3",
    unit stride along K; x float32 or bfloat16 [M, K]. Row i equals the product of x[i:i+1]
    alone, bitwise. ``use_dot``: tl.dot (default on a GPU) or the tl.sum form. ``best``
    (``best_partials``' buffers): also each program's running argmax per row."""
    if prec not in QMMA_PRECISIONS:
        raise ValueError(f"prec={prec!r} is not allowed: allowed {', '.join(QMMA_PRECISIONS)}")
    want = OPERAND_DTYPES[prec]
    if w.dim() != 2 or w.dtype != want or w.stride(1) != 1:
        raise ValueError(f"w must be {want} [N, K] with unit stride along K for prec={prec!r}, "
                         f"got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    out = _x_out(x, N, K, out)
    if x.shape[0] == 0:
        return out
    cfg = config or head_config("dense", x.device, x.shape[0])
    _launch(x, w, None, out, cfg, prec, use_dot, best)
    return out


def _x_out(x: torch.Tensor, N: int, K: int, out: torch.Tensor | None) -> torch.Tensor:
    """x checked (float32/bfloat16 [M, K], unit stride); out checked, or a new float32 [M, N]."""
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32/bfloat16 [M, {K}] with unit stride, got {x.dtype} {tuple(x.shape)}")
    return _out(out, x.shape[0], N, x.device)


def _out(out: torch.Tensor | None, M: int, N: int, device) -> torch.Tensor:
    """out checked (float32 [M, N], unit stride), or a new one."""
    if out is None:
        return torch.empty((M, N), dtype=torch.float32, device=device)
    if out.shape != (M, N) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{M}, {N}] with unit stride")
    return out


def _programs(device: torch.device, M: int, N: int, cfg: DenseConfig) -> int:
    """The launch's grid: one program per tile, or the streaming form's programs."""
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    if cfg.programs_per_sm > 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
            else STREAM_INTERPRETER_PROGRAMS
        tiles = min(tiles, sms * cfg.programs_per_sm)
    return tiles


def best_partials(M: int, N: int, device: torch.device | str,
                  config: DenseConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Buffers for ``best=`` (float32 values, int32 indices [M, programs]) where an M-row launch
    can keep the running argmax (the streaming form, one row tile: M <= block_m), else None."""
    device = torch.device(device)
    if config.programs_per_sm <= 0 or not 0 < M <= config.block_m:
        return None
    P = _programs(device, M, N, config)
    return (torch.empty((M, P), dtype=torch.float32, device=device),
            torch.empty((M, P), dtype=torch.int32, device=device))


def _register_cap(x: torch.Tensor, cfg: DenseConfig) -> dict:
    """The streaming form on a GPU: Triton's ``maxnreg`` (registers per thread, a multiple of 8)
    so that programs_per_sm programs fit one multiprocessor's register file together (the grid
    assumes they all run at once; beyond the cap the compiler spills). None needed up to 255."""
    if cfg.programs_per_sm <= 0 or not _qmma._native(x):
        return {}
    cap = STREAM_REGISTER_FILE // (cfg.programs_per_sm * cfg.num_warps * 32) // 8 * 8
    return {"maxnreg": cap} if cap < 255 else {}


def _launch(x, w, d, out, cfg: DenseConfig, prec: str, use_dot: bool | None, best=None, xd=None) -> None:
    M, N, K = x.shape[0], out.shape[1], x.shape[1]
    if cfg.block_m not in (16, 32) or (d is not None and cfg.block_k != 128):
        raise ValueError(f"bad dense config {cfg}: block_m must be 16 or 32 (and the int8 form takes 128-weight "
                         f"K steps)")
    P = _programs(x.device, M, N, cfg)
    if best is not None and (cfg.programs_per_sm <= 0 or M > cfg.block_m or best[0].shape != (M, P)):
        raise ValueError(f"best= needs the streaming form, at most {cfg.block_m} rows and [M, {P}] buffers "
                         f"(dense_mma.best_partials)")
    common = (x, w, w if d is None else d, out, x if xd is None else xd)
    strides = (M, N, K, x.stride(0), w.stride(0), 0 if d is None else d.stride(0), out.stride(0),
               0 if xd is None else xd.stride(0))
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, PREC=prec,
                  USE_DOT=x.is_cuda if use_dot is None else use_dot, num_warps=cfg.num_warps,
                  **launch_kw(x), **_register_cap(x, cfg))
    if cfg.programs_per_sm > 0:
        bv, bi = best if best is not None else (out, out)
        _dense_stream_kernel[(P,)](*common, bv, bi, *strides, BEST=best is not None, **consts)
    else:
        _dense_mma_kernel[(P,)](*common, *strides, **consts)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, d_ptr, K, stride_x, stride_q, stride_d, NB: tl.constexpr, PDL: tl.constexpr):
    """Row r of ``quantize_rows_q8``: per block of 32, d = amax / 127 and q = rint(x * (127 /
    amax)) (both divisions correctly rounded; rint by the 1.5 * 2^23 trick: ties to even; on a
    GPU the product may fuse into that addition, one form for every row either way)."""
    r = tl.program_id(0)
    b = tl.arange(0, NB)
    k = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = k < K
    enter(PDL)
    x = tl.load(x_ptr + r * stride_x + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    safe = tl.where(amax > 0, amax, 1.0)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full([NB], 127.0, tl.float32), safe), 0.0)
    v = (x * inv[:, None] + 12582912.0) - 12582912.0
    tl.store(q_ptr + r * stride_q + k, v.to(tl.int8), mask=mask)
    tl.store(d_ptr + r * stride_d + b, tl.math.div_rn(amax, tl.full([NB], 127.0, tl.float32)), mask=b * 32 < K)


def quantize_rows_q8(x: torch.Tensor, q: torch.Tensor | None = None,
                     d: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32/bfloat16/float16 [M, K], K a multiple of 32) as Q8_0 blocks per row: int8 quants
    [M, K] and float32 scales [M, K / 32] (d = amax / 127; the q8i8 head's input, as llama.cpp
    quantizes activations for its quantized products). Row by row, so batch-invariant."""
    if x.dim() != 2 or x.shape[1] % 32 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16,
                                                                                torch.float16):
        raise ValueError(f"x must be float32/bfloat16/float16 [M, K] with K a multiple of 32 and unit stride, "
                         f"got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device) if q is None else q
    d = torch.empty((M, K // 32), dtype=torch.float32, device=x.device) if d is None else d
    if q.shape != (M, K) or q.dtype != torch.int8 or d.shape != (M, K // 32) or d.dtype != torch.float32:
        raise ValueError(f"q must be int8 [{M}, {K}] and d float32 [{M}, {K // 32}]")
    if M:
        _quantize_rows_kernel[(M,)](x, q, d, K, x.stride(0), q.stride(0), d.stride(0),
                                    NB=triton.next_power_of_2(K // 32), num_warps=4, **launch_kw(x))
    return q, d


def quantize_rows_q8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_q8`` in torch (the same float32 operations, so the same bits)."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 32, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    v = (xb * inv[..., None] + 12582912.0) - 12582912.0
    return v.to(torch.int8).reshape(M, K), amax / 127.0


def q8i8_mma(xq: torch.Tensor, xd: torch.Tensor, w, out: torch.Tensor | None = None,
             config: DenseConfig | None = None, use_dot: bool | None = None, best=None) -> torch.Tensor:
    """float32 [M, N] = x @ W^T for a Q8_0 weight (its packed planes) and x given as its Q8_0 blocks
    (``quantize_rows_q8``): per block of 32, an exact integer MMA of the two int8 quants, scaled by
    d_w * d_x in float32, a K step's four blocks in one batched dot (``_k_step_i8``; 128-weight K
    steps); default tiles by M (``i8_config``). No decode of W at all: the quants go to the tensor
    cores as stored (1.06 bytes per weight). ``dense_mma``'s tiles, streaming and ``best=``;
    batch-invariant as it; the same bits with tl.dot or with the interpreter's sums (integer
    products are exact)."""
    if getattr(w, "fmt", None) is None or w.fmt.name != "Q8_0":
        raise ValueError("q8i8_mma takes a Q8_0 PackedWeight (kernels.qmatmul.pack_weights)")
    N, K = w.N, w.K
    if xq.dim() != 2 or xq.dtype != torch.int8 or xq.shape[1] != K or xq.stride(1) != 1 \
            or xd.shape != (xq.shape[0], K // 32) or xd.dtype != torch.float32 or xd.stride(1) != 1:
        raise ValueError(f"xq must be int8 [M, {K}] and xd float32 [M, {K // 32}] (quantize_rows_q8), "
                         f"got {xq.dtype} {tuple(xq.shape)} and {xd.dtype} {tuple(xd.shape)}")
    out = _out(out, xq.shape[0], N, xq.device)
    if xq.shape[0] == 0:
        return out
    _launch(xq, w.qs, w.d, out, config or head_config("q8i8", xq.device, xq.shape[0]), "i8", use_dot, best, xd=xd)
    return out


def q8i8_mma_ref(xq: torch.Tensor, xd: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``q8i8_mma`` in torch from int8 quants qs [N, K] and scales d [N, K / 32]: the same float32
    operations in the same block order, so the same bits as the kernel under the interpreter."""
    M, K = xq.shape
    qs = qs.view(torch.int8) if qs.dtype == torch.uint8 else qs  # (the planes store the quants' bytes)
    acc = torch.zeros((M, qs.shape[0]), dtype=torch.float32, device=xq.device)
    for kb in range(K // 32):
        sl = slice(kb * 32, kb * 32 + 32)
        # (float64: integer sums below 2^22 are exact there, and CUDA has no int64 matmul)
        p = (xq[:, sl].double() @ qs[:, sl].double().T).float()
        acc += p * (d[:, kb].float()[None, :] * xd[:, kb][:, None])
    return acc


def i8_config(device: torch.device | str, M: int) -> DenseConfig:
    """``q8i8_mma``'s configuration for M rows: ``dense_config`` with I8_TILES' row tile and
    programs per multiprocessor (the streaming form) for M."""
    cfg = dense_config(device)
    _, block_m, per_sm = next(t for t in I8_TILES if t[0] is None or M <= t[0])
    return replace(cfg, block_m=block_m, programs_per_sm=per_sm if cfg.programs_per_sm else 0)


def head_config(kernel: str, device: torch.device | str, M: int) -> DenseConfig:
    """The configuration each head kernel takes by default for M rows: "dense" (``dense_mma``),
    "q8i8" (``q8i8_mma``); one mapping, also for a caller sizing ``best_partials`` for the
    launch."""
    if kernel == "dense":
        return dense_config(device)
    if kernel == "q8i8":
        return i8_config(device, M)
    raise ValueError(f"kernel={kernel!r} is not allowed: allowed dense, q8i8")


def dense_mma_ref(x: torch.Tensor, w: torch.Tensor, prec: str = "bf16") -> torch.Tensor:
    """float64 reference of the same product (x rounded to bfloat16 for "bf16")."""
    xr = x.to(OPERAND_DTYPES[prec])
    return xr.double() @ w.double().T
