"""kernels/dense_mma.py: the dense tensor-core product (the head's form on dequantized weights)
against a float64 reference, rows bitwise invariant, bad inputs refused."""

import pytest
import torch
import triton
import triton.language as tl
from workbench.kernels.dense_mma import OPERAND_DTYPES, DenseConfig, dense_mma, dense_mma_ref
from workbench.kernels.sampling import best_of, running_best



@pytest.mark.parametrize("prec", ["bf16", "tf32x3"])
def test_dense_mma_matches_reference_and_rows_are_invariant(prec, device):
    gen = torch.Generator().manual_seed(3)
    N, K = 200, 160  # a partial N tile and a partial K step
    w = (0.05 * torch.randn(N, K, generator=gen)).to(OPERAND_DTYPES[prec]).to(device)
    x = torch.randn(18, K, generator=gen).to(device)  # two 16-row tiles
    y = dense_mma(x, w, prec)
    torch.testing.assert_close(y.double(), dense_mma_ref(x, w, prec), rtol=1e-5, atol=1e-5)
    for i in (0, 7, 17):
        assert torch.equal(dense_mma(x[i : i + 1].clone(), w, prec), y[i : i + 1])
    wide = DenseConfig(block_n=128, block_k=64, num_stages=1, block_m=32)  # one 32-row tile for all 18 rows
    y32 = dense_mma(x, w, prec, config=wide)
    torch.testing.assert_close(y32.double(), dense_mma_ref(x, w, prec), rtol=1e-5, atol=1e-5)
    for i in (0, 17):
        assert torch.equal(dense_mma(x[i : i + 1].clone(), w, prec, config=wide), y32[i : i + 1])


def test_dense_mma_rejects_bad_inputs(device):
    w = torch.zeros(8, 32, dtype=torch.bfloat16, device=device)
    x = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="prec="):
        dense_mma(x, w, "fp8")
    with pytest.raises(ValueError, match="w must be"):
        dense_mma(x, w.float(), "bf16")
    with pytest.raises(ValueError, match="x must be"):
        dense_mma(torch.zeros(2, 31, device=device), w)
    with pytest.raises(ValueError, match="block_m"):
        dense_mma(x, w, config=DenseConfig(block_m=8))
    with pytest.raises(ValueError, match="out must be"):
        dense_mma(x, w, out=torch.zeros(2, 7, device=device))
    assert dense_mma(x[:0], w).shape == (0, 8)


def test_quantize_rows_q8_matches_reference(device):
    """quantize_rows_q8: per block of 32, d = amax / 127 and q = rint(x * 127 / amax): bitwise the
    torch reference under the interpreter (on a GPU the product may fuse into the rounding's
    addition, so a quant may differ by one step where x * 127 / amax is within an ulp of a half;
    d bitwise); zero blocks give q = 0, d = 0; each row's blocks alone; bad shapes refused."""
    from workbench.kernels.dense_mma import quantize_rows_q8, quantize_rows_q8_ref

    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(5, 96, generator=gen) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(32)).to(device)
    x[2, 32:64] = 0.0
    q, d = quantize_rows_q8(x)
    qr, dr = quantize_rows_q8_ref(x)
    assert torch.equal(d, dr)
    if device.type == "cpu":
        assert torch.equal(q, qr)
    else:
        assert (q.int() - qr.int()).abs().max() <= 1
    assert q[2, 32:64].abs().sum() == 0 and d[2, 1] == 0 and int(q.abs().max()) == 127
    deq = (q.float().reshape(5, 3, 32) * d[..., None]).reshape(5, 96)
    assert ((deq - x).abs() <= d.repeat_interleave(32, dim=1) / 2 + 1e-6).all()  # within half a step
    q1, d1 = quantize_rows_q8(x[3:4].clone())
    assert torch.equal(q1, q[3:4]) and torch.equal(d1, d[3:4])
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows_q8(torch.zeros(2, 40, device=device))


def test_q8i8_mma_integer_blocks(device, quant_rows):
    """q8i8_mma: the Q8_0 quants of W and of x in one exact integer product per 32-weight block,
    a K step's four blocks in one batched dot, each scaled by d_w * d_x and added in block order:
    bitwise the torch reference (which takes the blocks one at a time, the serial form's
    arithmetic) under the interpreter and close to it on a GPU (the scaling may fuse into FMAs
    there); close to the float product of the dequantized weight (x's int8 steps being the only
    rounding of note); rows bitwise invariant, in the tiled and the streaming form (which also
    keeps the argmax), with the default tiles that follow M; bad inputs refused."""
    from workbench.kernels.dense_mma import best_partials, i8_config, q8i8_mma, q8i8_mma_ref, quantize_rows_q8
    from workbench.kernels.qmatmul import pack_weights
    from workbench.kernels.quant_tiles import FORMATS, dequant_ref
    from workbench.kernels.sampling import argmax_from_partials

    fmt = FORMATS["Q8_0"]
    N, K = 200, 160  # a partial N tile and a partial second K step (128 + 32)
    raw = quant_rows(fmt, N, K, 5, "cpu")
    pw = pack_weights(raw.to(device), "Q8_0", N, K)
    wf = dequant_ref(raw, "Q8_0", K).reshape(N, K).to(device)
    x = torch.randn(18, K, generator=torch.Generator().manual_seed(6)).to(device)
    xq, xd = quantize_rows_q8(x)
    ref = q8i8_mma_ref(xq, xd, pw.qs, pw.d)
    exact = (x.double() @ wf.double().T)
    for cfg in (DenseConfig(block_n=64, block_k=128, num_stages=2, block_m=32),
                DenseConfig(block_n=64, block_k=128, num_stages=2, block_m=16, programs_per_sm=1), None):
        y = q8i8_mma(xq, xd, pw, config=cfg)
        if device.type == "cpu":
            assert torch.equal(y, ref)
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-5)
        assert (y.double() - exact).abs().max() < 0.02 * exact.abs().max()
        for i in (0, 9, 17):
            assert torch.equal(q8i8_mma(xq[i : i + 1].clone(), xd[i : i + 1].clone(), pw, config=cfg), y[i : i + 1])
    # the default tiles follow M (i8_config: 16-row tiles up to 16 rows, 32-row above): an exact
    # integer dot, then elementwise float32 operations, so a row's bits do not follow the tile
    assert i8_config(device, 1).block_m == 16 and i8_config(device, 18).block_m == 32
    with pytest.raises(ValueError, match="128-weight K steps"):
        q8i8_mma(xq, xd, pw, config=DenseConfig(block_k=64))
    stream = DenseConfig(block_n=64, block_k=128, num_stages=2, block_m=32, programs_per_sm=1)
    best = best_partials(5, N, device, stream)
    y5 = q8i8_mma(xq[:5], xd[:5], pw, config=stream, best=best)
    tok = torch.empty(5, dtype=torch.int64, device=device)
    argmax_from_partials(*best, out=tok)
    assert torch.equal(tok, y5.argmax(-1))
    with pytest.raises(ValueError, match="xq must be"):
        q8i8_mma(x, xd, pw)
    q5 = pack_weights(quant_rows(FORMATS["Q5_0"], 8, 64, 1, device), "Q5_0", 8, 64)
    with pytest.raises(ValueError, match="Q8_0 PackedWeight"):
        q8i8_mma(xq[:, :64], xd[:, :2], q5)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_streaming_head_keeps_the_argmax(rows, device, quant_rows):
    """best=: each streaming program's running (value, index) best per row, finished by
    ``sampling.argmax_from_partials``: torch.argmax of the logits (ties across tiles and
    programs to the lowest index, the first NaN, all -inf), the logits unchanged, for the dense
    head and the int8 head (whose running best is born in the tile store's layout)."""
    from workbench.kernels.dense_mma import best_partials, dense_config, i8_config, q8i8_mma, quantize_rows_q8
    from workbench.kernels.qmatmul import pack_weights
    from workbench.kernels.quant_tiles import FORMATS, dequant_ref
    from workbench.kernels.sampling import argmax_from_partials

    N, K = 1000, 64  # 8 tiles of 128 under the interpreter: 3 programs take 3, 3 and 2
    raw = quant_rows(FORMATS["Q8_0"], N, K, 7, "cpu")
    pw = pack_weights(raw.to(device), "Q8_0", N, K)
    w = dequant_ref(raw, "Q8_0", K).reshape(N, K).to(torch.bfloat16).to(device)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(9)).to(device)
    xq, xd = quantize_rows_q8(x)

    def int8(x_, w_, prec, out=None, config=None, best=None):
        return q8i8_mma(xq, xd, w_, out=out, config=config, best=best)

    for fn, wt, cfg in ((dense_mma, w, dense_config(device)), (int8, pw, i8_config(device, rows))):
        plain = fn(x, wt, "bf16", config=cfg)
        out = torch.empty_like(plain)
        best = best_partials(rows, N, device, cfg)
        y = fn(x, wt, "bf16", out=out, config=cfg, best=best)
        assert torch.equal(y, plain)
        tok = argmax_from_partials(*best, torch.empty(rows, dtype=torch.int64, device=device))
        assert torch.equal(tok, torch.argmax(y, dim=-1))
    with pytest.raises(ValueError, match="best= needs the streaming form"):
        dense_mma(x, w, "bf16", config=DenseConfig(block_n=128, programs_per_sm=0), best=best)
    assert best_partials(33, N, device, DenseConfig()) is None  # (two row tiles: the separate argmax)


@triton.jit
def _running_best_kernel(v_ptr, o_ptr, T, BN: tl.constexpr, BM: tl.constexpr):
    """Tiles t = 0..T-1 of [BN, BM] values (index t * BN + lane) through running_best, then best_of."""
    lane = tl.arange(0, BN)[:, None]
    col = tl.arange(0, BM)[None, :]
    bv = tl.full([BN, BM], float("-inf"), tl.float32)
    bi = tl.full([BN, BM], 2147483647, tl.int32)
    for t in range(T):
        vals = tl.load(v_ptr + (t * BN + lane) * BM + col)
        bv, bi = running_best(bv, bi, vals, (t * BN + lane + 0 * col).to(tl.int32), (lane + 0 * col) < BN)
    _, i = best_of(bv, bi, bi != 2147483647)
    tl.store(o_ptr + tl.arange(0, BM), i)


def test_running_best_follows_torch_argmax(device):
    """The streaming head's per-lane running best + column reduce: torch.argmax's rules (ties to
    the lowest index, also across lanes and tiles; the first NaN wins; all -inf: index 0)."""
    T, BN, BM = 3, 4, 8
    v = torch.randn(T * BN, BM, generator=torch.Generator().manual_seed(2))
    v[[1, 6, 11], 0] = 7.0  # a tie across lanes and tiles: index 1
    v[[9, 2], 1] = float("nan")  # NaNs: the first (2)
    v[5, 1] = float("inf")
    v[:, 2] = float("-inf")  # all -inf: 0
    v[:, 3] = 1.0  # all equal: 0
    v[10, 4] = float("inf")  # the last tile
    v[[4, 0], 5] = 9.0  # same lane, later tile first in index order: 0
    v = v.to(device)
    out = torch.empty(BM, dtype=torch.int32, device=device)
    _running_best_kernel[(1,)](v, out, T, BN=BN, BM=BM)
    assert out.tolist() == torch.argmax(v, dim=0).tolist()
