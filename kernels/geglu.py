"""GeGLU: out = gelu_tanh(gate) * up, elementwise (batch-invariant by construction).

gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), evaluated as the
identical g * sigmoid(2u), with the overflow-free sigmoid (Triton has no portable tanh; this
form also avoids the cancellation of 1 + tanh(u) for very negative g). float32 compute, output in gate's
dtype. gate and up may be column views of one fused [R, 2F] gate|up matmul output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEGLU_BLOCK = 1024
GEGLU_NUM_WARPS = 4


@triton.jit
def _geglu_kernel(g_ptr, u_ptr, o_ptr, F, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(g_ptr + r * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    t = 2.0 * 0.7978845608028654 * (g + 0.044715 * (g * g * g))  # 2u
    z = tl.exp(-tl.abs(t))  # in (0, 1]: no overflow
    sig = tl.where(t >= 0, 1.0 / (1.0 + z), z / (1.0 + z))  # sigmoid(2u), stable
    y = (g * sig) * u
    tl.store(o_ptr + r * stride_o + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


def geglu(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate, up [R, F] (float32/bfloat16, unit stride on F)."""
    for name, t in (("gate", gate), ("up", up)):
        if t.dim() != 2 or t.dtype not in (torch.float32, torch.bfloat16) or t.stride(1) != 1:
            raise ValueError(f"{name} must be float32/bfloat16 [R, F] with unit stride on F, got {t.dtype} {tuple(t.shape)}")
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match, on one device")
    R, F = gate.shape
    if out is None:
        out = torch.empty((R, F), dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype or out.stride(1) != 1 or out.device != gate.device:
        raise ValueError(f"out must be {gate.dtype} {tuple(gate.shape)} with unit stride on {gate.device}")
    if R == 0 or F == 0:
        return out
    _geglu_kernel[(R, triton.cdiv(F, GEGLU_BLOCK))](
        gate, up, out, F, gate.stride(0), up.stride(0), out.stride(0),
        BLOCK=GEGLU_BLOCK, num_warps=GEGLU_NUM_WARPS,
    )
    return out


def geglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference: torch's tanh-approximated GELU, float32."""
    return (torch.nn.functional.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)
