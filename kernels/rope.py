"""NEOX-style rotary embedding (Gemma: rotate the pairs (i, i + D/2)) with a position per row.

out[..., i]       = x[..., i] * cos(a_i) - x[..., i + D/2] * sin(a_i)
out[..., i + D/2] = x[..., i + D/2] * cos(a_i) + x[..., i] * sin(a_i),   a_i = pos * inv_freq[i]

``inv_freq[i] = theta ** (-2i / D)`` is computed in float64 and rounded once to float32
(``rope_inv_freq``); the angle is float32(pos) * inv_freq[i] rounded once (as in HF
transformers), cos/sin in float32 (Triton's tl.cos/tl.sin). Elementwise, so batch-invariant:
each output element depends only on its own x, position and i. Output in x's dtype;
``out=x`` (in place) is allowed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROPE_NUM_WARPS = 4


@triton.jit
def _rope_kernel(
    x_ptr, o_ptr, pos_ptr, inv_freq_ptr, H, HALF,
    stride_xr, stride_xh, stride_or, stride_oh,
    H_P: tl.constexpr, HALF_P: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.arange(0, H_P)
    i = tl.arange(0, HALF_P)
    mask = (h < H)[:, None] & (i < HALF)[None, :]
    pos = tl.load(pos_ptr + r).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)  # [HALF_P]
    c = tl.cos(angle)[None, :]
    s = tl.sin(angle)[None, :]
    x1_ptr = x_ptr + r * stride_xr + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o1_ptr = o_ptr + r * stride_or + h[:, None] * stride_oh + i[None, :]
    tl.store(o1_ptr, (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptr + HALF, (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=mask)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [head_dim / 2]: theta ** (-2i / head_dim), computed in float64, rounded once."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    i = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
    return (float(theta) ** (-i / head_dim)).to(torch.float32)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    out: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate x [R, H, D] (float32/bfloat16, unit stride on D) at positions [R] (int).

    ``inv_freq`` (float32 [D/2]) may be passed precomputed; by default rope_inv_freq(D, theta).
    """
    if x.dim() != 3 or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(2) != 1:
        raise ValueError(f"x must be float32/bfloat16 [R, H, D] with unit stride on D, got {x.dtype} {tuple(x.shape)}")
    R, H, D = x.shape
    if D % 2:
        raise ValueError(f"head dim must be even, got {D}")
    if positions.shape != (R,) or positions.dtype not in (torch.int32, torch.int64) or positions.device != x.device:
        raise ValueError(f"positions must be int32/int64 [{R}] on {x.device}")
    if inv_freq is None:
        inv_freq = rope_inv_freq(D, theta, x.device)
    elif inv_freq.shape != (D // 2,) or inv_freq.dtype != torch.float32 or inv_freq.device != x.device:
        raise ValueError(f"inv_freq must be float32 [{D // 2}] on {x.device}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(2) != 1 or out.device != x.device:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with unit stride on {x.device}")
    if R == 0:
        return out
    _rope_kernel[(R,)](
        x, out, positions, inv_freq, H, D // 2,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        H_P=triton.next_power_of_2(H), HALF_P=triton.next_power_of_2(D // 2), num_warps=ROPE_NUM_WARPS,
    )
    return out


def rope_ref(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference in torch, float32, same inv_freq table."""
    D = x.shape[-1]
    angle = positions.float()[:, None] * rope_inv_freq(D, theta, x.device)[None, :]  # [R, D/2]
    c, s = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x1, x2 = x.float()[..., : D // 2], x.float()[..., D // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
