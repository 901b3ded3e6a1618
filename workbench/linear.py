"""Row-invariant dense products for the torch (CPU) path.

A row of `x @ W.T` must come out bit-identical whatever other rows share the call: that is
what lets N slots decode together while each produces exactly its solo result, and lets a
prompt be prefilled in chunks of any size with identical results.

BLAS does not promise that. Measured on this machine (torch 2.13, x86-64 with AVX-512):

- float32 (MKL sgemm): a 1-row call takes a GEMV path and an M>=4 call a GEMM path whose
  per-element summation order differs, so results differ in the last bits. A call of a *fixed*
  row count gives each row the same bits whatever its position and neighbours. The float32
  policy therefore pads every product to tiles of exactly `ROW_TILE[float32]` rows.
- bfloat16 (oneDNN, fp32 accumulation): identical per-row results for every M from 2 to 32;
  a 1-row call may take another kernel, so calls are padded to 2 rows. Above 32 rows it
  depends on the CPU: without AMX every M >= 2 agreed (checked from 2 to 600 rows), but on a
  Xeon with AMX-BF16 (session 16's machine) an M >= 33 call takes another kernel for some
  shapes (the 640 -> 262,144 head, 640 -> 32,768), whose rows differ in the last bits. The
  bfloat16 policy therefore calls in tiles of at most `ROW_TILE[bfloat16]` = 32 rows, the last
  one ragged (at least 2 rows), which is identical on both.

`tests/test_linear.py` asserts both policies bitwise (the `f(a[:1]) == f(a)[:1]` metamorphic
test) on the real model's shapes, so a BLAS whose behaviour differs fails loudly rather than
silently breaking exactness.
"""

from __future__ import annotations

import torch

# Launch configuration as data: rows per product tile and the fewest rows a call takes; float32
# pads every tile to exactly ROW_TILE rows, bfloat16 lets the last tile be shorter (>= MIN_ROWS).
ROW_TILE = {torch.float32: 8, torch.bfloat16: 32}
MIN_ROWS = {torch.float32: 8, torch.bfloat16: 2}
RAGGED = {torch.float32: False, torch.bfloat16: True}


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T in w's dtype policy, returned as float32. x: [M, K] float32, w: [N, K]."""
    dtype = w.dtype
    m = x.shape[0]
    xs = x.to(dtype)
    if xs.device.type != "cpu":
        # the row tiling is a CPU BLAS policy; off the CPU only the compression scorer
        # (compression.DeviceScorer) calls this, which promises no bits, so one product
        return (xs @ w.T).float()
    tile, min_rows = ROW_TILE[dtype], MIN_ROWS[dtype]
    if RAGGED[dtype] and m <= tile:
        if m >= min_rows:
            return (xs @ w.T).float()
        pad = xs.new_zeros(min_rows, xs.shape[1])
        pad[:m] = xs
        return (pad @ w.T)[:m].float()
    n_tiles = -(-m // tile)
    rows = m if RAGGED[dtype] and m % tile >= min_rows else n_tiles * tile
    if rows != m:
        padded = xs.new_zeros(rows, xs.shape[1])
        padded[:m] = xs
        xs = padded
    out = torch.empty(rows, w.shape[0], dtype=dtype)
    wt = w.T
    for t in range(n_tiles):
        torch.mm(xs[t * tile : min((t + 1) * tile, rows)], wt, out=out[t * tile : min((t + 1) * tile, rows)])
    return out[:m].float()
