"""Row-invariant dense products for the torch (CPU) path.

A row of `x @ W.T` must come out bit-identical whatever other rows share the call: that is
what lets N slots decode together while each produces exactly its solo result, and lets a
prompt be prefilled in chunks of any size with identical results.

BLAS does not promise that. Measured on this machine (torch 2.13, x86-64 with AVX-512):

- float32 (MKL sgemm): a 1-row call takes a GEMV path and an M>=4 call a GEMM path whose
  per-element summation order differs, so results differ in the last bits. A call of a *fixed*
  row count gives each row the same bits whatever its position and neighbours. The float32
  policy therefore pads every product to tiles of exactly `ROW_TILE[float32]` rows.
- bfloat16 (oneDNN, fp32 accumulation): identical per-row results for every M >= 2 (checked
  from 2 to 600 rows); a 1-row call may take another kernel, so calls are padded to 2 rows.

`tests/test_linear.py` asserts both policies bitwise (the `f(a[:1]) == f(a)[:1]` metamorphic
test) on the real model's shapes, so a BLAS whose behaviour differs fails loudly rather than
silently breaking exactness.
"""

from __future__ import annotations

import torch

# Launch configuration as data: rows per product tile (None = one call) and the fewest rows.
ROW_TILE = {torch.float32: 8, torch.bfloat16: None}
MIN_ROWS = {torch.float32: 8, torch.bfloat16: 2}


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T in w's dtype policy, returned as float32. x: [M, K] float32, w: [N, K]."""
    dtype = w.dtype
    m = x.shape[0]
    xs = x.to(dtype)
    tile = ROW_TILE[dtype]
    min_rows = MIN_ROWS[dtype]
    if tile is None:
        if m >= min_rows:
            return (xs @ w.T).float()
        pad = xs.new_zeros(min_rows, xs.shape[1])
        pad[:m] = xs
        return (pad @ w.T)[:m].float()
    n_tiles = -(-m // tile)
    if n_tiles * tile != m:
        padded = xs.new_zeros(n_tiles * tile, xs.shape[1])
        padded[:m] = xs
        xs = padded
    out = torch.empty(n_tiles * tile, w.shape[0], dtype=dtype)
    wt = w.T
    for t in range(n_tiles):
        torch.mm(xs[t * tile : (t + 1) * tile], wt, out=out[t * tile : (t + 1) * tile])
    return out[:m].float()
