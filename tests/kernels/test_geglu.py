import pytest
import torch

from workbench.kernels.geglu import GEGLU_BLOCK, geglu, geglu_ref

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,F", [(1, 2048), (3, GEGLU_BLOCK + 77), (5, 33)])
def test_geglu_matches_reference(R, F, dtype, device):
    gen = torch.Generator().manual_seed(R + F)
    gate = (torch.randn(R, F, generator=gen) * 4).to(dtype).to(device)  # covers the tails
    up = torch.randn(R, F, generator=gen).to(dtype).to(device)
    out = torch.full_like(gate, float("nan"))
    assert geglu(gate, up, out=out) is out
    torch.testing.assert_close(out, geglu_ref(gate, up), **TOL[dtype])


def test_geglu_views_of_fused_output_and_invariance(device):
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(5, 2 * 40, generator=gen).to(device)
    gate, up = gu[:, :40], gu[:, 40:]
    y = geglu(gate, up)
    torch.testing.assert_close(y, geglu_ref(gate, up), **TOL[torch.float32])
    for r in range(5):
        assert torch.equal(y[r : r + 1], geglu(gate[r : r + 1], up[r : r + 1]))
