"""y[M, N] = x[M, K] @ W^T for a GGUF-quantized W, batch-invariant in M. Two paths:

**Packed path (the decode-shaped one; what the runner uses).** ``pack_weights`` splits the GGUF
blocks once, at load time, into planes laid out for wide loads (same bits, same byte count
within 3%, see ``PackedWeight``), and ``qmatmul(x, packed)`` runs ``_qgemv_kernel``:

* a program owns BLOCK_N output features x up to M_TILE rows of x. For each fixed BLOCK_K step
  of its K range it loads the weight tile [BLOCK_N, G, S] (G groups of weights sharing a scale,
  S contiguous quant bytes: 16-byte vector loads), decodes it ONCE in registers with gguf's own
  float32 expressions (integer -> float by an exact bit trick instead of a conversion
  instruction), then for each row of the tile does plain float32 multiply-adds: the decoded
  weights times x, no tl.dot (so no tf32 question, and the CPU interpreter runs the very same
  arithmetic as the GPU).
* the rows of a tile are unrolled; row r runs only if it exists (a uniform runtime branch), so
  a 1-row call does 1 row of arithmetic, and every row runs literally the same instruction
  sequence on its own data, at any position in any M.
* Precision: IEEE float32, products and sums rounded to nearest (the GPU compiler may fuse a
  multiply and the following add into one FMA: the same fusion for every row). Order, fixed by
  the format and config alone: per BLOCK_K step, t = w0 * x0 (+ w1 * x1 ...: the planes,
  elementwise, in plane order), then ``tl.sum`` over S (a fixed tree given the tile shape and
  num_warps); then either ``tl.sum`` over G added to the row's accumulator, or (late_reduce) added
  to per-(output, group-lane) accumulators that are summed over G once after the last step. K
  steps in increasing order. Measured on an H200 (docs/GPU_NOTES.md): a decode step's 82 products
  486 us at 1 row (old path 1,280, cuBLAS bf16 465), 656 at 4, 1,292 at 16 (old 1,294).
* the first K step's weights are decoded before ``pdl.enter`` (no step writes weights), so
  with programmatic dependent launch they overlap the kernel that produces x.
* grid: (ceil(M / M_TILE) * ceil(N / BLOCK_N), splits) with the same fixed split-K as the raw
  path (``num_k_splits``: a function of N and K only), so consumers of the split partials work
  with either path.

**Raw path (the original).** ``qmatmul(x, raw_bytes, qtype, N, K)`` decodes the GGUF bytes
directly (``_qmatmul_kernel``):

* A program owns a tile of BLOCK_N output features and BLOCK_M (16) rows of x. It walks its K
  range in fixed steps of BLOCK_K, decodes each weight tile ONCE into float32 registers (as
  [BLOCK_N, G, S] sub-blocks, so byte loads are coalesced) and multiplies it with all its rows.
* Narrow weights (N <= QMATMUL_SPLIT_MAX_N) would give too few programs, so K is cut into fixed
  slices (``k_slice``: QMATMUL_SPLIT_K weights, QMATMUL_NARROW_SPLIT_K for the narrowest); each
  slice's partial product goes to a workspace and ``_sum_splits_kernel`` adds the slices in
  order. The slices depend on the product's shape (and formats) only, never on M.
* Nothing depends on M: tile shapes, K slices and K order are fixed (M is ``do_not_specialize``),
  padded rows are zeros, so row i of an M-row call is bitwise the 1-row call, at any position in
  the batch.
* On a GPU the tile product is ``tl.dot`` with input_precision QMATMUL_INPUT_PRECISION ("tf32x3":
  about fp32 accurate on tensor cores; "ieee": true fp32 FMAs, 3-10x slower on an H200; never
  the default "tf32"). Under the CPU interpreter tl.dot is numpy/OpenBLAS sgemm, whose row
  results depend on the row's position in the tile (measured here: 84 of 120 shifted rows
  differ), so there the same sums are a broadcast multiply + ``tl.sum``. Each form is
  batch-invariant; they are not bitwise equal to each other.
* Prefill (M > 16) runs ceil(M / 16) row tiles; consecutive programs share an N tile (pid_m
  varies fastest) so the re-reads of a weight tile come from L2.

**Dispatch.** The path is chosen by the weight's representation (a ``PackedWeight`` or raw
bytes), never by M: the two paths are each batch-invariant but not bitwise equal to each other
(FMA sums vs tf32x3 tensor-core products), so a given weight must always be called in one
representation (the runner packs every weight at load). Both: weights decoded in float32
exactly as gguf.quants does; x bf16 is upcast exactly; output float32; vs ``qmatmul_ref`` only
the summation order (and, raw path on a GPU, tf32x3's splitting) differs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from .pdl import enter, launch_kw
from .quant_tiles import (
    QuantFormat,
    check_quant_rows,
    dequant_ref,
    dequant_tile,
    quant_format,
)
from .step_fused import glu_pair_epilogue


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
# Narrow products (few output tiles, so few programs: Gemma 3 270M's attention output and FFN
# down, N = 640, 40 and 80 programs at 256) take slices of QMATMUL_NARROW_SPLIT_K: twice the
# programs, twice the partials for the consumer. H200 (session 8, runs 42-43): 0.726 -> 0.695-0.698
# ms per step at 16 slots, 0.898 -> 0.880 at 32, 1 and 4 slots unchanged; slices of 128 for the
# wide products too (q|k|v, gate|up) were slower at 32 slots (0.940), narrow slices of 64 slower
# at every count (docs/GPU_NOTES.md, session 8). Since session 10 the bound is 2048, which takes
# q|k|v (N = 1536) in 128-weight slices too: one K step per program, 5 partials instead of 3
# (H200, run 50: 0.668 -> 0.644 ms at 16 slots, 0.613 -> 0.584 at 1, 0.843 -> 0.850 at 32; gate|up,
# N = 4096, stays at 256: every product at 128 was 0.671 at 16 slots, 0.899 at 32).
QMATMUL_NARROW_N = 2048
QMATMUL_NARROW_SPLIT_K = 128
# Per-format slices (at most these; for measurements): a product's slice is the smallest of its
# members' (a fused q|k|v is one product, one slice). Every slice is fixed at load by the weights'
# shapes and formats, never by the rows; a launch's configs take K steps of at most the slice
# (``mma_config``, ``gemv_config``).
QMATMUL_FORMAT_SPLIT_K: dict[str, int] = {}
# tl.dot precision on a GPU. "tf32x3": three TF32 tensor-core products, about fp32 accurate
# (measured on an H200: max error / max |y| 3e-7..5e-7, vs 6e-7..2e-6 for "ieee") and 3x to 10x
# faster than "ieee" (true fp32 FMAs, the reference-exact variant). Never "tf32" (the default).
QMATMUL_INPUT_PRECISION = "tf32x3"


def k_slice(N: int, K: int, formats: tuple[str, ...] = ()) -> int:
    """Weights per K slice of an N x K product whose members have these formats (K: one slice,
    unsplit). By shape and format only."""
    if N > QMATMUL_SPLIT_MAX_N:
        return K
    base = QMATMUL_NARROW_SPLIT_K if N <= QMATMUL_NARROW_N else QMATMUL_SPLIT_K
    return min([base, K] + [QMATMUL_FORMAT_SPLIT_K[f] for f in formats if f in QMATMUL_FORMAT_SPLIT_K])


def num_k_splits(N: int, K: int, formats: tuple[str, ...] = ()) -> int:
    """How many K slices an N x K product is computed in (1: no split): ``k_slice``'s."""
    return triton.cdiv(K, k_slice(N, K, formats))


@triton.jit(do_not_specialize=["M"])
def _qmatmul_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, row_bytes,
    QTYPE: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
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
def _sum_splits_kernel(part_ptr, y_ptr, M, N, num_splits, stride_ym, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = ((part[0] + part[1]) + ...) in slice order; part is [num_splits, M, N]."""
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for sp in range(1, num_splits):
        acc += tl.load(part_ptr + sp * M * N + offs, mask=mask, other=0.0)
    tl.store(y_ptr + (offs // N) * stride_ym + offs % N, acc, mask=mask)


# ---- packed path --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedWeight:
    """A GGUF weight [N, K] split into planes (struct of arrays) for ``_qgemv_kernel``.

    The same bits as the GGUF blocks, regrouped so that every plane row is 16-byte aligned and
    a tile loads with wide contiguous loads (``pack_weights`` says which bytes go where):

    ======  ======================  ======================  =========================  ================
    format  qs (uint8)              qh                      sc (int32, 4 bytes/group)  d (float16)
    ======  ======================  ======================  =========================  ================
    Q8_0    [N, K] int8 quants      --                      --                         [N, K/32] d
    Q5_0    [N, K/2] ggml qs        int32 [N, K/32] (qh)    --                         [N, K/32] d
    Q4_K    [N, K/2] ggml qs        --                      [N, K/64] sc,m lo; sc,m hi [N, K/128] d,dmin
    Q6_K    [N, K/2] ggml ql        uint8 [N, K/4] ggml qh  [N, K/64] 4 int8 scales    [N, K/256] d
    ======  ======================  ======================  =========================  ================

    Bytes per weight: Q8_0 1.0625, Q5_0 0.6875 (both as GGUF), Q4_K 0.578 (GGUF 0.5625: the
    6-bit scales unpacked to bytes), Q6_K 0.8203 (as GGUF).
    """

    fmt: QuantFormat
    N: int
    K: int
    qs: torch.Tensor
    d: torch.Tensor
    qh: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    # weights per K slice where the product is split (0: ``k_slice`` of this weight alone; a
    # member of a fused product takes the product's, set at load)
    k_split: int = 0

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def slice_k(self) -> int:
        return self.k_split or k_slice(self.N, self.K, (self.fmt.name,))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.qh, self.sc) if t is not None)

    def to(self, device) -> PackedWeight:
        def mv(t):
            return None if t is None else t.to(device)

        return PackedWeight(self.fmt, self.N, self.K, mv(self.qs), mv(self.d), mv(self.qh), mv(self.sc), self.k_split)


def pack_weights(raw: torch.Tensor, qtype: GGMLQuantizationType | int | str, N: int, K: int,
                 k_split: int = 0) -> PackedWeight:
    """Split the GGUF rows ``raw`` (uint8 [N, row_bytes], any device) into a PackedWeight on the
    same device. Pure byte moves (and, for Q4_K, the 6-bit scale unpacking of ggml): the packed
    path decodes exactly the weights the raw path decodes. ``k_split``: the weight's K slice as
    a member of a fused product (``PackedWeight.k_split``)."""
    fmt = quant_format(qtype)
    check_quant_rows(raw, fmt, N, K)
    nb = K // fmt.block_size
    b = raw.view(N, nb, fmt.type_size)

    def plane(lo: int, hi: int) -> torch.Tensor:
        return b[:, :, lo:hi].contiguous().view(N, -1)

    if fmt.name == "Q8_0":  # {f16 d; i8 qs[32]}
        return PackedWeight(fmt, N, K, qs=plane(2, 34), d=plane(0, 2).view(torch.float16), k_split=k_split)
    if fmt.name == "Q5_0":  # {f16 d; u8 qh[4]; u8 qs[16]}
        return PackedWeight(fmt, N, K, qs=plane(6, 22), d=plane(0, 2).view(torch.float16),
                            qh=plane(2, 6).view(torch.int32), k_split=k_split)
    if fmt.name == "Q4_K":  # {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}
        s = b[:, :, 4:16].to(torch.int32)
        lo_d, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([lo_d & 0x3F, (hi & 0x0F) | ((lo_d >> 2) & 0x30)], dim=-1)  # [N, nb, 8]
        mn = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
        # per 64-weight group (sub-blocks 2j, 2j+1): bytes (sc lo, min lo, sc hi, min hi)
        scm = torch.stack([sc, mn], dim=-1).reshape(N, nb, 4, 4).to(torch.uint8)
        return PackedWeight(fmt, N, K, qs=plane(16, 144), d=plane(0, 4).view(torch.float16),
                            sc=scm.reshape(N, -1).view(torch.int32), k_split=k_split)
    # Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
    sc = b[:, :, 192:208].reshape(N, nb, 2, 4, 2)  # [half, c, h]: scale of sub-block half*8 + 2c + h
    sc = sc.permute(0, 1, 2, 4, 3).contiguous()  # per 64-weight group (half, h): the scales c = 0..3
    return PackedWeight(fmt, N, K, qs=plane(0, 128), d=plane(208, 210).view(torch.float16),
                        qh=plane(128, 192), sc=sc.view(N, -1).view(torch.int32),
                        k_split=k_split)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output features per program
    block_k: int  # weights along K per step: divides QMATMUL_SPLIT_K, a multiple of the group
    m_tile: int  # rows per program (1, 2, 4 or 8); more rows take more programs
    num_warps: int
    num_stages: int = 1  # > 1: the K loop's loads are software-pipelined (async copies)
    late_reduce: bool = False  # keep per-lane partial sums over K, reduce across lanes once at the end


# Launch configurations of the packed path, per format, for split weights (N <= QMATMUL_SPLIT_MAX_N:
# the layer products) and for wide ones (the head). Fixed: chosen from the weight's shape only.
QGEMV_CONFIGS: dict[str, GemvConfig] = {  # chosen on an H200 (docs/GPU_NOTES.md), graph-timed
    "Q8_0": GemvConfig(block_n=16, block_k=256, m_tile=8, num_warps=8),
    "Q5_0": GemvConfig(block_n=16, block_k=128, m_tile=8, num_warps=4, late_reduce=True),
    # one K step per 256-weight slice: all of a program's weights decoded before its PDL wait
    # (session 4 on an H200: 0.848 -> 0.824 ms at 1 slot, 1.125 -> 1.079 at 16 vs block_k=128)
    "Q4_K": GemvConfig(block_n=32, block_k=256, m_tile=4, num_warps=4, late_reduce=True),
    "Q6_K": GemvConfig(block_n=16, block_k=256, m_tile=8, num_warps=4, late_reduce=True),
}
QGEMV_WIDE_CONFIGS: dict[str, GemvConfig] = {
    "Q8_0": GemvConfig(block_n=16, block_k=128, m_tile=8, num_warps=4, num_stages=3, late_reduce=True),
}


# Under the CPU interpreter every program is Python work: wider N tiles there, fewer programs
# (tests/test_triton_runner.py on the packed path: 226 s with the GPU tiles, 47 s with these).
# Same arithmetic form per output, another tile; each device's form is batch-invariant on its own
# (as the raw path's tl.dot / tl.sum forms). Configs passed explicitly are used as given.
QGEMV_INTERPRETER_MIN_BLOCK_N = 128


def gemv_config(name: str, N: int, K: int, device: torch.device | str = "cuda",
                slice_k: int | None = None) -> GemvConfig:
    """The packed path's launch configuration for a weight of format ``name``, N x K, on ``device``
    (never M); ``slice_k`` (the weight's K slice, ``PackedWeight.slice_k``): steps of at most that."""
    cfg = QGEMV_WIDE_CONFIGS[name] if num_k_splits(N, K) == 1 and name in QGEMV_WIDE_CONFIGS else QGEMV_CONFIGS[name]
    cfg = clamp_block_k(cfg, K, slice_k)
    if torch.device(device).type == "cpu":
        cfg = replace(cfg, block_n=max(cfg.block_n, QGEMV_INTERPRETER_MIN_BLOCK_N))
    return cfg


def steps_fit(w: PackedWeight, splits: int, block_k: int) -> bool:
    """Whether K steps of ``block_k`` tile each K slice of a launch of ``w`` in ``splits`` slices
    (an unsplit launch: steps dividing QMATMUL_SPLIT_K, as every config's are)."""
    return (w.slice_k if splits > 1 else QMATMUL_SPLIT_K) % block_k == 0


def clamp_block_k(cfg, K: int, slice_k: int | None):
    """``cfg`` (a GEMV or tensor-core config) with K steps of at most a split weight's slice."""
    return replace(cfg, block_k=slice_k) if slice_k is not None and slice_k < K and cfg.block_k > slice_k else cfg


# (weights per group, quant bytes per group row in a tile, planes, x offset between planes)
_GEMV_GEOMETRY = {"Q8_0": (32, 16, 2, 16), "Q5_0": (32, 16, 2, 16), "Q4_K": (64, 16, 4, 16), "Q6_K": (64, 16, 4, 32)}


@triton.jit
def _int_to_f32(v, OFFSET: tl.constexpr):
    """float32(v - OFFSET) for int32 v in [0, 2^23): exact, by the bit pattern of 2^23 + v
    (an OR and a subtraction instead of an integer-to-float conversion instruction)."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _load_planes(qs_rows, qh_rows, sc_rows, d_rows, gg3, s3, mask, QTYPE: tl.constexpr):
    """The bytes ``_decode_planes`` decodes, as loaded (five tensors; unused ones repeat the
    last): the memory half of the decode."""
    if QTYPE == 8:  # Q8_0: bytes 0..15 and 16..31 of each block, its scale
        r0 = tl.load(qs_rows + gg3 * 32 + s3, mask=mask, other=0)
        r1 = tl.load(qs_rows + gg3 * 32 + 16 + s3, mask=mask, other=0)
        r2 = tl.load(d_rows + gg3, mask=mask, other=0.0)
        r3 = r2
        r4 = r2
    elif QTYPE == 6:  # Q5_0: byte s holds weights s (low nibble) and s + 16; qh bit j: weight j
        r0 = tl.load(qs_rows + gg3 * 16 + s3, mask=mask, other=0)
        r1 = tl.load(qh_rows + gg3, mask=mask, other=0)
        r2 = tl.load(d_rows + gg3, mask=mask, other=0.0)
        r3 = r2
        r4 = r2
    elif QTYPE == 12:  # Q4_K: group j = sub-blocks (2j, 2j+1), 32 bytes; byte i: weight 64j + i
        # (low nibble, sub-block 2j) and 64j + 32 + i (high nibble); planes: bytes 0..15 / 16..31
        r0 = tl.load(qs_rows + gg3 * 32 + s3, mask=mask, other=0)
        r1 = tl.load(qs_rows + gg3 * 32 + 16 + s3, mask=mask, other=0)
        r2 = tl.load(sc_rows + gg3, mask=mask, other=0)  # scale lo, min lo, scale hi, min hi
        dp = d_rows + (gg3 // 4) * 2
        r3 = tl.load(dp, mask=mask, other=0.0)  # d
        r4 = tl.load(dp + 1, mask=mask, other=0.0)  # dmin
    else:  # Q6_K: group = (half hb, h) of a super-block; weight hb*128 + 32c + 16h + s, c = 0..3
        tl.static_assert(QTYPE == 14)
        hb3 = gg3 // 2
        h3 = gg3 % 2
        r0 = tl.load(qh_rows + gg3 * 16 + s3, mask=mask, other=0)
        r1 = tl.load(qs_rows + hb3 * 64 + h3 * 16 + s3, mask=mask, other=0)
        r2 = tl.load(qs_rows + hb3 * 64 + 32 + h3 * 16 + s3, mask=mask, other=0)
        r3 = tl.load(sc_rows + gg3, mask=mask, other=0)  # 4 int8 scales, c = 0..3
        r4 = tl.load(d_rows + gg3 // 4, mask=mask, other=0.0)
    return r0, r1, r2, r3, r4


@triton.jit
def _decode_loaded(r0, r1, r2, r3, r4, s3, QTYPE: tl.constexpr):
    """``_load_planes``' bytes as up to four float32 planes [BN, G, S]; gguf.quants' float32
    expressions (the arithmetic half of the decode)."""
    if QTYPE == 8:  # Q8_0: w = d * q; plane 0: bytes 0..15 of a block, plane 1: bytes 16..31
        d = r2.to(tl.float32)
        w0 = d * _int_to_f32(r0.to(tl.int32) ^ 0x80, 128.0)
        w1 = d * _int_to_f32(r1.to(tl.int32) ^ 0x80, 128.0)
        w2 = w0
        w3 = w0
    elif QTYPE == 6:  # Q5_0
        b = r0.to(tl.int32)
        h = r1
        d = r2.to(tl.float32)
        w0 = d * _int_to_f32((b & 0xF) | (((h >> s3) & 1) << 4), 16.0)
        w1 = d * _int_to_f32((b >> 4) | (((h >> (s3 + 16)) & 1) << 4), 16.0)
        w2 = w0
        w3 = w0
    elif QTYPE == 12:  # Q4_K
        a = r0.to(tl.int32)
        b = r1.to(tl.int32)
        v = r2
        d = r3.to(tl.float32)
        dmin = r4.to(tl.float32)
        dl = d * (v & 0xFF).to(tl.float32)
        ml = dmin * ((v >> 8) & 0xFF).to(tl.float32)
        dh = d * ((v >> 16) & 0xFF).to(tl.float32)
        mh = dmin * ((v >> 24) & 0xFF).to(tl.float32)
        w0 = dl * _int_to_f32(a & 0xF, 0.0) - ml  # k = 64j + s
        w1 = dl * _int_to_f32(b & 0xF, 0.0) - ml  # k = 64j + 16 + s
        w2 = dh * _int_to_f32(a >> 4, 0.0) - mh  # k = 64j + 32 + s
        w3 = dh * _int_to_f32(b >> 4, 0.0) - mh  # k = 64j + 48 + s
    else:  # Q6_K
        qh = r0.to(tl.int32)
        a = r1.to(tl.int32)
        b = r2.to(tl.int32)
        v = r3
        d = r4.to(tl.float32)
        w0 = (d * ((v << 24) >> 24).to(tl.float32)) * _int_to_f32((a & 0xF) | ((qh & 3) << 4), 32.0)
        w1 = (d * ((v << 16) >> 24).to(tl.float32)) * _int_to_f32((b & 0xF) | (((qh >> 2) & 3) << 4), 32.0)
        w2 = (d * ((v << 8) >> 24).to(tl.float32)) * _int_to_f32((a >> 4) | (((qh >> 4) & 3) << 4), 32.0)
        w3 = (d * (v >> 24).to(tl.float32)) * _int_to_f32((b >> 4) | (((qh >> 6) & 3) << 4), 32.0)
    return w0, w1, w2, w3


@triton.jit
def _decode_planes(qs_rows, qh_rows, sc_rows, d_rows, gg3, s3, mask, QTYPE: tl.constexpr):
    """The weights of groups ``gg3`` ([1, G, 1]) of the rows at ``*_rows`` ([BN, 1, 1]) as up to
    four float32 planes [BN, G, S]: load, then decode."""
    r0, r1, r2, r3, r4 = _load_planes(qs_rows, qh_rows, sc_rows, d_rows, gg3, s3, mask, QTYPE)
    return _decode_loaded(r0, r1, r2, r3, r4, s3, QTYPE)


@triton.jit
def _step_planes(k0, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows, GW: tl.constexpr, QTYPE: tl.constexpr):
    """The decoded planes of the K step at k0 (groups past k_end masked off)."""
    gg = k0 // GW + g
    mask = nmask[:, None, None] & (k0 + g * GW < k_end)[None, :, None]
    return _decode_planes(qs_rows, qh_rows, sc_rows, d_rows, gg[None, :, None], s3, mask, QTYPE)


@triton.jit
def _x_offsets(gg, s, QTYPE: tl.constexpr, GW: tl.constexpr):
    """K index [G, S] of plane 0's weights (plane c: + c * PSTEP)."""
    if QTYPE == 14:
        xo = (gg[:, None] // 2) * 128 + (gg[:, None] % 2) * 16 + s[None, :]
    else:
        xo = gg[:, None] * GW + s[None, :]
    return xo


@triton.jit
def _row_step(acc, xr, xo, xm, w0, w1, w2, w3, NPLANE: tl.constexpr, PSTEP: tl.constexpr, LATE_REDUCE: tl.constexpr):
    """One row's K step: t = w0 x0 + w1 x1 + ... elementwise in plane order, tl.sum over S; then
    acc [BN, G] += that (LATE_REDUCE: the G lanes are summed once, at the end), or
    acc [BN] += its tl.sum over G."""
    x = tl.load(xr + xo, mask=xm, other=0.0).to(tl.float32)[None, :, :]
    t = w0 * x
    if NPLANE > 1:
        t = t + w1 * tl.load(xr + xo + PSTEP, mask=xm, other=0.0).to(tl.float32)[None, :, :]
    if NPLANE > 2:
        t = t + w2 * tl.load(xr + xo + 2 * PSTEP, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        t = t + w3 * tl.load(xr + xo + 3 * PSTEP, mask=xm, other=0.0).to(tl.float32)[None, :, :]
    if LATE_REDUCE:
        out = acc + tl.sum(t, axis=2)
    else:
        out = acc + tl.sum(tl.sum(t, axis=2), axis=1)
    return out


@triton.jit
def _row(acc, r: tl.constexpr, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3,
         NPLANE: tl.constexpr, PSTEP: tl.constexpr, LATE_REDUCE: tl.constexpr):
    """Row m0 + r of the tile, skipped by a uniform branch if it is past M. (A branch-free form
    that computed absent rows on zero x ran 3% faster on some shapes but, in one of nine
    configurations, gave rows that were not bitwise invariant on an H200: not used.)"""
    if m0 + r < M:
        acc = _row_step(acc, xr + r * stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
    return acc


@triton.jit
def _row_store(yr, acc, n, N, row, M, LATE_REDUCE: tl.constexpr):
    if LATE_REDUCE:
        acc = tl.sum(acc, axis=1)
    tl.store(yr, acc, mask=(n < N) & (row + 0 * n < M))  # (tensor masks for the interpreter)


@triton.jit
def _packed_program(pid, pid_k, M, N, K, k_split, qs_ptr, qh_ptr, sc_ptr, d_ptr, qs_row, qh_row, sc_row, d_row,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A packed-weight program's place: (row tile, its BLOCK_N outputs and their mask, its K
    slice [k_begin, k_end), the row pointers [BN, 1, 1] of each plane) for the program
    (pid, pid_k) of the launch grid. Row tiles of one N tile are consecutive programs (L2 reuse
    of the weight tile)."""
    num_m_tiles = tl.cdiv(M, ROWS)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    k_begin = pid_k * k_split
    k_end = tl.minimum(K, k_begin + k_split)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = n.to(tl.int64)[:, None, None]
    return (pid_m, n, n < N, k_begin, k_end, qs_ptr + n64 * qs_row, qh_ptr + n64 * qh_row,
            sc_ptr + n64 * sc_row, d_ptr + n64 * d_row)


@triton.jit(do_not_specialize=["M"])
def _qgemv_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o, count_ptr,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    M_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    LATE_REDUCE: tl.constexpr, GLU: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr,
):
    qgemv_item(tl.program_id(0), tl.program_id(1),
               x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
               M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o,
               count_ptr, QTYPE, GW, S, NPLANE, PSTEP, M_TILE, BLOCK_N, BLOCK_K, NUM_STAGES, LATE_REDUCE, GLU, NSPLIT,
               PDL)


@triton.jit
def qgemv_item(
    pid, pid_k,
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr,
    M, N, K, k_split, stride_xm, stride_ym, stride_ys, qs_row, qh_row, sc_row, d_row, o_ptr, stride_o, count_ptr,
    QTYPE: tl.constexpr, GW: tl.constexpr, S: tl.constexpr, NPLANE: tl.constexpr, PSTEP: tl.constexpr,
    M_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    LATE_REDUCE: tl.constexpr, GLU: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (pid, pid_k) of ``_qgemv_kernel``'s grid: the kernel's body (the pair kernel's GEMV
    programs too)."""
    G: tl.constexpr = BLOCK_K // GW
    pid_m, n, nmask, k_begin, k_end, qs_rows, qh_rows, sc_rows, d_rows = _packed_program(
        pid, pid_k, M, N, K, k_split, qs_ptr, qh_ptr, sc_ptr, d_ptr, qs_row, qh_row, sc_row, d_row, M_TILE, BLOCK_N)
    m0 = pid_m * M_TILE
    g = tl.arange(0, G)
    s = tl.arange(0, S)
    s3 = s[None, None, :]
    if LATE_REDUCE:
        acc0 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    xr = x_ptr + m0 * stride_xm
    # the first step's weights are fetched and decoded BEFORE waiting for the kernel that writes
    # x (pdl.enter): no step writes weights, and with PDL this overlaps the producer's work
    w0, w1, w2, w3 = _step_planes(k_begin, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows, GW, QTYPE)
    enter(PDL)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        gg = k0 // GW + g  # global group index
        gval = k0 + g * GW < k_end
        xo = _x_offsets(gg, s, QTYPE, GW)
        xm = gval[:, None]
        # rows: the same code for each; a row past M is skipped (a uniform branch)
        acc0 = _row_step(acc0, xr, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
        if M_TILE > 1:
            acc1 = _row(acc1, 1, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
        if M_TILE > 2:
            acc2 = _row(acc2, 2, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
            acc3 = _row(acc3, 3, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
        if M_TILE > 4:
            acc4 = _row(acc4, 4, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
            acc5 = _row(acc5, 5, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
            acc6 = _row(acc6, 6, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
            acc7 = _row(acc7, 7, m0, M, xr, stride_xm, xo, xm, w0, w1, w2, w3, NPLANE, PSTEP, LATE_REDUCE)
        if k0 + BLOCK_K < k_end:  # the next step's weights
            w0, w1, w2, w3 = _step_planes(k0 + BLOCK_K, k_end, g, s3, nmask, qs_rows, qh_rows, sc_rows, d_rows,
                                          GW, QTYPE)
    yr = y_ptr + pid_k * stride_ys + m0 * stride_ym + n
    _row_store(yr, acc0, n, N, m0, M, LATE_REDUCE)
    if M_TILE > 1:
        _row_store(yr + stride_ym, acc1, n, N, m0 + 1, M, LATE_REDUCE)
    if M_TILE > 2:
        _row_store(yr + 2 * stride_ym, acc2, n, N, m0 + 2, M, LATE_REDUCE)
        _row_store(yr + 3 * stride_ym, acc3, n, N, m0 + 3, M, LATE_REDUCE)
    if M_TILE > 4:
        _row_store(yr + 4 * stride_ym, acc4, n, N, m0 + 4, M, LATE_REDUCE)
        _row_store(yr + 5 * stride_ym, acc5, n, N, m0 + 5, M, LATE_REDUCE)
        _row_store(yr + 6 * stride_ym, acc6, n, N, m0 + 6, M, LATE_REDUCE)
        _row_store(yr + 7 * stride_ym, acc7, n, N, m0 + 7, M, LATE_REDUCE)
    if GLU > 0:  # a fused [gate | up] weight: the pair's last program writes act(gate) * up
        pairs = (N // 2) // BLOCK_N
        pid_n = pid // tl.cdiv(M, M_TILE)
        m = m0 + tl.arange(0, M_TILE)
        glu_pair_epilogue(y_ptr, stride_ys, stride_ym, o_ptr, stride_o, count_ptr, pid_m * pairs + pid_n % pairs,
                          n, nmask, m, m < M, N // 2, NSPLIT, GLU - 1)


@dataclass(frozen=True)
class GluEpilogue:
    """Fold the GLU into a fused [gate | up] product (``step_fused.glu_pair_epilogue``): besides
    its partials the product writes act(gate) * up into ``out`` [M, N / 2]. ``counters``: int32
    zeros (each launch leaves them zero), at least ``glu_counters(...)`` of them."""

    out: torch.Tensor
    counters: torch.Tensor
    act: str = "gelu_tanh"

    @property
    def code(self) -> int:
        return 1 + GLU_ACTS.index(self.act)


GLU_ACTS = ("gelu_tanh", "silu")


def glu_counters(M: int, N: int, block_n: int, m_tile: int) -> int | None:
    """Counters a GLU-fused launch needs, or None where the fold does not apply (the gate/up
    boundary must fall between two N tiles)."""
    if N % 2 or (N // 2) % block_n:
        return None
    return triton.cdiv(M, m_tile) * ((N // 2) // block_n)


def glu_args(glu: GluEpilogue | None, y: torch.Tensor, splits: int, block_n: int, M: int, m_tile: int, N: int) -> tuple:
    """(o_ptr, stride_o, count_ptr) for a product launch, checked; dummies without ``glu``."""
    if glu is None:
        return (y, 0, y)
    need = glu_counters(M, N, block_n, m_tile)
    if glu.act not in GLU_ACTS:
        raise ValueError(f"act={glu.act!r} is not allowed: allowed {', '.join(GLU_ACTS)}")
    if need is None or glu.counters.dtype != torch.int32 or glu.counters.numel() < need:
        raise ValueError(f"the GLU fold needs N/2 a multiple of {block_n} and {need} int32 counters")
    if glu.out.shape != (M, N // 2) or glu.out.stride(1) != 1:
        raise ValueError(f"glu out must be [{M}, {N // 2}] with unit stride")
    return (glu.out, glu.out.stride(0), glu.counters)


def packed_launch_args(x: torch.Tensor, w: PackedWeight, y: torch.Tensor, splits: int, stride_ys: int) -> tuple:
    """The leading arguments every packed-weight product kernel takes (``_packed_program``'s):
    x, the planes, y, M, N, K, the K slice, the strides; absent planes stand in as qs, stride 0."""
    qh = w.qh if w.qh is not None else w.qs
    sc = w.sc if w.sc is not None else w.qs
    if splits > 1 and triton.cdiv(w.K, w.slice_k) != splits:
        raise ValueError(f"{splits} K slices of {w.K} weights; this weight's slices are {w.slice_k} weights")
    return (x, w.qs, qh, sc, w.d, y, x.shape[0], w.N, w.K, w.slice_k if splits > 1 else w.K,
            x.stride(0), y.stride(-2), stride_ys,
            w.qs.stride(0), qh.stride(0) if w.qh is not None else 0, sc.stride(0) if w.sc is not None else 0,
            w.d.stride(0))


def packed_geometry(w: PackedWeight) -> dict:
    """The format constexprs of a packed-weight product kernel (how its planes are laid out)."""
    gw, s, nplane, pstep = _GEMV_GEOMETRY[w.fmt.name]
    return {"QTYPE": w.fmt.code, "GW": gw, "S": s, "NPLANE": nplane, "PSTEP": pstep}


def launch_qgemv(x: torch.Tensor, w: PackedWeight, y: torch.Tensor, splits: int, stride_ys: int,
                 config: GemvConfig | None = None, glu: GluEpilogue | None = None) -> None:
    """Launch ``_qgemv_kernel``: y[s, m, n] (s < splits, at stride_ys; y's row stride is
    y.stride(-2)) = the K slice s of x[m] @ W[n]^T; with ``glu`` also act(gate) * up into glu.out.
    No checks: callers check (qmatmul, the runner)."""
    cfg = config or gemv_config(w.fmt.name, w.N, w.K, x.device, w.slice_k)
    gw = _GEMV_GEOMETRY[w.fmt.name][0]
    if cfg.m_tile not in (1, 2, 4, 8) or not steps_fit(w, splits, cfg.block_k) or cfg.block_k % gw or cfg.block_k // gw & (cfg.block_k // gw - 1):
        raise ValueError(f"bad qgemv config {cfg} for {w.fmt.name}")
    M = x.shape[0]
    grid = (triton.cdiv(M, cfg.m_tile) * triton.cdiv(w.N, cfg.block_n), splits)
    _qgemv_kernel[grid](
        *packed_launch_args(x, w, y, splits, stride_ys), *glu_args(glu, y, splits, cfg.block_n, M, cfg.m_tile, w.N),
        **packed_geometry(w), M_TILE=cfg.m_tile, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, LATE_REDUCE=cfg.late_reduce,
        GLU=glu.code if glu else 0, NSPLIT=splits, num_warps=cfg.num_warps, **launch_kw(x),
    )


def qmatmul(
    x: torch.Tensor,
    w: torch.Tensor | PackedWeight,
    qtype: GGMLQuantizationType | int | str | None = None,
    N: int | None = None,
    K: int | None = None,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """float32 [M, N] = x[M, K] @ W^T.

    ``w``: a ``PackedWeight`` (the packed path; qtype, N, K may be omitted, and must match if
    given) or the uint8 [N, row_bytes] GGUF bytes (the raw path; qtype, N, K required). The path
    follows ``w``'s type, never M (module docstring). x: float32 or bfloat16 [M, K], unit stride
    along K. Batch-invariant: row i of the result is bitwise equal to ``qmatmul(x[i:i+1], ...)``.
    ``use_dot`` (raw path only) picks the tile product (default: tl.dot on a GPU, the tl.sum form
    on the CPU interpreter); ``config`` (packed path only) overrides QGEMV_CONFIGS, for tuning.
    """
    packed = isinstance(w, PackedWeight)
    if packed:
        fmt = w.fmt
        if qtype is not None and quant_format(qtype) != fmt:
            raise ValueError(f"qtype {qtype!r} does not match the packed weight's {fmt.name}")
        if (N is not None and N != w.N) or (K is not None and K != w.K):
            raise ValueError(f"N, K = {N}, {K} do not match the packed weight's {w.N}, {w.K}")
        N, K = w.N, w.K
    else:
        if qtype is None or N is None or K is None:
            raise ValueError("raw GGUF bytes need qtype, N and K")
        fmt = quant_format(qtype)
        check_quant_rows(w, fmt, N, K)
    out = check_x_out(x, N, K, w.device, out)
    M = x.shape[0]
    if M == 0:
        return out
    ks = w.slice_k if packed else k_slice(N, K, (fmt.name,))
    splits = triton.cdiv(K, ks)
    part = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    if packed:
        launch_qgemv(x, w, part, splits, part.stride(0) if splits > 1 else 0, config)
    else:
        cfg = QMATMUL_CONFIGS[fmt.name]
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), splits)
        _qmatmul_kernel[grid](
            x, w, part, M, N, K, ks if splits > 1 else K,
            x.stride(0), part.stride(-2), part.stride(0) if splits > 1 else 0, w.stride(0),
            QTYPE=fmt.code, SUB=fmt.sub, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            INPUT_PRECISION=QMATMUL_INPUT_PRECISION, USE_DOT=x.is_cuda if use_dot is None else use_dot,
            num_warps=cfg.num_warps, **launch_kw(x),
        )
    if splits > 1:
        sum_splits(part, out)
    return out


def check_x_out(x: torch.Tensor, N: int, K: int, wdev: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """Check x ([M, K] float32/bfloat16, unit stride along K, on the weight's device) for a
    product with an N x K weight; return ``out`` (float32 [M, N]; allocated when None)."""
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along K")
    if x.device != wdev:
        raise ValueError(f"x on {x.device} but the weight on {wdev}")
    M = x.shape[0]
    if out is None:
        return torch.empty((M, N), dtype=torch.float32, device=x.device)
    if out.shape != (M, N) or out.dtype != torch.float32 or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out must be float32 [{M}, {N}] with unit stride on {x.device}")
    return out


def sum_splits(part: torch.Tensor, out: torch.Tensor) -> None:
    """out[m, n] = ((part[0] + part[1]) + ...)[m, n], the K slices added in slice order."""
    S, M, N = part.shape
    _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](part, out, M, N, S, out.stride(0), BLOCK=1024, num_warps=4, **launch_kw(out))


def qmatmul_ref(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType | int | str, N: int, K: int) -> torch.Tensor:
    """Reference: x.float() @ W^T with W decoded by gguf.quants.dequantize (from the raw bytes)."""
    w = dequant_ref(raw, qtype, K)
    if w.shape != (N, K):
        raise ValueError(f"raw decodes to {tuple(w.shape)}, expected [{N}, {K}]")
    return x.float() @ w.T
