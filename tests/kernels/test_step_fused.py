"""kernels/step_fused.py: the per-row kernels between the step's products, against their
torch references, on odd shapes with 1-3 split-K partials; and row i of a batch == solo."""

import pytest
import torch

from workbench.kernels.step_fused import (
    add_rmsnorm,
    add_rmsnorm_ref,
    glu_from_parts,
    glu_from_parts_ref,
    qk_rope_kv,
    qk_rope_kv_ref,
)


def _r(*shape, gen, device, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device)


@pytest.mark.parametrize("splits,post", [(1, True), (3, False), (2, True)])
def test_add_rmsnorm(splits, post, device):
    gen = torch.Generator().manual_seed(splits)
    R, E = 5, 72
    x = _r(R, E, gen=gen, device=device)
    part = _r(splits, R, E + 8, gen=gen, device=device)  # wider than E: a column range of it is read
    w_post = _r(E, gen=gen, device=device) if post else None
    w_next = _r(E, gen=gen, device=device)
    want_x, want_h = add_rmsnorm_ref(x, part, w_post, w_next, 1e-6)
    h = torch.full((R, E), float("nan"), device=device)
    xs = x.clone()
    add_rmsnorm(xs, part, w_post, w_next, h, 1e-6)
    torch.testing.assert_close(xs, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    # row 3 alone: bitwise the batched row
    x1, h1 = x[3:4].clone(), torch.empty(1, E, device=device)
    add_rmsnorm(x1, part[:, 3:4].contiguous(), w_post, w_next, h1, 1e-6)
    assert torch.equal(x1, xs[3:4]) and torch.equal(h1, h[3:4])


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_glu_from_parts(act, device):
    gen = torch.Generator().manual_seed(3)
    R, F, splits = 4, 1100, 3  # F > one column block: two programs per row
    part = _r(splits, R, 2 * F, gen=gen, device=device, scale=2.0)
    out = torch.full((R, F), float("nan"), device=device)
    glu_from_parts(part, out, act)
    torch.testing.assert_close(out, glu_from_parts_ref(part, F, act), rtol=1e-5, atol=1e-5)
    one = torch.empty(1, F, device=device)
    glu_from_parts(part[:, 2:3].contiguous(), one, act)
    assert torch.equal(one, out[2:3])
    with pytest.raises(ValueError, match="act='relu' is not allowed"):
        glu_from_parts(part, out, "relu")


@pytest.mark.parametrize("norm", [True, False])
def test_qk_rope_kv(norm, device):
    gen = torch.Generator().manual_seed(5)
    R, Hq, Hkv, D, splits, S, L = 3, 3, 1, 20, 2, 3, 16
    part = _r(splits, R, (Hq + 2 * Hkv) * D, gen=gen, device=device)
    seq = torch.tensor([2, 0, 2], dtype=torch.int32, device=device)
    pos = torch.tensor([7, 0, 15], dtype=torch.int32, device=device)
    inv = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    qn = _r(D, gen=gen, device=device) if norm else None
    kn = _r(D, gen=gen, device=device) if norm else None
    q = torch.full((R, Hq, D), float("nan"), device=device)
    k_pool = torch.full((S, L, Hkv, D), float("nan"), device=device)
    v_pool = torch.full((S, L, Hkv, D), float("nan"), device=device)
    qk_rope_kv(part, q, k_pool, v_pool, seq, pos, qn, kn, inv, 1e-6)
    wq, wk, wv = qk_rope_kv_ref(part, Hq, Hkv, D, pos, qn, kn, inv, 1e-6)
    torch.testing.assert_close(q, wq, rtol=1e-5, atol=1e-5)
    for r in range(R):
        torch.testing.assert_close(k_pool[seq[r], pos[r]], wk[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_pool[seq[r], pos[r]], wv[r], rtol=1e-5, atol=1e-5)
    assert int(torch.isnan(k_pool).any(-1).any(-1).sum()) == S * L - R  # nothing else written
    q1 = torch.empty(1, Hq, D, device=device)
    qk_rope_kv(part[:, 1:2].contiguous(), q1, k_pool, v_pool, seq[1:2], pos[1:2], qn, kn, inv, 1e-6)
    assert torch.equal(q1, q[1:2])


@pytest.mark.parametrize("form,name,act", [("mma", "Q5_0", "gelu_tanh"), ("gemv", "Q4_K", "silu"), ("gemv", "Q5_0", "gelu_tanh")])
def test_glu_folded_into_the_product_is_bitwise_the_separate_kernel(form, name, act, device, quant_rows):
    """GluEpilogue: the [gate | up] product's last program per column pair writes act(gate) * up,
    bitwise what glu_from_parts makes of the same partials; rows stay invariant; the counters are
    left zero for the next launch (here: reused by the second call)."""
    from workbench.kernels import qmatmul, qmma
    from workbench.kernels.qmatmul import GluEpilogue, num_k_splits, pack_weights
    from workbench.kernels.quant_tiles import FORMATS

    F, K = 256, 512
    N = 2 * F
    pw = pack_weights(quant_rows(FORMATS[name], N, K, seed=9, device=device), name, N, K)
    splits = num_k_splits(N, K)
    counters = torch.zeros(64, dtype=torch.int32, device=device)

    def run(x):
        M = x.shape[0]
        part = torch.full((splits, M, N), float("nan"), device=device)
        g = torch.full((M, F), float("nan"), device=device)
        glu = GluEpilogue(g, counters, act)
        if form == "mma":
            qmma.launch_qmma(x, pw, part, splits, part.stride(0), "bf16", glu=glu)
        else:
            qmatmul.launch_qgemv(x, pw, part, splits, part.stride(0), glu=glu)
        return part, g

    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)).to(device)
    part, g = run(x)
    want = torch.empty(5, F, device=device)
    glu_from_parts(part, want, act)
    assert torch.equal(g, want)
    assert int(counters.abs().sum()) == 0
    _, g3 = run(x[3:4].clone())
    assert torch.equal(g3, g[3:4])
    with pytest.raises(ValueError, match="the GLU fold needs"):
        qmatmul.glu_args(GluEpilogue(g, counters[:1], act), part, splits, 32, 5, 4, N)


def test_pdl_launch_options_follow_the_device_and_the_switch(device):
    """kernels/pdl.py: PDL only where the GPU and triton have it (sm_90+); ``enabled(False)``
    switches it off inside its block, restores it after (also after an error), and refuses
    nesting (one owner decides for its launches)."""
    from workbench.kernels import pdl

    t = torch.zeros(1, device=device)
    on = device.type == "cuda" and pdl._supported(torch.cuda.current_device())
    assert pdl.launch_kw(t) == ({"PDL": 1, "launch_pdl": True} if on else {"PDL": 0})
    with pdl.enabled(False):
        assert pdl.launch_kw(t) == {"PDL": 0}
        with pytest.raises(RuntimeError, match="does not nest"):
            with pdl.enabled(True):
                pass
        assert pdl.launch_kw(t) == {"PDL": 0}
    with pytest.raises(KeyError):
        with pdl.enabled(False):
            raise KeyError("inside")
    assert pdl.launch_kw(t) == ({"PDL": 1, "launch_pdl": True} if on else {"PDL": 0})
    with pdl.enabled(True):  # (usable again after the error)
        assert pdl.launch_kw(torch.zeros(1)) == {"PDL": 0}  # a CPU tensor never
