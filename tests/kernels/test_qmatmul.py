import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from workbench.kernels.qmatmul import QMATMUL_CONFIGS, qmatmul, qmatmul_ref
from workbench.kernels.quant_tiles import FORMATS, dequant_ref

# K with a partial last K tile for the 32-blocks (5 blocks, tiles of 4); two super-blocks else.
SHAPES = {"Q8_0": (70, 160), "Q5_0": (70, 160), "Q4_K": (70, 512), "Q6_K": (70, 512)}


def assert_close_dot(y, x, raw, name, N, K):
    """|y - ref| <= K * 2^-23 * (|x| @ |W|^T): two fp32 dot products of K terms summed in
    different orders (x bf16 is upcast exactly, so the bound is the same for both dtypes)."""
    w = dequant_ref(raw, name, K)
    bound = K * 2.0**-23 * (x.float().abs() @ w.abs().T) + 1e-30
    err = (y - qmatmul_ref(x, raw, name, N, K)).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


def _x(m, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_qmatmul_matches_reference(name, dtype, m, device, quant_rows):
    N, K = SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=m, device=device)
    x = _x(m, K, dtype, device, seed=m)
    out = torch.full((m, N), float("nan"), device=device)
    y = qmatmul(x, raw, name, N, K, out=out)
    assert y is out
    assert_close_dot(y, x, raw, name, N, K)


@pytest.mark.parametrize("name", list(FORMATS))
def test_qmatmul_rows_are_batch_invariant(name, device, quant_rows):
    """Row i of an M-row call is bitwise the solo call, also across row tiles (M > BLOCK_M)."""
    N, K = SHAPES[name]
    M = QMATMUL_CONFIGS[name].block_m + 3
    raw = quant_rows(FORMATS[name], N, K, seed=7, device=device)
    x = _x(M, K, torch.float32, device, seed=7)
    y = qmatmul(x, raw, name, N, K)
    assert torch.isfinite(y).all()
    for i in (0, 4, M - 3, M - 1):
        assert torch.equal(y[i : i + 1], qmatmul(x[i : i + 1].clone(), raw, name, N, K)), f"row {i}"
    assert torch.equal(y[2:7], qmatmul(x[2:7], raw, name, N, K))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_qmatmul_dot_form_matches_reference(name, device, quant_rows):
    """The tl.dot form (the GPU default) is checked for accuracy here too; its batch invariance
    is asserted by the tests above when they run on a GPU."""
    N, K = SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=4, device=device)
    x = _x(3, K, torch.float32, device, seed=4)
    assert_close_dot(qmatmul(x, raw, name, N, K, use_dot=True), x, raw, name, N, K)


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0"])
def test_qmatmul_gguf_quantizer_bytes_and_strided_x(name, device):
    """Bytes from gguf's own quantizer decode as gguf decodes them; x may be a column slice."""
    N, K = 40, 96
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=gen)
    raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[name])).to(device)
    torch.testing.assert_close(dequant_ref(raw, name, K).cpu(), w, rtol=0, atol=0.25)  # quantization error
    x = torch.randn(3, K + 8, generator=gen).to(device)[:, 4 : 4 + K]
    assert_close_dot(qmatmul(x, raw, name, N, K), x, raw, name, N, K)


def test_qmatmul_rejects_bad_inputs(device, quant_rows):
    raw = quant_rows(FORMATS["Q8_0"], 8, 64, seed=0, device=device)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="Q4_K"):
        qmatmul(x, raw, "Q2_K", 8, 64)
    with pytest.raises(ValueError, match=r"\[8, 68\]"):
        qmatmul(x, raw[:, :60].contiguous(), "Q8_0", 8, 64)
    with pytest.raises(ValueError, match="x must be"):
        qmatmul(x[:, :32], raw, "Q8_0", 8, 64)
    with pytest.raises(TypeError):
        qmatmul(x.half(), raw, "Q8_0", 8, 64)
