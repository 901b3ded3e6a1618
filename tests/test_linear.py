"""The row-invariance policy of linear.py, bitwise, on the real model's matrix shapes."""

import pytest
import torch

from workbench.linear import linear

SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048), (65536, 640)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_row_of_batch_equals_solo(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    x = torch.randn(70, k, generator=g)
    solo = [linear(x[i : i + 1], w) for i in range(x.shape[0])]
    for m in (1, 2, 3, 5, 8, 13, 70):
        y = linear(x[:m], w)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        for i in range(m):
            assert torch.equal(y[i : i + 1], solo[i]), f"row {i} of {m} differs from solo"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_permuted_and_mixed_with_others(dtype):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1536, 640, generator=g).to(dtype)
    x = torch.randn(9, 640, generator=g)
    base = linear(x, w)
    perm = torch.randperm(9, generator=g)
    assert torch.equal(linear(x[perm], w), base[perm])
    other = torch.randn(9, 640, generator=g)
    mixed = linear(torch.cat([other[:4], x[:1], other[4:]]), w)
    assert torch.equal(mixed[4], base[0])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_float64_reference(dtype, tol):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 256, generator=g).to(dtype)
    x = torch.randn(11, 256, generator=g)
    ref = x.double() @ w.double().T
    y = linear(x, w)
    assert (y.double() - ref).norm() / ref.norm() < tol
