import pytest
import torch

from workbench.kernels.sampling import ARGMAX_BLOCK_V, argmax, argmax_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V", [(1, 262144), (3, 2 * ARGMAX_BLOCK_V + 333), (5, 1000)])
def test_argmax_matches_torch(R, V, dtype, device):
    gen = torch.Generator().manual_seed(R + V)
    x = torch.randn(R, V, generator=gen).to(dtype).to(device)
    out = torch.full((R,), -1, dtype=torch.int64, device=device)
    assert argmax(x, out=out) is out
    assert torch.equal(out, argmax_ref(x))


def test_argmax_ties_nan_inf(device):
    V = 2 * ARGMAX_BLOCK_V + 5
    x = torch.randn(5, V, generator=torch.Generator().manual_seed(0)).to(device)
    x[0, [7, ARGMAX_BLOCK_V + 1, V - 1]] = 50.0  # ties across chunks: lowest index
    x[1, [V - 1, ARGMAX_BLOCK_V + 2]] = float("nan")  # NaN wins, first one (as torch)
    x[1, 3] = float("inf")
    x[2] = float("-inf")  # all -inf: index 0
    x[3, V - 1] = float("inf")  # the last element, in the partial chunk
    x[4, :] = 1.0  # all equal: index 0
    assert torch.equal(argmax(x), argmax_ref(x))


def test_argmax_is_batch_invariant(device):
    x = torch.randn(5, 3 * ARGMAX_BLOCK_V + 1, generator=torch.Generator().manual_seed(1)).to(device)
    x[:, 100] = x[:, 5000] = 9.0  # ties
    y = argmax(x)
    for r in range(5):
        assert torch.equal(y[r : r + 1], argmax(x[r : r + 1]))


def test_argmax_feeds_the_next_inputs(device):
    """feed=(ids, pos): the second launch also writes each row's argmax into ids and adds one to
    pos (a decode graph's next inputs); the result is the plain call's; bad feeds refused."""
    x = torch.randn(3, ARGMAX_BLOCK_V + 9, generator=torch.Generator().manual_seed(2)).to(device)
    inputs = torch.tensor([[5, 6, 7], [10, 0, 99]], dtype=torch.int32, device=device)
    tok = argmax(x, feed=(inputs[0], inputs[1]))
    assert torch.equal(tok, argmax_ref(x))
    assert inputs[0].tolist() == tok.tolist() and inputs[1].tolist() == [11, 1, 100]
    with pytest.raises(ValueError, match="feed must be two contiguous int32/int64"):
        argmax(x, feed=(inputs[0, :2], inputs[1]))
    with pytest.raises(ValueError, match="feed must be two contiguous int32/int64"):
        argmax(x, feed=(inputs[0].float(), inputs[1]))
    with pytest.raises(ValueError, match="feed must be two contiguous int32/int64"):
        argmax(x, feed=(inputs.T.contiguous()[:, 0], inputs[1]))
    # hist: each row's token also kept at hist[row, pos % H] (pos before the increment)
    hist = torch.full((3, 8), -1, dtype=torch.int64, device=device)
    tok2 = argmax(x, feed=(inputs[0], inputs[1]), hist=hist)
    want = torch.full((3, 8), -1, dtype=torch.int64)
    for r, p in enumerate([11, 1, 100]):
        want[r, p % 8] = int(tok2[r])
    assert torch.equal(hist.cpu(), want) and inputs[1].tolist() == [12, 2, 101]
    with pytest.raises(ValueError, match="hist needs feed="):
        argmax(x, hist=hist)
