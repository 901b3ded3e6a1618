"""y[M, N] = x[M, K] @ W^T for a GGUF-quantized W (raw bytes), batch-invariant in M.

Design (bandwidth first, exact by construction):

* A program owns a tile of BLOCK_N output features and BLOCK_M (16) rows of x. It walks its K
  range in fixed steps of BLOCK_K, decodes each weight tile ONCE into float32 registers (as
  [BLOCK_N, G, S] sub-blocks, so byte loads are coalesced) and multiplies it with all its rows.
  For M <= 16 (a decode step: every slot) each weight byte is read once per launch, for all rows.
* Narrow weights (N <= QMATMUL_SPLIT_MAX_N) would give too few programs, so K is cut into fixed
  slices of QMATMUL_SPLIT_K; each slice's partial product goes to a workspace and
  ``_sum_splits_kernel`` adds the slices in order. The split depends on (N, K) only, never on M.
* Nothing depends on M: tile shapes, K slices and K order are fixed (M is ``do_not_specialize``),
  padded rows are zeros, so row i of an M-row call is bitwise the 1-row call, at any position in
  the batch.
* On a GPU the tile product is ``tl.dot`` with input_precision QMATMUL_INPUT_PRECISION ("tf32x3":
  about fp32 accurate on tensor cores; "ieee": true fp32 FMAs, 3-10x slower on an H200; never
  the default "tf32"). Under the CPU interpreter tl.dot is numpy/OpenBLAS sgemm, whose row
  results depend on the row's position in the tile (measured here: 84 of 120 shifted rows
  differ), so there the same sums are a broadcast multiply + ``tl.sum``. Each form is
  batch-invariant; they are not bitwise equal to each other.
* Precision: weights decoded in float32 exactly as gguf.quants does; x bf16 is upcast exactly;
  output float32. vs ``qmatmul_ref`` only the summation order (and tf32x3's splitting) differs.

Prefill (M > 16) runs ceil(M / 16) row tiles; consecutive programs share an N tile (pid_m
varies fastest) so the re-reads of a weight tile come from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from .quant_tiles import check_quant_rows, dequant_ref, dequant_tile, quant_format


@dataclass(frozen=True)
class QMatmulConfig:
    block_m: int  # rows of x per program (weights are re-read once per row tile)
    block_n: int  # output features per program
    block_k: int  # weights along K per step (a multiple of the format's sub-block)
    num_warps: int


# Launch configurations, per format. Fixed: never chosen from M (batch invariance).
QMATMUL_CONFIGS: dict[str, QMatmulConfig] = {
    "Q8_0": QMatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4),  # 64: the head ran faster than with 32
    "Q5_0": QMatmulConfig(block_m=16, block_n=32, block_k=128, num_warps=4),
    "Q4_K": QMatmulConfig(block_m=16, block_n=32, block_k=128, num_warps=4),
    "Q6_K": QMatmulConfig(block_m=16, block_n=32, block_k=128, num_warps=4),
}
# Fixed split-K for narrow weights (few N tiles, so few programs): K is cut into slices of
# QMATMUL_SPLIT_K weights at fixed offsets, each slice's partial product is written out, and a
# second kernel adds the slices in order. The split is a function of the weight's (N, K) only.
QMATMUL_SPLIT_K = 256  # a multiple of every block_k
QMATMUL_SPLIT_MAX_N = 16384  # wider weights (the 262144-row head) are not split
# tl.dot precision on a GPU. "tf32x3": three TF32 tensor-core products, about fp32 accurate
# (measured on an H200: max error / max |y| 3e-7..5e-7, vs 6e-7..2e-6 for "ieee") and 3x to 10x
# faster than "ieee" (true fp32 FMAs, the reference-exact variant). Never "tf32" (the default).
QMATMUL_INPUT_PRECISION = "tf32x3"


def num_k_splits(N: int, K: int) -> int:
    """How many K slices a weight of N x K is computed in (1: no split). Shape-only."""
    return triton.cdiv(K, QMATMUL_SPLIT_K) if N <= QMATMUL_SPLIT_MAX_N else 1


@triton.jit(do_not_specialize=["M"])
def _qmatmul_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, row_bytes,
    QTYPE: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles  # fastest: the row tiles of one N tile run back to back
    pid_n = pid // num_m_tiles
    k_begin = tl.program_id(1) * k_split  # this program's K slice [k_begin, k_end)
    k_end = tl.minimum(K, k_begin + k_split)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_K // SUB)
    s = tl.arange(0, SUB)
    row_ptr = w_ptr + n[:, None, None].to(tl.int64) * row_bytes  # [BN, 1, 1]: row starts of W
    num_sub = k_end // SUB
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # the weight tile as [BN, G, S] sub-blocks (S: contiguous bytes, coalesced loads), decoded
        # once, then viewed as W^T [BK, BN] for every row of the tile
        ksub = k0 // SUB + g
        wmask = (n < N)[:, None, None] & (ksub < num_sub)[None, :, None]
        w = dequant_tile(row_ptr, ksub[None, :, None], s[None, None, :], wmask, QTYPE)
        w = tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_K]))
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < k_end)[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision=INPUT_PRECISION)
        else:  # the same sums without tl.dot: the interpreter's tl.dot (numpy) is not row-invariant
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    y_ptr += tl.program_id(1) * stride_ys
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc, mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, M, N, num_splits, stride_ym, BLOCK: tl.constexpr):
    """y[m, n] = ((part[0] + part[1]) + ...) in slice order; part is [num_splits, M, N]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for sp in range(1, num_splits):
        acc += tl.load(part_ptr + sp * M * N + offs, mask=mask, other=0.0)
    tl.store(y_ptr + (offs // N) * stride_ym + offs % N, acc, mask=mask)


def qmatmul(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: GGMLQuantizationType | int | str,
    N: int,
    K: int,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
) -> torch.Tensor:
    """float32 [M, N] = x[M, K] @ dequant(raw)^T; ``raw`` is the uint8 [N, row_bytes] GGUF bytes.

    x: float32 or bfloat16 [M, K], unit stride along K. Batch-invariant: row i of the result is
    bitwise equal to ``qmatmul(x[i:i+1], ...)``. ``use_dot`` picks the tile product (default:
    tl.dot on a GPU, the tl.sum form on the CPU interpreter; see the module docstring).
    """
    fmt = quant_format(qtype)
    cfg = QMATMUL_CONFIGS[fmt.name]
    check_quant_rows(raw, fmt, N, K)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along K")
    if x.device != raw.device:
        raise ValueError(f"x on {x.device} but raw on {raw.device}")
    M = x.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32, device=x.device)
    elif out.shape != (M, N) or out.dtype != torch.float32 or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out must be float32 [{M}, {N}] with unit stride on {x.device}")
    if M == 0:
        return out
    splits = num_k_splits(N, K)
    part = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), splits)
    _qmatmul_kernel[grid](
        x, raw, part, M, N, K, QMATMUL_SPLIT_K if splits > 1 else K,
        x.stride(0), part.stride(-2), part.stride(0) if splits > 1 else 0, raw.stride(0),
        QTYPE=fmt.code, SUB=fmt.sub, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        INPUT_PRECISION=QMATMUL_INPUT_PRECISION, USE_DOT=x.is_cuda if use_dot is None else use_dot,
        num_warps=cfg.num_warps,
    )
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](part, out, M, N, splits, out.stride(0), BLOCK=1024, num_warps=4)
    return out


def qmatmul_ref(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType | int | str, N: int, K: int) -> torch.Tensor:
    """Reference: x.float() @ W^T with W decoded by gguf.quants.dequantize."""
    w = dequant_ref(raw, qtype, K)
    if w.shape != (N, K):
        raise ValueError(f"raw decodes to {tuple(w.shape)}, expected [{N}, {K}]")
    return x.float() @ w.T
