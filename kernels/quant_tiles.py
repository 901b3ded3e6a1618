"""GGUF quant blocks decoded in registers: the formats as data, one Triton decoder per format.

A quantized weight row is the GGUF file bytes of that row: a run of blocks along K. Every format
here is a run of *sub-blocks* of ``sub`` weights that share one scale (Q8_0, Q5_0: the 32-weight
block itself; Q4_K: 32 of a 256-weight super-block; Q6_K: 16 of 256). Kernels address a tile of
weights as ``[..., G, S]``: a global sub-block index ``ksub`` ([..., G, 1]) and a position ``s``
inside it ([..., 1, S]). The decoders only broadcast, so the same code serves the ``[BN, G, S]``
tiles of qmatmul and the ``[G, S]`` tiles of the embedding gather.

Each decoder computes the weight with the same float32 expression as ``gguf.quants`` (for example
Q4_K: ``(d * sc) * q - dmin * m``), so a decoded weight equals the reference weight up to the
contraction of that expression into an FMA on a GPU (exactly, under the interpreter).

Byte layouts (ggml): block_q8_0 {f16 d; i8 qs[32]}, block_q5_0 {f16 d; u8 qh[4]; u8 qs[16]},
block_q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}, block_q6_K {u8 ql[128]; u8 qh[64];
i8 scales[16]; f16 d}. f16 scalars are assembled from two little-endian bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize


@dataclass(frozen=True)
class QuantFormat:
    """Facts of one GGUF block format (not tunable)."""

    name: str
    code: int  # GGMLQuantizationType value, passed to the kernels as a constexpr
    block_size: int  # weights per block along K
    type_size: int  # bytes per block
    sub: int  # weights per sub-block sharing one scale

    def row_bytes(self, k: int) -> int:
        return k // self.block_size * self.type_size


FORMATS: dict[str, QuantFormat] = {
    "Q8_0": QuantFormat("Q8_0", int(GGMLQuantizationType.Q8_0), 32, 34, 32),
    "Q5_0": QuantFormat("Q5_0", int(GGMLQuantizationType.Q5_0), 32, 22, 32),
    "Q4_K": QuantFormat("Q4_K", int(GGMLQuantizationType.Q4_K), 256, 144, 32),
    "Q6_K": QuantFormat("Q6_K", int(GGMLQuantizationType.Q6_K), 256, 210, 16),
}


def quant_format(qtype: GGMLQuantizationType | int | str) -> QuantFormat:
    """The format of ``qtype`` (enum, its int value, or its name); raises listing the valid names."""
    if isinstance(qtype, str):
        name = qtype.upper()
    else:
        try:
            name = GGMLQuantizationType(int(qtype)).name
        except ValueError:
            name = str(qtype)
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unsupported quant type {qtype!r}; supported: {', '.join(FORMATS)}")
    return fmt


def check_quant_rows(raw: torch.Tensor, fmt: QuantFormat, n: int, k: int, what: str = "raw") -> None:
    """Raise unless ``raw`` is the contiguous uint8 [n, row_bytes(k)] byte matrix of ``fmt``."""
    if raw.dtype != torch.uint8:
        raise TypeError(f"{what} must be torch.uint8 GGUF bytes, got {raw.dtype}")
    if k <= 0 or k % fmt.block_size:
        raise ValueError(f"K={k} must be a positive multiple of the {fmt.name} block size {fmt.block_size}")
    if tuple(raw.shape) != (n, fmt.row_bytes(k)):
        raise ValueError(f"{what} must be [{n}, {fmt.row_bytes(k)}] for {fmt.name} N={n} K={k}, got {tuple(raw.shape)}")
    if not raw.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


@triton.jit
def _load_u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _load_f16(ptr, mask):
    """The little-endian f16 at ``ptr`` (two bytes), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_q8_0(row_ptr, ksub, s, mask):
    base = row_ptr + ksub * 34
    d = _load_f16(base, mask)
    q = tl.load(base + 2 + s, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return d * q


@triton.jit
def _dequant_q5_0(row_ptr, ksub, s, mask):
    base = row_ptr + ksub * 22
    d = _load_f16(base, mask)
    high = (_load_u8(base + 2 + s // 8, mask) >> (s % 8)) & 1
    low = (_load_u8(base + 6 + s % 16, mask) >> ((s // 16) * 4)) & 0xF
    q = (low | (high << 4)) - 16
    return d * q.to(tl.float32)


@triton.jit
def _dequant_q4_k(row_ptr, ksub, s, mask):
    sb = ksub % 8  # 32-weight sub-block inside the 256-weight super-block
    base = row_ptr + (ksub // 8) * 144
    d = _load_f16(base, mask)
    dmin = _load_f16(base + 2, mask)
    scales = base + 4  # 12 bytes of packed 6-bit scales and mins
    a = _load_u8(scales + sb, mask)
    b = _load_u8(scales + sb + 4, mask)
    c = _load_u8(scales + tl.where(sb >= 4, sb - 4, sb), mask)
    low = sb < 4
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 2) & 0x30))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 2) & 0x30))
    q = (_load_u8(base + 16 + (sb // 2) * 32 + s, mask) >> ((sb % 2) * 4)) & 0xF
    return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)


@triton.jit
def _dequant_q6_k(row_ptr, ksub, s, mask):
    sb = ksub % 16  # 16-weight sub-block inside the 256-weight super-block
    base = row_ptr + (ksub // 16) * 210
    j = sb * 16 + s  # weight index inside the super-block
    half = j // 128
    r = j % 128
    low = (_load_u8(base + half * 64 + r % 64, mask) >> ((r // 64) * 4)) & 0xF
    high = (_load_u8(base + 128 + half * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
    q = (low | (high << 4)) - 32
    sc = tl.load(base + 192 + sb, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d = _load_f16(base + 208, mask)
    return (d * sc) * q.to(tl.float32)


@triton.jit
def dequant_tile(row_ptr, ksub, s, mask, QTYPE: tl.constexpr):
    """Float32 weights of sub-blocks ``ksub`` at positions ``s`` of the rows at ``row_ptr``.

    ``row_ptr`` (uint8 pointers to row starts), ``ksub`` and ``s`` broadcast against each other;
    masked-off lanes read zero bytes and decode to 0.0.
    """
    if QTYPE == 8:  # Q8_0
        w = _dequant_q8_0(row_ptr, ksub, s, mask)
    elif QTYPE == 6:  # Q5_0
        w = _dequant_q5_0(row_ptr, ksub, s, mask)
    elif QTYPE == 12:  # Q4_K
        w = _dequant_q4_k(row_ptr, ksub, s, mask)
    else:  # 14: Q6_K
        tl.static_assert(QTYPE == 14)
        w = _dequant_q6_k(row_ptr, ksub, s, mask)
    return w


def dequant_ref(raw: torch.Tensor, qtype: GGMLQuantizationType | int | str, k: int) -> torch.Tensor:
    """Reference: float32 [N, K] weights of the GGUF rows ``raw``, decoded by gguf.quants (numpy)."""
    fmt = quant_format(qtype)
    check_quant_rows(raw, fmt, raw.shape[0], k)
    w = _gguf_dequantize(raw.cpu().numpy(), GGMLQuantizationType(fmt.code))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(raw.shape[0], k).to(raw.device)
