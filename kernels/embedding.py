"""Token embedding: gather GGUF-quantized rows, decode in registers, scale (Gemma: sqrt(n_embd)).

out[r, :] = dequant(table[ids[r]]) * scale, float32. The table is the uint8 [vocab, row_bytes]
GGUF bytes (Gemma 3: token_embd, Q8_0, shared with the output head). The decoders are those of
qmatmul (quant_tiles.py), so the embedding sees exactly the weights the head multiplies with.
Each weight is (d * q) * scale in float32; a row depends only on its id (batch-invariant).
``embedding_rmsnorm`` also writes the first layer's normed input in the same launch (a decode
step's first two kernels as one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from .pdl import enter, launch_kw
from .quant_tiles import check_quant_rows, dequant_ref, dequant_tile, quant_format

EMBEDDING_GROUPS = 8  # sub-blocks per program: 256 (Q8_0) weights of a row
EMBEDDING_NUM_WARPS = 4


@triton.jit
def _embedding_kernel(
    ids_ptr, table_ptr, o_ptr, n_embd, row_bytes, stride_o, scale,
    QTYPE: tl.constexpr, SUB: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
    r = tl.program_id(0)
    row_ptr = table_ptr + tl.load(ids_ptr + r).to(tl.int64) * row_bytes
    ksub = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    s = tl.arange(0, SUB)
    mask = (ksub < n_embd // SUB)[:, None]
    w = dequant_tile(row_ptr, ksub[:, None], s[None, :], mask, QTYPE)  # [G, S]
    offs = ksub[:, None] * SUB + s[None, :]
    tl.store(o_ptr + r * stride_o + offs, w * scale, mask=mask)


def embedding(
    ids: torch.Tensor,
    table: torch.Tensor,
    n_embd: int,
    scale: float,
    qtype: GGMLQuantizationType | int | str = "Q8_0",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [R, n_embd] rows ``ids`` [R] (int) of the quantized ``table``, times ``scale``."""
    fmt = quant_format(qtype)
    check_quant_rows(table, fmt, table.shape[0], n_embd, what="table")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != table.device:
        raise ValueError(f"ids must be int32/int64 [R] on {table.device}, got {ids.dtype} {tuple(ids.shape)}")
    R = ids.shape[0]
    if ids.device.type == "cpu" and R and not (0 <= int(ids.min()) and int(ids.max()) < table.shape[0]):
        raise ValueError(f"ids must lie in [0, {table.shape[0]})")  # checked only where it costs no sync
    if out is None:
        out = torch.empty((R, n_embd), dtype=torch.float32, device=table.device)
    elif out.shape != (R, n_embd) or out.dtype != torch.float32 or out.stride(1) != 1 or out.device != table.device:
        raise ValueError(f"out must be float32 [{R}, {n_embd}] with unit stride on {table.device}")
    if R == 0:
        return out
    grid = (R, triton.cdiv(n_embd // fmt.sub, EMBEDDING_GROUPS))
    _embedding_kernel[grid](
        ids, table, out, n_embd, table.stride(0), out.stride(0), float(scale),
        QTYPE=fmt.code, SUB=fmt.sub, GROUPS=EMBEDDING_GROUPS, num_warps=EMBEDDING_NUM_WARPS, **launch_kw(out),
    )
    return out


EMBEDDING_NORM_MAX = 16384  # widest row embedding_rmsnorm takes (one program holds the row)


@triton.jit
def _embedding_rmsnorm_kernel(
    ids_ptr, table_ptr, x_ptr, w_ptr, h_ptr, n_embd, row_bytes, stride_x, stride_h, scale, eps,
    QTYPE: tl.constexpr, SUB: tl.constexpr, GROUPS_P: tl.constexpr, PDL: tl.constexpr,
):
    """Row r: x = the embedding (``_embedding_kernel``'s values), then h = (x * rstd) * w with
    ``norm._rmsnorm_kernel``'s expressions (the squares summed as one [GROUPS_P * SUB] vector in
    position order, padded with zeros)."""
    enter(PDL)
    r = tl.program_id(0)
    row_ptr = table_ptr + tl.load(ids_ptr + r).to(tl.int64) * row_bytes
    ksub = tl.arange(0, GROUPS_P)
    s = tl.arange(0, SUB)
    mask = (ksub < n_embd // SUB)[:, None]
    x = tl.reshape(dequant_tile(row_ptr, ksub[:, None], s[None, :], mask, QTYPE) * scale, [GROUPS_P * SUB])
    offs = tl.arange(0, GROUPS_P * SUB)
    inside = offs < n_embd
    tl.store(x_ptr + r * stride_x + offs, x, mask=inside)
    x = tl.where(inside, x, 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n_embd + eps)
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(h_ptr + r * stride_h + offs, (x * rstd) * w, mask=inside)


def embedding_rmsnorm(ids: torch.Tensor, table: torch.Tensor, n_embd: int, scale: float,
                      qtype: GGMLQuantizationType | int | str, w: torch.Tensor, eps: float,
                      x_out: torch.Tensor, h_out: torch.Tensor) -> None:
    """``embedding(ids, ...)`` into x_out (float32 [R, n_embd]) and ``norm.rmsnorm(x, w, eps)``
    into h_out (float32 [R, n_embd]) in one launch, one program per row."""
    fmt = quant_format(qtype)
    check_quant_rows(table, fmt, table.shape[0], n_embd, what="table")
    if n_embd > EMBEDDING_NORM_MAX:
        raise ValueError(f"n_embd={n_embd} exceeds {EMBEDDING_NORM_MAX} (use embedding, then norm.rmsnorm)")
    R = ids.shape[0]
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != table.device:
        raise ValueError(f"ids must be int32/int64 [R] on {table.device}, got {ids.dtype} {tuple(ids.shape)}")
    for name, t in (("x_out", x_out), ("h_out", h_out)):
        if t.shape != (R, n_embd) or t.dtype != torch.float32 or t.stride(1) != 1 or t.device != table.device:
            raise ValueError(f"{name} must be float32 [{R}, {n_embd}] with unit stride on {table.device}")
    if w.shape != (n_embd,) or not w.is_contiguous() or w.device != table.device:
        raise ValueError(f"w must be contiguous [{n_embd}] on {table.device}")
    if R == 0:
        return
    _embedding_rmsnorm_kernel[(R,)](
        ids, table, x_out, w, h_out, n_embd, table.stride(0), x_out.stride(0), h_out.stride(0), float(scale),
        float(eps), QTYPE=fmt.code, SUB=fmt.sub, GROUPS_P=triton.next_power_of_2(n_embd // fmt.sub),
        num_warps=4, **launch_kw(x_out),
    )


def embedding_ref(
    ids: torch.Tensor, table: torch.Tensor, n_embd: int, scale: float,
    qtype: GGMLQuantizationType | int | str = "Q8_0",
) -> torch.Tensor:
    """Reference: gguf.quants decode of the gathered rows, times scale, float32."""
    return dequant_ref(table[ids.long()].contiguous(), qtype, n_embd) * float(scale)
