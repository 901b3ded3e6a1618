"""kernels/qmma.py: the tensor-core product on packed GGUF weights (bf16 or tf32x3 operands)."""

import pytest
import torch

from workbench.kernels import qmatmul as qmatmul_mod
from workbench.kernels.qmatmul import pack_weights
from workbench.kernels.qmma import QMMA_BLOCK_M, MmaConfig, qmma
from workbench.kernels.quant_tiles import FORMATS, dequant_ref

# Odd N (partial N tiles); K with two K slices (the second partial for the 32-weight formats)
SHAPES = {"Q8_0": (37, 320), "Q5_0": (37, 320), "Q4_K": (37, 512), "Q6_K": (37, 512)}


def _x(m, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype).to(device)


def assert_close(y, x, raw, name, K, prec, device):
    """|y - ref| within a float32 summation bound, ref computed in float64 on the operands the
    kernel multiplies: bf16-rounded weights and x for "bf16" (their products are exact in
    float32, so only the order of the K additions differs); float32 for "tf32x3", whose three
    TF32 products on a GPU add a relative error of about 2^-21 per product."""
    w = dequant_ref(raw, name, K).to(device)
    xf = x.float()
    if prec == "bf16":
        w, xf = w.bfloat16().float(), xf.bfloat16().float()
    ref = (xf.double() @ w.double().T).float()
    eps = 2.0**-23 if prec == "bf16" or device.type == "cpu" else 2.0**-20
    bound = K * eps * (xf.abs() @ w.abs().T) + 1e-30
    assert torch.isfinite(y).all()
    err = (y - ref).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("prec", ["bf16", "tf32x3"])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_qmma_matches_reference(name, prec, m, device, quant_rows):
    N, K = SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=20 + m, device=device)
    pw = pack_weights(raw, name, N, K)
    x = _x(m, K, torch.bfloat16 if m == 5 else torch.float32, device, seed=m)
    out = torch.full((m, N), float("nan"), device=device)  # every element must be written
    y = qmma(x, pw, prec, out=out)
    assert y is out
    assert_close(y, x, raw, name, K, prec, device)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("prec", ["bf16", "tf32x3"])
def test_qmma_rows_are_batch_invariant(name, prec, device, quant_rows):
    """Metamorphic: row i of an M-row call is bitwise the 1-row call, at any position, in either
    row tile (M = 19 > 16), and reversing the rows reverses the result exactly."""
    N, K = SHAPES[name]
    M = QMMA_BLOCK_M + 3
    raw = quant_rows(FORMATS[name], N, K, seed=7, device=device)
    pw = pack_weights(raw, name, N, K)
    x = _x(M, K, torch.float32, device, seed=7)
    y = qmma(x, pw, prec)
    for i in (0, 5, 15, 16, M - 1):
        assert torch.equal(y[i : i + 1], qmma(x[i : i + 1].clone(), pw, prec)), f"row {i}"
    assert torch.equal(y[2:7], qmma(x[2:7], pw, prec))
    assert torch.equal(y.flip(0), qmma(x.flip(0).contiguous(), pw, prec))


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K"])
def test_qmma_unsplit_weight_and_config(name, device, quant_rows, monkeypatch):
    """Wide weights (the head) run unsplit; an explicit config (other tile, pipelined K loop)
    gives reference-close, row-invariant results too."""
    monkeypatch.setattr(qmatmul_mod, "QMATMUL_SPLIT_MAX_N", 0)
    N, K = SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=5, device=device)
    pw = pack_weights(raw, name, N, K)
    x = _x(9, K, torch.float32, device, seed=5)
    for cfg in (None, MmaConfig(block_n=32, block_k=256, num_warps=4, num_stages=2)):
        y = qmma(x, pw, "bf16", out=torch.full((9, N), float("nan"), device=device), config=cfg)
        assert_close(y, x, raw, name, K, "bf16", device)
        for i in (0, 8):
            assert torch.equal(y[i : i + 1], qmma(x[i : i + 1].clone(), pw, "bf16", config=cfg)), f"row {i}"


def test_qmma_32_row_tiles_are_batch_invariant(device, quant_rows):
    """A config with 32-row tiles: row i of a 35-row call (two tiles) is the 1-row call, and the
    result is reference-close; 16 or 32 only."""
    name = "Q4_K"
    N, K = SHAPES[name]
    raw = quant_rows(FORMATS[name], N, K, seed=3, device=device)
    pw = pack_weights(raw, name, N, K, k_split=256)  # (slices of 256: one 256-weight step)
    cfg = MmaConfig(block_n=64, block_k=256, block_m=32)
    x = _x(35, K, torch.float32, device, seed=3)
    y = qmma(x, pw, "bf16", config=cfg)
    assert_close(y, x, raw, name, K, "bf16", device)
    for i in (0, 31, 32, 34):
        assert torch.equal(y[i : i + 1], qmma(x[i : i + 1].clone(), pw, "bf16", config=cfg)), f"row {i}"
    with pytest.raises(ValueError, match="block_m must be 16 or 32"):
        qmma(x, pw, config=MmaConfig(block_n=64, block_k=256, block_m=8))


def test_qmma_rejects_bad_inputs(device, quant_rows):
    raw = quant_rows(FORMATS["Q8_0"], 8, 64, seed=0, device=device)
    pw = pack_weights(raw, "Q8_0", 8, 64)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(TypeError, match="PackedWeight"):
        qmma(x, raw)
    with pytest.raises(ValueError, match="prec='fp8' is not allowed: allowed bf16, tf32x3"):
        qmma(x, pw, "fp8")
    with pytest.raises(ValueError, match="x must be"):
        qmma(x[:, :32], pw)
    with pytest.raises(TypeError):
        qmma(x.half(), pw)
    with pytest.raises(ValueError, match="bad qmma config"):
        qmma(x, pw, config=MmaConfig(block_n=16, block_k=96))


@pytest.mark.parametrize("m", [1, 17])
def test_mma_gemv_pair_is_the_two_launches(m, device, quant_rows):
    """launch_mma_gemv_pair: a Q5_0 weight on tensor cores and a Q8_0 weight on the FMA GEMV of
    one x in ONE launch, writing their column ranges of one partial buffer: bitwise the two
    separate launches (the GEMV at the tensor-core config's warps); bad pairs refused."""
    from dataclasses import replace

    from workbench.kernels.qmatmul import gemv_config, launch_qgemv, num_k_splits
    from workbench.kernels.qmma import launch_mma_gemv_pair, launch_qmma, mma_config

    K, Na, Nb = 640, 96, 32
    wa = pack_weights(quant_rows(FORMATS["Q5_0"], Na, K, 1, device), "Q5_0", Na, K)
    wb = pack_weights(quant_rows(FORMATS["Q8_0"], Nb, K, 2, device), "Q8_0", Nb, K)
    x = _x(m, K, torch.float32, device, seed=3)
    splits = num_k_splits(Na + Nb, K)
    part = torch.full((splits, m, Na + Nb), float("nan"), device=device)
    launch_mma_gemv_pair(x, wa, part[:, :, :Na], wb, part[:, :, Na:], splits, part.stride(0), "bf16")
    ref = torch.full_like(part, float("nan"))
    launch_qmma(x, wa, ref[:, :, :Na], splits, ref.stride(0), "bf16")
    warps = mma_config("Q5_0", Na, K, device).num_warps
    launch_qgemv(x, wb, ref[:, :, Na:], splits, ref.stride(0),
                 config=replace(gemv_config("Q8_0", Nb, K, device, wb.slice_k), num_warps=warps))
    assert not part.isnan().any()
    assert torch.equal(part, ref)
    with pytest.raises(ValueError, match="one K"):
        launch_mma_gemv_pair(x, wa, part[:, :, :Na], pack_weights(quant_rows(FORMATS["Q8_0"], Nb, 320, 2, device),
                                                                   "Q8_0", Nb, 320), part[:, :, Na:], splits,
                             part.stride(0))
