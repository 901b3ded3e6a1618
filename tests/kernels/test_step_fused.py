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
    """kernels/pdl.py: PDL only where the GPU and triton have it (sm_90+): 1 (wait, then release)
    or 2 with EARLY (release, then wait); ENABLED off means none anywhere; enabled() restores the
    switch."""
    from workbench.kernels import pdl

    t = torch.zeros(1, device=device)
    on = device.type == "cuda" and pdl._supported(torch.cuda.current_device())
    assert pdl.launch_kw(t) == ({"PDL": 1, "launch_pdl": True} if on else {"PDL": 0})
    saved, pdl.EARLY = pdl.EARLY, True
    try:
        assert pdl.launch_kw(t) == ({"PDL": 2, "launch_pdl": True} if on else {"PDL": 0})
    finally:
        pdl.EARLY = saved
    with pdl.enabled(False):
        assert pdl.launch_kw(t) == {"PDL": 0}
    assert pdl.ENABLED
    assert pdl.launch_kw(torch.zeros(1)) == {"PDL": 0}  # a CPU tensor never


@pytest.mark.parametrize("norm,members", [(True, 1), (False, 2)])
def test_heads_folded_into_the_qkv_product(norm, members, device, quant_rows):
    """HeadsEpilogue: the q|k|v product's last program per head does QK-norm + rope + the KV
    write (qk_rope_kv's work) from its partials: close to the reference, rows bitwise invariant,
    counters left zero. ``members`` 2: q|k and v as two launches (two formats in the model)."""
    from workbench.kernels import qmma
    from workbench.kernels.qmatmul import HeadsEpilogue, num_k_splits, pack_weights
    from workbench.kernels.quant_tiles import FORMATS

    Hq, Hkv, D, K, S, L = 2, 1, 128, 512, 3, 16
    N = (Hq + 2 * Hkv) * D
    raw = quant_rows(FORMATS["Q5_0"], N, K, seed=4, device=device)
    cuts = [(0, N)] if members == 1 else [(0, (Hq + Hkv) * D), ((Hq + Hkv) * D, N)]
    parts = [(lo, pack_weights(raw[lo:hi].contiguous(), "Q5_0", hi - lo, K)) for lo, hi in cuts]
    gen = torch.Generator().manual_seed(6)
    qn = _r(D, gen=gen, device=device) if norm else None
    kn = _r(D, gen=gen, device=device) if norm else None
    inv = (1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))).to(device)
    counters = torch.zeros(64, dtype=torch.int32, device=device)

    def run(x, seq, pos):
        M = x.shape[0]
        splits = num_k_splits(N, K)
        part = torch.full((splits, M, N), float("nan"), device=device)
        q = torch.full((M, Hq, D), float("nan"), device=device)
        kp = torch.zeros(S, L, Hkv, D, device=device)
        vp = torch.zeros(S, L, Hkv, D, device=device)
        h = HeadsEpilogue(q, kp, vp, seq, pos, qn, kn, inv, 1e-6, counters)
        for lo, pw in parts:
            qmma.launch_qmma(x, pw, part[:, :, lo:], num_k_splits(pw.N, K), part.stride(0), "tf32x3", heads=h, col0=lo)
        return part, q, kp, vp

    x = torch.randn(5, K, generator=gen).to(device)
    seq = torch.tensor([0, 2, 1, 0, 2], dtype=torch.int32, device=device)
    pos = torch.tensor([3, 0, 7, 9, 15], dtype=torch.int32, device=device)
    part, q, kp, vp = run(x, seq, pos)
    want_q, want_k, want_v = qk_rope_kv_ref(part, Hq, Hkv, D, pos, qn, kn, inv, 1e-6)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kp[seq.long(), pos.long()], want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vp[seq.long(), pos.long()], want_v, rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0
    _, q3, kp3, vp3 = run(x[3:4].clone(), seq[3:4].clone(), pos[3:4].clone())
    assert torch.equal(q3, q[3:4])
    assert torch.equal(kp3[0, 9], kp[0, 9]) and torch.equal(vp3[0, 9], vp[0, 9])


@pytest.mark.parametrize("name,post,rows", [("Q8_0", True, 5), ("Q4_K", False, 18)])
def test_add_norm_folded_into_the_product(name, post, rows, device, quant_rows):
    """NormEpilogue: the product's last programs sum its partials per column tile, then the last
    of those per row tile adds the rows into the residual and writes the next norm (add_rmsnorm's
    work): close to the reference, rows bitwise invariant, counters left zero. 18 rows: two
    16-row tiles, each finished by its own last program."""
    from workbench.kernels import qmma
    from workbench.kernels.qmatmul import NormEpilogue, num_k_splits, pack_weights
    from workbench.kernels.quant_tiles import FORMATS

    N, K = 192, 768
    raw = quant_rows(FORMATS[name], N, K, seed=7, device=device)
    pw = pack_weights(raw, name, N, K)
    splits = num_k_splits(N, K)
    assert splits > 1
    gen = torch.Generator().manual_seed(8)
    wp = _r(N, gen=gen, device=device) if post else None
    wn = _r(N, gen=gen, device=device)
    counters = torch.zeros(64, dtype=torch.int32, device=device)

    def run(a, x):
        M = a.shape[0]
        part = torch.full((splits, M, N), float("nan"), device=device)
        x, h = x.clone(), torch.full((M, N), float("nan"), device=device)
        qmma.launch_qmma(a, pw, part, splits, part.stride(0), "tf32x3", norm=NormEpilogue(x, h, wp, wn, 1e-6, counters))
        return part, x, h

    a = torch.randn(rows, K, generator=gen).to(device)
    x0 = _r(rows, N, gen=gen, device=device)
    part, x, h = run(a, x0)
    plain = torch.empty_like(part)
    qmma.launch_qmma(a, pw, plain, splits, plain.stride(0), "tf32x3")
    want_x, want_h = add_rmsnorm_ref(x0, plain, wp, wn, 1e-6)
    torch.testing.assert_close(x, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0
    for i in (0, rows - 1):
        _, xi, hi = run(a[i : i + 1].clone(), x0[i : i + 1])
        assert torch.equal(xi, x[i : i + 1]) and torch.equal(hi, h[i : i + 1])


def test_weights_before_the_wait_change_no_bit(device, monkeypatch):
    """WEIGHT_LOADS: the norm weights and x (add+norm) and the rope's positions, cos / sin and
    QK-norm weights (QK-norm/rope) loaded where first used, right after the PDL wait or before
    it: the same bits, for x, h, q and the pools; an unknown form is refused."""
    from workbench.kernels import step_fused

    gen = torch.Generator().manual_seed(9)
    R, E, splits = 3, 72, 2
    x = _r(R, E, gen=gen, device=device)
    part = _r(splits, R, E, gen=gen, device=device)
    w_post, w_next = _r(E, gen=gen, device=device), _r(E, gen=gen, device=device)
    Hq, Hkv, D = 2, 1, 16
    qpart = _r(splits, R, (Hq + 2 * Hkv) * D, gen=gen, device=device)
    seq = torch.tensor([1, 0, 2], dtype=torch.int32, device=device)
    pos = torch.tensor([3, 0, 9], dtype=torch.int32, device=device)
    inv = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    qn, kn = _r(D, gen=gen, device=device), _r(D, gen=gen, device=device)
    got = {}
    for pre in step_fused.WEIGHT_LOADS_FORMS:
        monkeypatch.setattr(step_fused, "WEIGHT_LOADS", pre)
        xs, h = x.clone(), torch.empty(R, E, device=device)
        add_rmsnorm(xs, part, w_post, w_next, h, 1e-6)
        q = torch.empty(R, Hq, D, device=device)
        kp, vp = torch.zeros(3, 12, Hkv, D, device=device), torch.zeros(3, 12, Hkv, D, device=device)
        qk_rope_kv(qpart, q, kp, vp, seq, pos, qn, kn, inv, 1e-6)
        got[pre] = (xs, h, q, kp, vp)
    for form in ("after_wait", "before_wait"):
        for a, b in zip(got[form], got["in_order"], strict=True):
            assert torch.equal(a, b)
    monkeypatch.setattr(step_fused, "WEIGHT_LOADS", "early")
    with pytest.raises(ValueError, match="WEIGHT_LOADS='early' is not allowed"):
        add_rmsnorm(x.clone(), part, w_post, w_next, torch.empty(R, E, device=device), 1e-6)
