"""y[M, N] = x[M, K] @ W^T for a GGUF-quantized W (raw bytes), batch-invariant in M.

Design (bandwidth first, exact by construction):

* A program owns a tile of ``BLOCK_N`` output features and up to ``BLOCK_M`` rows of x. It walks K
  in fixed tiles of ``GROUPS`` sub-blocks, decodes each weight tile ONCE into float32 registers,
  and dots it against every one of its rows before moving on. For M <= BLOCK_M (decode: every
  slot of a step) each weight byte is read from memory once per launch, for all rows.
* No tl.dot: each row is a fixed-shape multiply + ``tl.sum`` over the [BLOCK_N, GROUPS, SUB]
  tile, added into that row's accumulator in K-tile order. Row i's arithmetic therefore never
  sees the other rows nor M (M is ``do_not_specialize``), so the output row is bitwise identical
  for any M and any position of the row in the batch. (tl.dot needs BLOCK_M >= 16 on GPU, which
  would do 16x the work for a 1-token decode, and defaults to TF32.)
* Precision: weights decoded in float32 exactly as gguf.quants does, products and sums in
  float32 (IEEE; x bf16 is upcast exactly), output float32. vs the float64 truth the error is
  the usual fp32 dot-product bound; vs ``qmatmul_ref`` only the summation order differs.

Prefill (M > BLOCK_M) runs ceil(M / BLOCK_M) row tiles; consecutive programs share an N tile
(pid_m varies fastest) so the re-reads of a weight tile come from L2.
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
    groups: int  # sub-blocks per K tile: a K tile is groups * sub weights
    num_warps: int


# Launch configurations, per format. Fixed: never chosen from M (batch invariance).
QMATMUL_CONFIGS: dict[str, QMatmulConfig] = {
    "Q8_0": QMatmulConfig(block_m=16, block_n=64, groups=4, num_warps=4),  # K tile 128
    "Q5_0": QMatmulConfig(block_m=16, block_n=64, groups=4, num_warps=4),  # K tile 128
    "Q4_K": QMatmulConfig(block_m=16, block_n=32, groups=8, num_warps=4),  # K tile 256
    "Q6_K": QMatmulConfig(block_m=16, block_n=32, groups=16, num_warps=4),  # K tile 256
}


@triton.jit(do_not_specialize=["M"])
def _qmatmul_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, row_bytes,
    QTYPE: tl.constexpr, SUB: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    m0 = pid_m * BLOCK_M
    num_rows = tl.minimum(M - m0, BLOCK_M)

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, GROUPS)
    s = tl.arange(0, SUB)
    row_ptr = w_ptr + n[:, None, None].to(tl.int64) * row_bytes  # [BN, 1, 1]
    num_sub = K // SUB
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    for kt in range(0, tl.cdiv(num_sub, GROUPS)):
        ksub = kt * GROUPS + g  # [G]
        wmask = (n[:, None, None] < N) & (ksub[None, :, None] < num_sub)
        w = dequant_tile(row_ptr, ksub[None, :, None], s[None, None, :], wmask, QTYPE)  # [BN, G, S]
        kx = ksub[:, None] * SUB + s[None, :]  # [G, S]
        xmask = ksub[:, None] < num_sub
        for i in range(0, num_rows):
            xv = tl.load(x_ptr + (m0 + i) * stride_xm + kx, mask=xmask, other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(w * xv[None, :, :], axis=2), axis=1)  # [BN]
            acc = tl.where(rows[:, None] == i, acc + part[None, :], acc)

    y_ptrs = y_ptr + (m0 + rows)[:, None] * stride_ym + n[None, :]
    tl.store(y_ptrs, acc, mask=(rows[:, None] < num_rows) & (n[None, :] < N))


def qmatmul(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: GGMLQuantizationType | int | str,
    N: int,
    K: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [M, N] = x[M, K] @ dequant(raw)^T; ``raw`` is the uint8 [N, row_bytes] GGUF bytes.

    x: float32 or bfloat16 [M, K], unit stride along K. Batch-invariant: row i of the result is
    bitwise equal to ``qmatmul(x[i:i+1], ...)``.
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
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _qmatmul_kernel[grid](
        x, raw, out, M, N, K, x.stride(0), out.stride(0), raw.stride(0),
        QTYPE=fmt.code, SUB=fmt.sub, GROUPS=cfg.groups,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )
    return out


def qmatmul_ref(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType | int | str, N: int, K: int) -> torch.Tensor:
    """Reference: x.float() @ W^T with W decoded by gguf.quants.dequantize."""
    w = dequant_ref(raw, qtype, K)
    if w.shape != (N, K):
        raise ValueError(f"raw decodes to {tuple(w.shape)}, expected [{N}, {K}]")
    return x.float() @ w.T
