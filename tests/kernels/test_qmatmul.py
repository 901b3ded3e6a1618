import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from workbench.kernels import qmatmul as qmatmul_mod
from workbench.kernels.qmatmul import QMATMUL_CONFIGS, GemvConfig, pack_weights, qmatmul, qmatmul_ref
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


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["Q8_0", "Q5_0"])
def test_gguf_quantizer_bytes_and_strided_x(name, packed, device):
    """Bytes from gguf's own quantizer decode as gguf decodes them, raw or packed; x may be a
    column slice."""
    N, K = 40, 96
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=gen)
    raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[name])).to(device)
    torch.testing.assert_close(dequant_ref(raw, name, K).cpu(), w, rtol=0, atol=0.25)  # quantization error
    x = torch.randn(3, K + 8, generator=gen).to(device)[:, 4 : 4 + K]
    y = qmatmul(x, pack_weights(raw, name, N, K)) if packed else qmatmul(x, raw, name, N, K)
    assert_close_dot(y, x, raw, name, N, K)


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


# ---- packed path (pack_weights + _qgemv_kernel: the decode-shaped FMA kernel) ----------------

# Odd N (partial N tiles); Q8_0/Q5_0 K = 320: two K slices (256 + 64), the second a partial
# BLOCK_K step; Q4_K/Q6_K K = 512: two slices of one super-block each.
PACKED_SHAPES = {"Q8_0": (37, 320), "Q5_0": (37, 320), "Q4_K": (37, 512), "Q6_K": (37, 512)}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 5, 16, 17])
def test_packed_matches_reference(name, m, device, quant_rows):
    N, K = PACKED_SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=10 + m, device=device)
    pw = pack_weights(raw, name, N, K)
    x = _x(m, K, torch.bfloat16 if m == 3 else torch.float32, device, seed=m)
    out = torch.full((m, N), float("nan"), device=device)  # every element must be written
    y = qmatmul(x, pw, out=out)
    assert y is out
    assert_close_dot(y, x, raw, name, N, K)


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K"])
def test_packed_unsplit_weight(name, device, quant_rows, monkeypatch):
    """Wide weights (the head) are not split along K: one pass, QGEMV_WIDE_CONFIGS."""
    monkeypatch.setattr(qmatmul_mod, "QMATMUL_SPLIT_MAX_N", 0)
    N, K = PACKED_SHAPES[name]
    assert qmatmul_mod.num_k_splits(N, K) == 1
    raw = quant_rows(FORMATS[name], N, K, seed=5, device=device)
    pw = pack_weights(raw, name, N, K)
    x = _x(9, K, torch.float32, device, seed=5)
    y = qmatmul(x, pw, out=torch.full((9, N), float("nan"), device=device))
    assert_close_dot(y, x, raw, name, N, K)
    for i in (0, 8):
        assert torch.equal(y[i : i + 1], qmatmul(x[i : i + 1].clone(), pw)), f"row {i}"


@pytest.mark.parametrize("name", list(FORMATS))
def test_packed_rows_are_batch_invariant(name, device, quant_rows):
    """Metamorphic: row i of an M-row call is bitwise the 1-row call, at any position and in any
    row tile (M = 17: tiles of M_TILE rows, the last one partial), and reordering rows reorders
    the result exactly."""
    N, K = PACKED_SHAPES[name]
    M = 17
    raw = quant_rows(FORMATS[name], N, K, seed=7, device=device)
    pw = pack_weights(raw, name, N, K)
    x = _x(M, K, torch.float32, device, seed=7)
    y = qmatmul(x, pw)
    assert torch.isfinite(y).all()
    for i in (0, 3, 7, 8, M - 1):
        assert torch.equal(y[i : i + 1], qmatmul(x[i : i + 1].clone(), pw)), f"row {i}"
    assert torch.equal(y[2:7], qmatmul(x[2:7], pw))
    assert torch.equal(y.flip(0), qmatmul(x.flip(0).contiguous(), pw))


@pytest.mark.parametrize("name", list(FORMATS))
def test_packed_decodes_gguf_weights_exactly(name, device, quant_rows):
    """x = I: every output is one decoded weight times 1 plus zeros, so it must equal the
    gguf.quants weight bitwise (pack_weights + the decoders lose nothing). On a GPU, Q4_K's
    (d * sc) * q - dmin * m may be contracted into one FMA: there, within half an ulp of the
    product."""
    N, K = 5, FORMATS[name].block_size * (2 if FORMATS[name].block_size == 32 else 1)
    raw = quant_rows(FORMATS[name], N, K, seed=3, device=device)
    eye = torch.eye(K, device=device)
    y, ref = qmatmul(eye, pack_weights(raw, name, N, K)), dequant_ref(raw, name, K).T
    if device.type == "cuda" and name == "Q4_K":
        assert (y - ref).abs().max() <= 2.0**-21 * ref.abs().max()
    else:
        assert torch.equal(y, ref)


def test_packed_bytes_and_bad_inputs(device, quant_rows):
    for name, (N, K) in PACKED_SHAPES.items():
        raw = quant_rows(FORMATS[name], N, K, seed=0, device=device)
        pw = pack_weights(raw, name, N, K)
        extra = N * K // 16 - N * K // 256 * 12 if name == "Q4_K" else 0  # 6-bit scales as bytes
        assert pw.nbytes == raw.numel() + extra, name
    raw = quant_rows(FORMATS["Q8_0"], 8, 64, seed=0, device=device)
    pw = pack_weights(raw, "Q8_0", 8, 64)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="does not match"):
        qmatmul(x, pw, "Q5_0")
    with pytest.raises(ValueError, match="do not match"):
        qmatmul(x, pw, N=9)
    with pytest.raises(ValueError, match="x must be"):
        qmatmul(x[:, :32], pw)
    with pytest.raises(ValueError, match="need qtype"):
        qmatmul(x, raw)
    with pytest.raises(ValueError, match=r"\[8, 68\]"):
        pack_weights(raw[:, :60].contiguous(), "Q8_0", 8, 64)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("variant", [
    {"late_reduce": False},
    {"late_reduce": True, "m_tile": 8, "block_k": 256},
    {"late_reduce": False, "m_tile": 2, "num_stages": 2},
])
def test_packed_config_variants(name, variant, device, quant_rows):
    """Other configurations than QGEMV_CONFIGS' (reduction mode, rows per program, K step,
    pipelining): reference agreement and bitwise rows."""
    cfg = GemvConfig(**{"block_n": 16, "block_k": 128, "m_tile": 4, "num_warps": 4, **variant})
    N, K = PACKED_SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=11, device=device)
    pw = pack_weights(raw, name, N, K, k_split=256)  # (slices of 256: steps of 128 or 256)
    x = _x(7, K, torch.float32, device, seed=11)
    y = qmatmul(x, pw, out=torch.full((7, N), float("nan"), device=device), config=cfg)
    assert_close_dot(y, x, raw, name, N, K)
    for i in (0, 6):
        assert torch.equal(y[i : i + 1], qmatmul(x[i : i + 1].clone(), pw, config=cfg)), f"row {i}"


def test_k_slices_follow_the_product(monkeypatch):
    """k_slice: narrow products (N <= QMATMUL_NARROW_N) in slices of QMATMUL_NARROW_SPLIT_K, wider
    ones of QMATMUL_SPLIT_K, the head (N > QMATMUL_SPLIT_MAX_N) unsplit, never more than K;
    per-format slices cap a product by its members' formats. Gemma 3 270M's shapes."""
    from workbench.kernels.qmatmul import k_slice, num_k_splits

    assert (k_slice(640, 1024), k_slice(640, 2048)) == (128, 128)  # attention output, FFN down
    assert (k_slice(1536, 640), k_slice(4096, 640)) == (128, 256)  # q|k|v, gate|up
    assert k_slice(262144, 640) == 640 and num_k_splits(262144, 640) == 1  # the head
    assert k_slice(640, 96) == 96 and num_k_splits(640, 96) == 1
    assert (num_k_splits(640, 2048), num_k_splits(1536, 640), num_k_splits(4096, 640)) == (16, 5, 3)
    monkeypatch.setattr(qmatmul_mod, "QMATMUL_FORMAT_SPLIT_K", {"Q5_0": 64})
    assert k_slice(4096, 640, ("Q5_0", "Q8_0")) == 64 and k_slice(4096, 640, ("Q8_0",)) == 256
