"""RMSNorm, y = (x * rsqrt(mean(x^2) + eps)) * w, over the last dim; also per head (QK-norm).

One program per (row, head). The sum of squares is accumulated into a fixed [BLOCK_D] float32
vector tile by tile, then reduced once by tl.sum: a fixed order per row that does not depend on
the number of rows, so the op is batch-invariant (bitwise). Gemma's "1 + w" is already folded
into the GGUF norm weights, so ``w`` is used as stored. Compute in float32; output in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enter, launch_kw

NORM_MAX_BLOCK_D = 4096  # longer rows are walked in tiles of this many elements


def _norm_config(d: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) for rows of d elements: a function of d only."""
    block_d = min(triton.next_power_of_2(d), NORM_MAX_BLOCK_D)
    return block_d, (4 if block_d <= 1024 else 8)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, o_ptr, D, eps,
    stride_xr, stride_xh, stride_or, stride_oh,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    x_row = x_ptr + r * stride_xr + h * stride_xh
    o_row = o_ptr + r * stride_or + h * stride_oh
    cols = tl.arange(0, BLOCK_D)
    sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t in range(0, tl.cdiv(D, BLOCK_D)):
        offs = t * BLOCK_D + cols
        x = tl.load(x_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        sq += x * x
    rstd = 1.0 / tl.sqrt_rn(tl.sum(sq, axis=0) / D + eps)
    for t in range(0, tl.cdiv(D, BLOCK_D)):
        offs = t * BLOCK_D + cols
        mask = offs < D
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + offs, ((x * rstd) * w).to(o_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1:
        raise ValueError(f"x must be float32/bfloat16 with unit stride on the last dim, got {x.dtype}")
    D = x.shape[-1]
    if w.shape != (D,) or w.dtype not in (torch.float32, torch.bfloat16) or w.device != x.device:
        raise ValueError(f"w must be float32/bfloat16 [{D}] on {x.device}, got {w.dtype} {tuple(w.shape)}")
    if not w.is_contiguous():
        raise ValueError("w must be contiguous")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1 or out.device != x.device:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with unit stride on {x.device}")
    x3 = x if x.dim() == 3 else x[:, None, :]
    o3 = out if out.dim() == 3 else out[:, None, :]
    R, H = x3.shape[0], x3.shape[1]
    if R == 0 or H == 0:
        return out
    block_d, num_warps = _norm_config(D)
    _rmsnorm_kernel[(R, H)](
        x3, w, o3, D, float(eps),
        x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
        BLOCK_D=block_d, num_warps=num_warps, **launch_kw(x),
    )
    return out


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [R, D] with weight w [D]."""
    if x.dim() != 2:
        raise ValueError(f"x must be [R, D], got {tuple(x.shape)}")
    return _launch(x, w, eps, out)


def rmsnorm_heads(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMSNorm (QK-norm) of x [R, H, D] over D, weight w [D] shared by the heads."""
    if x.dim() != 3:
        raise ValueError(f"x must be [R, H, D], got {tuple(x.shape)}")
    return _launch(x, w, eps, out)


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference in torch, float32, for any [..., D]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
