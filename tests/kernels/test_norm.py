import pytest
import torch

from workbench.kernels import norm as norm_mod
from workbench.kernels.norm import rmsnorm, rmsnorm_heads, rmsnorm_ref

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _randn(*shape, gen, dtype=torch.float32, device="cpu"):
    return (torch.randn(*shape, generator=gen) * 3 + 0.5).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,D", [(1, 640), (3, 100), (5, 33)])
def test_rmsnorm_matches_reference(R, D, dtype, device):
    gen = torch.Generator().manual_seed(R * D)
    x = _randn(R, D, gen=gen, dtype=dtype, device=device)
    w = _randn(D, gen=gen, device=device)
    out = torch.full_like(x, float("nan"))
    assert rmsnorm(x, w, 1e-6, out=out) is out
    torch.testing.assert_close(out, rmsnorm_ref(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_heads_matches_reference(dtype, device):
    gen = torch.Generator().manual_seed(1)
    x = _randn(3, 4, 24, gen=gen, dtype=dtype, device=device)
    w = _randn(24, gen=gen, device=device)
    out = torch.full_like(x, float("nan"))
    assert rmsnorm_heads(x, w, 1e-6, out=out) is out
    torch.testing.assert_close(out, rmsnorm_ref(x, w, 1e-6), **TOL[dtype])
    # a head slice of a fused tensor (strided rows)
    torch.testing.assert_close(rmsnorm_heads(x[:, 1:3], w, 1e-6), rmsnorm_ref(x[:, 1:3], w, 1e-6), **TOL[dtype])


def test_rmsnorm_long_rows_walk_tiles(device, monkeypatch):
    monkeypatch.setattr(norm_mod, "NORM_MAX_BLOCK_D", 32)  # force 4 tiles per row
    gen = torch.Generator().manual_seed(2)
    x = _randn(2, 100, gen=gen, device=device)
    w = _randn(100, gen=gen, device=device)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), **TOL[torch.float32])


def test_norms_are_batch_invariant(device):
    gen = torch.Generator().manual_seed(3)
    x = _randn(5, 640, gen=gen, device=device)
    w = _randn(640, gen=gen, device=device)
    y = rmsnorm(x, w, 1e-6)
    xh = _randn(5, 4, 32, gen=gen, device=device)
    wh = _randn(32, gen=gen, device=device)
    yh = rmsnorm_heads(xh, wh, 1e-6)
    for r in range(5):
        s = slice(r, r + 1)
        assert torch.equal(y[s], rmsnorm(x[s], w, 1e-6)), f"row {r}"
        assert torch.equal(yh[s], rmsnorm_heads(xh[s], wh, 1e-6)), f"row {r}"
