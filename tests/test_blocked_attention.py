"""Blocked attention: correct against a float64 reference, and bitwise independent of how the
queries are chunked or what position in a tile a row takes."""

import pytest
import torch

from workbench.attention import KV_BLOCK, attend as _attend, attend_ref, round_up_capacity, to_blocks


def attend(q, k, v, pos, window, scale):
    return _attend(q, *to_blocks(k, v), pos, window, scale)


def _setup(seed, length, h=4, hkv=2, d=32):
    g = torch.Generator().manual_seed(seed)
    cap = round_up_capacity(length)
    k = torch.randn(cap, hkv, d, generator=g)
    v = torch.randn(cap, hkv, d, generator=g)
    q = torch.randn(length, h, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("window", [0, 5, 64, 300])
@pytest.mark.parametrize("length", [1, 7, 300, 600])
def test_matches_reference(window, length):
    q, k, v = _setup(length + window, length)
    pos = torch.arange(length)
    out = attend(q, k, v, pos, window, 0.2)
    ref = attend_ref(q, k, v, pos, window, 0.2)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 64, 300])
def test_chunking_is_bitwise_invariant(window):
    length = 2 * KV_BLOCK + 77
    q, k, v = _setup(11, length)
    pos = torch.arange(length)
    whole = attend(q, k, v, pos, window, 0.125)
    for chunk in (1, 3, 8, 50, 257):
        parts = [attend(q[s : s + chunk], k, v, pos[s : s + chunk], window, 0.125) for s in range(0, length, chunk)]
        assert torch.equal(torch.cat(parts), whole), f"chunk {chunk} differs"


def test_single_rows_in_any_order():
    length = 400
    q, k, v = _setup(5, length)
    pos = torch.arange(length)
    whole = attend(q, k, v, pos, 0, 0.1)
    idx = torch.tensor([399, 3, 250, 17, 256, 255])
    out = attend(q[idx], k, v, pos[idx], 0, 0.1)
    assert torch.equal(out, whole[idx])


def test_stale_cache_rows_past_length_do_not_matter():
    q, k, v = _setup(9, 100)
    pos = torch.arange(100)
    a = attend(q, k, v, pos, 0, 0.1)
    k[100:] = 1e6
    v[100:] = -3.0
    assert torch.equal(attend(q, k, v, pos, 0, 0.1), a)
    k[100:] = float("nan")  # a recycled page: masked keys' values never enter a sum
    v[100:] = float("nan")
    assert torch.equal(attend(q, k, v, pos, 0, 0.1), a)
