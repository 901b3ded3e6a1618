"""kernels/dense_mma.py: the dense tensor-core product (the head's form on dequantized weights)
against a float64 reference, rows bitwise invariant, bad inputs refused."""

import pytest
import torch

from workbench.kernels.dense_mma import DenseConfig, dense_mma, dense_mma_ref


OPERAND = {"bf16": torch.bfloat16, "f16": torch.float16, "tf32x3": torch.float32}  # w's dtype per precision


@pytest.mark.parametrize("prec", ["bf16", "tf32x3", "f16"])
def test_dense_mma_matches_reference_and_rows_are_invariant(prec, device):
    gen = torch.Generator().manual_seed(3)
    N, K = 200, 160  # a partial N tile and a partial K step
    w = (0.05 * torch.randn(N, K, generator=gen)).to(OPERAND[prec]).to(device)
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


@pytest.mark.parametrize("prec", ["bf16", "tf32x3", "f16"])
def test_q8_dense_mma_reads_the_packed_planes(prec, device, quant_rows):
    """q8_dense_mma: the Q8_0 packed planes (int8 quants, f16 scales) with d * q formed per K
    step: the dequantized copy's operands at half its bytes ("f16": float16(d * q) formed in
    float16 arithmetic from q's bits, the float16 copy's values). Under the interpreter bitwise
    ``dense_mma`` on that copy (same operands, same order); anywhere close to the float64
    reference and rows bitwise invariant; non-Q8_0 weights refused."""
    from workbench.kernels.qmatmul import pack_weights
    from workbench.kernels.quant_tiles import FORMATS, dequant_ref

    from workbench.kernels.dense_mma import q8_dense_mma

    fmt = FORMATS["Q8_0"]
    N, K = 200, 160  # a partial N tile and a partial K step
    raw = quant_rows(fmt, N, K, 5, "cpu")
    pw = pack_weights(raw.to(device), "Q8_0", N, K)
    wf = dequant_ref(raw, "Q8_0", K).reshape(N, K)
    w = wf.to(OPERAND[prec]).to(device)
    x = torch.randn(18, K, generator=torch.Generator().manual_seed(6)).to(device)
    cfg = DenseConfig(block_n=64, block_k=64, num_stages=2, block_m=32)
    y = q8_dense_mma(x, pw, prec, config=cfg)
    torch.testing.assert_close(y.double(), dense_mma_ref(x, w, prec), rtol=1e-5, atol=1e-5)
    if device.type == "cpu":
        assert torch.equal(y, dense_mma(x, w, prec, config=cfg))
    for i in (0, 9, 17):
        assert torch.equal(q8_dense_mma(x[i : i + 1].clone(), pw, prec, config=cfg), y[i : i + 1])
    # the streaming form (a few programs walking every tile): the same tiles' arithmetic
    stream = DenseConfig(block_n=64, block_k=64, num_stages=2, block_m=16, programs_per_sm=1)
    ys = q8_dense_mma(x, pw, prec, config=stream)
    torch.testing.assert_close(ys.double(), dense_mma_ref(x, w, prec), rtol=1e-5, atol=1e-5)
    if device.type == "cpu":
        assert torch.equal(ys, q8_dense_mma(x, pw, prec, config=DenseConfig(block_n=64, block_k=64, block_m=16)))
    for i in (0, 17):
        assert torch.equal(q8_dense_mma(x[i : i + 1].clone(), pw, prec, config=stream), ys[i : i + 1])
        assert torch.equal(dense_mma(x[i : i + 1].clone(), w, prec, config=stream),
                           dense_mma(x, w, prec, config=stream)[i : i + 1])
    q5 = pack_weights(quant_rows(FORMATS["Q5_0"], 8, 64, 1, device), "Q5_0", 8, 64)
    with pytest.raises(ValueError, match="Q8_0 PackedWeight"):
        q8_dense_mma(x[:, :64], q5)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_dense_mma(x, pw, config=DenseConfig(block_k=16))
