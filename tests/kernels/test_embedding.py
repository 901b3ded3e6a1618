import math

import pytest
import torch

from workbench.kernels.embedding import embedding, embedding_ref
from workbench.kernels.quant_tiles import FORMATS


@pytest.mark.parametrize("name,n_embd", [("Q8_0", 640), ("Q8_0", 96), ("Q6_K", 512)])
@pytest.mark.parametrize("R", [1, 3, 5])
def test_embedding_matches_reference(name, n_embd, R, device, quant_rows):
    V = 37
    table = quant_rows(FORMATS[name], V, n_embd, seed=R, device=device)
    ids = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(R))
    ids[0] = V - 1
    ids = ids.to(device)
    scale = math.sqrt(n_embd)
    out = torch.full((R, n_embd), float("nan"), device=device)
    assert embedding(ids, table, n_embd, scale, name, out=out) is out
    # the same float32 expression as gguf's decode, then one multiply: equal up to FMA contraction
    torch.testing.assert_close(out, embedding_ref(ids, table, n_embd, scale, name), rtol=1e-6, atol=0)


def test_embedding_rejects_bad_ids(device, quant_rows):
    table = quant_rows(FORMATS["Q8_0"], 4, 64, seed=0, device=device)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="ids"):
            embedding(torch.tensor([4]), table, 64, 8.0)
    with pytest.raises(ValueError):
        embedding(torch.tensor([[1]], device=device), table, 64, 8.0)


@pytest.mark.parametrize("name,n_embd", [("Q8_0", 640), ("Q6_K", 512)])
def test_embedding_rmsnorm_is_the_two_kernels(name, n_embd, device, quant_rows):
    """embedding_rmsnorm (a step's first two kernels as one launch): x the embedding's bits, h the
    norm's (bitwise under the interpreter, where both sum the same zero-padded vector; on a GPU
    the reduction trees may differ: close), a row alone the same bits as in a batch; bad outputs
    refused."""
    from workbench.kernels.embedding import embedding_rmsnorm
    from workbench.kernels.norm import rmsnorm

    V, R = 29, 5
    table = quant_rows(FORMATS[name], V, n_embd, seed=3, device=device)
    ids = torch.tensor([0, 28, 7, 7, 13], device=device)
    w = torch.randn(n_embd, generator=torch.Generator().manual_seed(4)).to(device)
    x = torch.full((R, n_embd), float("nan"), device=device)
    h = torch.full((R, n_embd), float("nan"), device=device)
    embedding_rmsnorm(ids, table, n_embd, 25.3, name, w, 1e-6, x, h)
    assert torch.equal(x, embedding(ids, table, n_embd, 25.3, name))
    want = rmsnorm(x, w, 1e-6)
    if device.type == "cpu":
        assert torch.equal(h, want)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-6)
    x1, h1 = torch.empty_like(x[:1]), torch.empty_like(h[:1])
    embedding_rmsnorm(ids[2:3], table, n_embd, 25.3, name, w, 1e-6, x1, h1)
    assert torch.equal(x1, x[2:3]) and torch.equal(h1, h[2:3])
    with pytest.raises(ValueError, match="h_out must be float32"):
        embedding_rmsnorm(ids, table, n_embd, 25.3, name, w, 1e-6, x, h.bfloat16())
    with pytest.raises(ValueError, match="w must be"):
        embedding_rmsnorm(ids, table, n_embd, 25.3, name, w[:8], 1e-6, x, h)
