"""Vectorized torch dequantization of GGUF tensors (F32 F16 BF16 Q8_0 Q5_0 Q4_0 Q4_K Q6_K).

Why hand-written rather than `gguf.quants.dequantize`: that code is numpy, slow-ish (it walks
the tensor in groups of 16 rows) and gives numpy arrays; the engine wants torch tensors, and it
wants to dequantize *a few rows* of a table (the 262144 x 640 embedding) without touching the
rest. The Triton kernels also mirror the block layouts below, so they are spelled out here as
named byte offsets once.

Exactness: every formula is ggml's (`dequantize_row_*` in ggml-quants.c, as transcribed in
`gguf.quants`): fp16 scales are converted to float32 first, integers are converted to float32
exactly, and the float32 operations are applied in the same order (e.g. Q4_K is
`(d * sc) * q - (dmin * m)`). The result is bit-for-bit what `gguf.quants.dequantize` returns;
`tests/test_quants.py` asserts it.

Everything is whole-tensor torch ops over a [n_blocks, type_size] byte view: no Python loop
over blocks.

Shapes are in torch order: a GGUF tensor with ne = [640, 262144] (ne[0] is the fastest
dimension) is the torch shape (262144, 640); blocks run along the last dimension.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workbench.errors import WorkbenchError

__all__ = ["SUPPORTED", "bytes_per_row", "dequantize", "dequantize_rows"]

# --------------------------------------------------------------------------------------------
# Block layouts (byte offsets inside one block). The Triton kernels mirror these.
# All multi-byte fields are little-endian; `d`/`dmin` are IEEE fp16.
# --------------------------------------------------------------------------------------------

QK_K = 256  # elements per K-quant super-block

# Q8_0: 32 elements, 34 bytes.  y[j] = d * qs[j]   (qs int8)
Q8_0_BLOCK = 32
Q8_0_BYTES = 34
Q8_0_D = 0  # fp16 scale, 2 bytes
Q8_0_QS = 2  # 32 x int8

# Q4_0: 32 elements, 18 bytes.  y[j] = d * ((qs[j] & 0xF) - 8), y[j+16] = d * ((qs[j] >> 4) - 8)
Q4_0_BLOCK = 32
Q4_0_BYTES = 18
Q4_0_D = 0  # fp16 scale, 2 bytes
Q4_0_QS = 2  # 16 bytes of nibble pairs

# Q5_0: 32 elements, 22 bytes.  5th bit of element j is bit j of the little-endian uint32 qh.
#   y[j] = d * (((qs[j] & 0xF) | bit(qh, j) << 4) - 16)
#   y[j+16] = d * (((qs[j] >> 4) | bit(qh, j+16) << 4) - 16)
Q5_0_BLOCK = 32
Q5_0_BYTES = 22
Q5_0_D = 0  # fp16 scale, 2 bytes
Q5_0_QH = 2  # 4 bytes: uint32 of high bits
Q5_0_QS = 6  # 16 bytes of nibble pairs

# Q4_K: 256 elements, 144 bytes; 8 sub-blocks of 32, each with a 6-bit scale and 6-bit min.
#   Sub-block 2*i+s (i in 0..3, s in 0..1) uses nibble s (low, high) of qs[32*i : 32*i+32].
#   y = (d * sc[k]) * q - (dmin * m[k])
#   scales[12] packs sc/m (j < 4: sc = s[j] & 63, m = s[j+4] & 63;
#   j >= 4: sc = (s[j+4] & 0xF) | ((s[j-4] >> 6) << 4), m = (s[j+4] >> 4) | ((s[j] >> 6) << 4)).
Q4_K_BLOCK = QK_K
Q4_K_BYTES = 144
Q4_K_D = 0  # fp16 super-block scale
Q4_K_DMIN = 2  # fp16 super-block min scale
Q4_K_SCALES = 4  # 12 bytes: packed 6-bit scales and mins
Q4_K_QS = 16  # 128 bytes of nibbles
Q4_K_SCALES_BYTES = 12

# Q6_K: 256 elements, 210 bytes; 16 sub-blocks of 16 with int8 scales.
#   For half h in 0..1 and l in 0..31 (ql_h = ql[64h:], qh_h = qh[32h:], base = 128h):
#   q[base+l]    = (ql_h[l]    & 0xF) | ((qh_h[l] >> 0) & 3) << 4
#   q[base+l+32] = (ql_h[l+32] & 0xF) | ((qh_h[l] >> 2) & 3) << 4
#   q[base+l+64] = (ql_h[l]    >> 4)  | ((qh_h[l] >> 4) & 3) << 4
#   q[base+l+96] = (ql_h[l+32] >> 4)  | ((qh_h[l] >> 6) & 3) << 4
#   y[e] = (d * scales[e // 16]) * (q[e] - 32)
Q6_K_BLOCK = QK_K
Q6_K_BYTES = 210
Q6_K_QL = 0  # 128 bytes: low 4 bits
Q6_K_QH = 128  # 64 bytes: high 2 bits
Q6_K_SCALES = 192  # 16 x int8
Q6_K_D = 208  # fp16 super-block scale

_T = GGMLQuantizationType

for _qt, _block, _bytes in (
    (_T.Q8_0, Q8_0_BLOCK, Q8_0_BYTES),
    (_T.Q4_0, Q4_0_BLOCK, Q4_0_BYTES),
    (_T.Q5_0, Q5_0_BLOCK, Q5_0_BYTES),
    (_T.Q4_K, Q4_K_BLOCK, Q4_K_BYTES),
    (_T.Q6_K, Q6_K_BLOCK, Q6_K_BYTES),
):
    assert GGML_QUANT_SIZES[_qt] == (_block, _bytes), (_qt, GGML_QUANT_SIZES[_qt])

# Display order of the supported types (error messages).
_SUPPORTED_ORDER = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q5_0, _T.Q4_0, _T.Q4_K, _T.Q6_K)
SUPPORTED = frozenset(_SUPPORTED_ORDER)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    supported = ", ".join(t.name for t in _SUPPORTED_ORDER)
    try:
        qt = GGMLQuantizationType(qtype)
    except ValueError:
        raise WorkbenchError(
            f"unknown GGUF tensor type {qtype!r}; supported types: {supported}"
        ) from None
    if qt not in SUPPORTED:
        raise WorkbenchError(
            f"unsupported GGUF tensor type {qt.name}; supported types: {supported}"
        )
    return qt


def _as_flat_bytes(raw) -> torch.Tensor:
    """A flat torch.uint8 view (no copy where possible) of a tensor's stored bytes."""
    if isinstance(raw, torch.Tensor):
        t = raw
        if t.dtype != torch.uint8:
            t = t.contiguous().view(torch.uint8)
        return t.reshape(-1)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if isinstance(raw, np.ndarray):
        a = np.ascontiguousarray(raw)
        if a.dtype != np.uint8:
            a = a.view(np.uint8)
        a = a.reshape(-1)
        # GGUFReader memmaps are read-only; we never write through this view.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    raise TypeError(f"raw must be a torch.Tensor or numpy array of bytes, got {type(raw).__name__}")


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret bytes as `dtype`; copies only when the view is misaligned."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.contiguous().clone().view(dtype)


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at byte `off` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, off : off + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2, k] (low nibbles, then high nibbles)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


# --------------------------------------------------------------------------------------------
# per-type dequantization: flat uint8 bytes -> flat float32 of n elements
# --------------------------------------------------------------------------------------------


def _deq_f32(flat: torch.Tensor, n: int) -> torch.Tensor:
    return _view(flat, torch.float32).clone()


def _deq_f16(flat: torch.Tensor, n: int) -> torch.Tensor:
    return _view(flat, torch.float16).to(torch.float32)


def _deq_bf16(flat: torch.Tensor, n: int) -> torch.Tensor:
    # bf16 is the top half of an fp32: shift the bits up (exact for every value, NaNs included).
    return (_view(flat, torch.int16).to(torch.int32) << 16).view(torch.float32)


def _deq_q8_0(flat: torch.Tensor, n: int) -> torch.Tensor:
    b = flat.view(-1, Q8_0_BYTES)
    d = _f16(b, Q8_0_D)
    y = b[:, Q8_0_QS:].view(torch.int8).to(torch.float32)
    return y.mul_(d).reshape(-1)


def _deq_q4_0(flat: torch.Tensor, n: int) -> torch.Tensor:
    b = flat.view(-1, Q4_0_BYTES)
    d = _f16(b, Q4_0_D)
    q = _nibbles(b[:, Q4_0_QS:]).view(-1, Q4_0_BLOCK)
    y = q.to(torch.float32).sub_(8.0)  # exact: small integers
    return y.mul_(d).reshape(-1)


_BITS8 = torch.arange(8, dtype=torch.uint8)  # Q5_0 qh bit positions within a byte
_QH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)  # Q6_K qh 2-bit fields


def _deq_q5_0(flat: torch.Tensor, n: int) -> torch.Tensor:
    b = flat.view(-1, Q5_0_BYTES)
    d = _f16(b, Q5_0_D)
    qh = b[:, Q5_0_QH:Q5_0_QS]  # [n, 4] little-endian uint32: bit j -> byte j // 8, bit j % 8
    hb = ((qh.unsqueeze(-1) >> _BITS8) & 1).view(-1, Q5_0_BLOCK)
    ql = _nibbles(b[:, Q5_0_QS:]).view(-1, Q5_0_BLOCK)
    y = (ql | (hb << 4)).to(torch.float32).sub_(16.0)  # exact: small integers
    return y.mul_(d).reshape(-1)


def _deq_q4_k(flat: torch.Tensor, n: int) -> torch.Tensor:
    b = flat.view(-1, Q4_K_BYTES)
    nb = b.shape[0]
    d = _f16(b, Q4_K_D)
    dmin = _f16(b, Q4_K_DMIN)
    s = b[:, Q4_K_SCALES : Q4_K_SCALES + Q4_K_SCALES_BYTES].reshape(nb, 3, 4)
    s_d, s_m, s_md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((s_d & 0x3F, (s_md & 0x0F) | ((s_d >> 2) & 0x30)), dim=1)  # [nb, 8]
    mn = torch.cat((s_m & 0x3F, (s_md >> 4) | ((s_m >> 2) & 0x30)), dim=1)  # [nb, 8]
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)  # [nb, 8, 1]
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    q = _nibbles(b[:, Q4_K_QS:].reshape(nb, 4, 32)).reshape(nb, 8, 32)
    y = q.to(torch.float32).mul_(dl).sub_(ml)
    return y.reshape(-1)


def _deq_q6_k(flat: torch.Tensor, n: int) -> torch.Tensor:
    b = flat.view(-1, Q6_K_BYTES)
    nb = b.shape[0]
    d = _f16(b, Q6_K_D)
    scales = b[:, Q6_K_SCALES:Q6_K_D].view(torch.int8).to(torch.float32)  # [nb, 16]
    dl = (d * scales).unsqueeze(-1)  # [nb, 16, 1]
    ql = _nibbles(b[:, Q6_K_QL:Q6_K_QH].reshape(nb, 2, 64)).reshape(nb, 8, 32)
    qh = b[:, Q6_K_QH:Q6_K_SCALES].reshape(nb, 2, 1, 32)
    qh = ((qh >> _QH_SHIFTS) & 0x03).reshape(nb, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8).to(torch.float32).sub_(32.0)  # exact
    y = q.view(nb, 16, 16).mul_(dl)
    return y.reshape(-1)


_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor, int], torch.Tensor]] = {
    _T.F32: _deq_f32,
    _T.F16: _deq_f16,
    _T.BF16: _deq_bf16,
    _T.Q8_0: _deq_q8_0,
    _T.Q4_0: _deq_q4_0,
    _T.Q5_0: _deq_q5_0,
    _T.Q4_K: _deq_q4_k,
    _T.Q6_K: _deq_q6_k,
}
assert frozenset(_DEQUANT) == SUPPORTED


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def bytes_per_row(qtype: GGMLQuantizationType, row_len: int) -> int:
    """Bytes one row of `row_len` elements takes in the file (row_len must fill whole blocks)."""
    qt = _qtype(qtype)
    block, type_size = GGML_QUANT_SIZES[qt]
    row_len = int(row_len)
    if row_len < 0 or row_len % block:
        raise WorkbenchError(
            f"row length {row_len} is not a multiple of the {qt.name} block size {block}"
        )
    return row_len // block * type_size


def dequantize(raw, qtype: GGMLQuantizationType, shape: Sequence[int] | int) -> torch.Tensor:
    """Dequantize a whole GGUF tensor to float32 of `shape` (torch order: reversed GGUF ne).

    `raw` holds the tensor's bytes exactly as stored (torch.uint8 tensor or numpy array, any
    shape; e.g. `GGUFReader(...).tensors[i].data`). Bit-exact with `gguf.quants.dequantize`.
    The result never aliases `raw`.
    """
    qt = _qtype(qtype)
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if not shape:
        raise WorkbenchError(f"{qt.name} tensor shape must have at least one dimension")
    n = math.prod(shape)
    expected = (n // shape[-1] if shape[-1] else 0) * bytes_per_row(qt, shape[-1])
    flat = _as_flat_bytes(raw)
    if flat.numel() != expected:
        raise WorkbenchError(
            f"{qt.name} tensor of shape {list(shape)} needs {expected} bytes, got {flat.numel()}"
        )
    if n == 0:
        return torch.empty(shape, dtype=torch.float32)
    return _DEQUANT[qt](flat, n).reshape(shape)


def dequantize_rows(raw2d, qtype: GGMLQuantizationType, row_ids, row_len: int) -> torch.Tensor:
    """Dequantize only the rows `row_ids` of a 2-D GGUF tensor: float32 [len(row_ids), row_len].

    `raw2d` is the tensor's bytes viewed as [num_rows, bytes_per_row] (a flat byte buffer of
    whole rows is accepted too). `row_ids` is a slice, an int, or a sequence / integer tensor of
    row indices (flattened, so a [B, T] tensor of token ids gives B*T rows). Only the selected
    rows are read, so an embedding lookup never dequantizes the whole table.
    """
    qt = _qtype(qtype)
    bpr = bytes_per_row(qt, row_len)
    flat = _as_flat_bytes(raw2d)
    if bpr == 0 or flat.numel() % bpr:
        raise WorkbenchError(
            f"{qt.name} rows of length {row_len} take {bpr} bytes each; "
            f"the buffer holds {flat.numel()} bytes, not a whole number of rows"
        )
    table = flat.view(-1, bpr)
    if isinstance(row_ids, slice):
        picked = table[row_ids].contiguous()
    else:
        idx = torch.as_tensor(row_ids, dtype=torch.long).reshape(-1)
        picked = table[idx]
    k = picked.shape[0]
    if k == 0:
        return torch.empty((0, row_len), dtype=torch.float32)
    return _DEQUANT[qt](picked.reshape(-1), k * row_len).reshape(k, row_len)
