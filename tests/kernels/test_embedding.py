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
