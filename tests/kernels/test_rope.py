import pytest
import torch

from workbench.kernels.rope import rope, rope_ref

TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _case(R, H, D, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(R, H, D, generator=gen).to(dtype).to(device)
    pos = torch.randint(0, 40000, (R,), generator=gen)
    pos[0] = 0
    return x, pos.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,H,D,theta", [(1, 4, 64, 1e6), (3, 3, 48, 1e4), (5, 2, 16, 1e4)])
def test_rope_matches_reference(R, H, D, theta, dtype, device):
    x, pos = _case(R, H, D, dtype, device, seed=R + D)
    out = torch.full_like(x, float("nan"))
    y = rope(x, pos, theta, out=out)
    assert y is out
    torch.testing.assert_close(y, rope_ref(x, pos, theta), **TOL[dtype])
    assert torch.equal(y[0], x[0])  # position 0 is the identity


def test_rope_rows_are_batch_invariant_and_in_place(device):
    x, pos = _case(5, 3, 32, torch.float32, device, seed=9)
    y = rope(x, pos, 1e4)
    for r in range(5):
        assert torch.equal(y[r : r + 1], rope(x[r : r + 1], pos[r : r + 1], 1e4)), f"row {r}"
    x2 = x.clone()
    rope(x2, pos, 1e4, out=x2)
    assert torch.equal(x2, y)


def test_rope_strided_heads(device):
    """q and k may be head slices of one fused qkv tensor."""
    x, pos = _case(3, 6, 32, torch.float32, device, seed=4)
    torch.testing.assert_close(rope(x[:, 2:5], pos, 1e4), rope_ref(x[:, 2:5], pos, 1e4), **TOL[torch.float32])
