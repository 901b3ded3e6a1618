"""kernels/persistent.py: a recorded run of launches replayed as one persistent launch gives
bitwise what the launches give; what it cannot take is refused before anything runs."""

import pytest
import torch

from workbench.kernels import persistent as ps
from workbench.kernels.qmatmul import pack_weights, qmatmul_ref
from workbench.kernels.qmma import launch_qmma
from workbench.kernels.step_fused import add_rmsnorm, glu_from_parts


def _chain(x, pw, part, r, h, w_post, w_next, glu_out):
    """A small step: product -> residual add + norm -> product -> GLU (four launches)."""
    launch_qmma(x, pw, part, part.shape[0], part.stride(0), "tf32x3")
    add_rmsnorm(r, part, w_post, w_next, h, 1e-6, num_warps=4)
    launch_qmma(h, pw, part, part.shape[0], part.stride(0), "tf32x3")
    glu_from_parts(part, glu_out, "gelu_tanh")


def _inputs(device, R=3, E=64):
    from gguf import GGMLQuantizationType, quantize

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(E, E, generator=gen)
    raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0)).to(device)
    pw = pack_weights(raw, "Q8_0", E, E, k_split=E // 2)  # two K slices, as the tests launch it
    x = torch.randn(R, E, generator=gen).to(device)
    r = torch.randn(R, E, generator=gen).to(device)
    w_post = torch.randn(E, generator=gen).to(device)
    w_next = torch.randn(E, generator=gen).to(device)
    return pw, raw, x, r, w_post, w_next


def _buffers(R, E, splits, device):
    return (torch.full((splits, R, E), float("nan"), device=device), torch.full((R, E), float("nan"), device=device),
            torch.full((R, E // 2), float("nan"), device=device))


def test_persistent_launch_is_bitwise_the_chain(device):
    R, E = 3, 64
    pw, raw, x, r0, w_post, w_next = _inputs(device, R, E)
    splits = 2  # a fixed split-K, as the runner's products take it
    part, h, g = _buffers(R, E, splits, device)
    r = r0.clone()
    _chain(x, pw, part, r, h, w_post, w_next, g)
    want = (r.clone(), h.clone(), g.clone(), part.clone())
    assert torch.isfinite(g).all()
    # first product against the reference (the chain is a real computation)
    part2, _, _ = _buffers(R, E, splits, device)
    launch_qmma(x, pw, part2, splits, part2.stride(0), "tf32x3")
    torch.testing.assert_close(part2.sum(0), qmatmul_ref(x, raw, "Q8_0", E, E), rtol=1e-4, atol=1e-3)

    part, h, g = _buffers(R, E, splits, device)
    r = r0.clone()
    with ps.record() as rec:
        _chain(x, pw, part, r, h, w_post, w_next, g)
    assert [ln.kernel for ln in rec.launches] == ["_qmma_kernel", "_add_rmsnorm_kernel", "_qmma_kernel",
                                                 "_glu_kernel"]
    assert torch.isnan(h).all() and torch.equal(r, r0)  # recorded, not run
    plan = rec.plan(device)
    assert plan.stages == 4 and len(plan.kinds) == 3  # the two products share one kind
    assert plan.n_items == sum(a * b * c for a, b, c in (ln.grid for ln in rec.launches))
    plan.upload()
    ctr = ps.counters(plan.stages, device)
    for programs in (1, 3):  # extra programs find no ticket and leave
        part.fill_(float("nan"))
        h.fill_(float("nan"))
        g.fill_(float("nan"))
        r.copy_(r0)
        ps.launch(plan, ctr, programs=programs)
        for got, w in zip((r, h, g, part), want):
            assert torch.equal(got, w)
        assert not ctr.any()  # the last program out leaves the counters zero for the next launch


def _recorded_chain(device, R=3, E=64) -> ps.Record:
    """The launches of ``_chain`` on fresh inputs, recorded (not run)."""
    pw, _, x, r0, w_post, w_next = _inputs(device, R, E)
    part, h, g = _buffers(R, E, 2, device)
    with ps.record() as rec:
        _chain(x, pw, part, r0.clone(), h, w_post, w_next, g)
    return rec


def test_items_follow_the_grid_numbering(device):
    rec = _recorded_chain(device)
    items = rec.plan(device).items
    first = items[items[:, 5] == 0]
    g0, g1, g2 = rec.launches[0].grid
    assert first.shape[0] == g0 * g1 * g2
    assert first[:, 2].tolist()[: g0] == list(range(g0))  # x fastest, as the hardware numbers them
    assert first[g0, 3] == 1
    # stage s waits for all of stage s - 1's items; stage 0 for nothing
    assert (first[:, 6] == 0).all()
    second = items[items[:, 5] == 1]
    assert (second[:, 6] == first.shape[0]).all()


def test_unsupported_launches_are_refused_before_they_run(device):
    from workbench.kernels.norm import rmsnorm

    x = torch.randn(2, 16, device=device)
    out = torch.full_like(x, float("nan"))
    with pytest.raises(ps.Unsupported, match="_rmsnorm_kernel"):
        with ps.record():
            rmsnorm(x, torch.ones(16, device=device), 1e-6, out=out)
    assert torch.isnan(out).all()
    # the launches run normally again after the block
    rmsnorm(x, torch.ones(16, device=device), 1e-6, out=out)
    assert torch.isfinite(out).all()


def test_one_num_warps_per_plan(device):
    rec = _recorded_chain(device)
    rec.launches[1].num_warps = 8
    with pytest.raises(ps.Unsupported, match="num_warps"):
        rec.plan(device)
    with pytest.raises(ps.Unsupported, match="no launches"):
        ps.Record().plan(device)


def test_counters_must_cover_the_stages(device):
    plan = _recorded_chain(device).plan(device)
    with pytest.raises(ValueError, match="at least 5"):
        ps.launch(plan, ps.counters(2, device))


@pytest.mark.parametrize("precision", ["bf16", "tf32x3"])
def test_attention_stages_are_bitwise_the_chain(device, precision):
    """q|k|v partials -> QK-norm + rope + KV write -> attention (combine folded in) -> a GEMV
    product -> residual add + norm: the persistent launch is bitwise the chain, rows at
    different positions (several attention segments each)."""
    from workbench.kernels.attention import attention_rows
    from dataclasses import replace

    from workbench.kernels.qmatmul import gemv_config, launch_qgemv
    from workbench.kernels.rope import rope_inv_freq
    from workbench.kernels.step_fused import qk_rope_kv

    gen = torch.Generator().manual_seed(9)
    R, Hq, Hkv, D, L, E = 3, 4, 1, 32, 96, 64
    splits = 2
    part = torch.randn(splits, R, (Hq + 2 * Hkv) * D, generator=gen).to(device)
    kp0 = torch.randn(R, L, Hkv, D, generator=gen).to(device)
    vp0 = torch.randn(R, L, Hkv, D, generator=gen).to(device)
    seq = torch.arange(R, dtype=torch.int32, device=device)
    pos = torch.tensor([70, 5, 33], dtype=torch.int32, device=device)
    win = torch.tensor([0, 0, 16], dtype=torch.int32, device=device)
    qn, kn = torch.randn(D, generator=gen).to(device), torch.randn(D, generator=gen).to(device)
    inv = rope_inv_freq(D, 10000.0, device)
    pw, _, _, r0, w_post, w_next = _inputs(device, R, E)
    from gguf import GGMLQuantizationType, quantize
    wo = torch.randn(E, Hq * D, generator=gen)
    pwo = pack_weights(torch.from_numpy(quantize(wo.numpy(), GGMLQuantizationType.Q8_0)).to(device), "Q8_0", E, Hq * D,
                       k_split=Hq * D // splits)
    counters = torch.zeros(R * Hkv, dtype=torch.int32, device=device)
    use_dot = torch.device(device).type == "cuda"
    cfg = replace(gemv_config("Q8_0", E, Hq * D, device, pwo.slice_k), num_warps=4)  # one num_warps per plan

    def chain(q, kp, vp, o, y, r, h):
        qk_rope_kv(part, q, kp, vp, seq, pos, qn, kn, inv, 1e-6, num_warps=4)
        attention_rows(q, kp, vp, seq, pos, win, 0.125, out=o, max_pos=L - 1, counters=counters,
                       precision=precision if use_dot else None, num_warps=4)
        launch_qgemv(o.view(R, Hq * D), pwo, y, splits, y.stride(0), config=cfg)
        add_rmsnorm(r, y, w_post, w_next, h, 1e-6, num_warps=4)

    def fresh():
        return (torch.full((R, Hq, D), float("nan"), device=device), kp0.clone(), vp0.clone(),
                torch.full((R, Hq, D), float("nan"), device=device),
                torch.full((splits, R, E), float("nan"), device=device), r0.clone(),
                torch.full((R, E), float("nan"), device=device))

    want = fresh()
    chain(*want)
    assert torch.isfinite(want[6]).all()
    got = fresh()
    with ps.record() as rec:
        chain(*got)
    assert [ln.kernel for ln in rec.launches] == ["_qk_rope_kv_kernel", "_attention_partial_kernel",
                                                 "_qgemv_kernel", "_add_rmsnorm_kernel"]
    plan = rec.plan(device)
    plan.upload()
    ps.launch(plan, ps.counters(plan.stages, device))
    for name, a, b in zip(("q", "k", "v", "attn", "y", "x", "h"), got, want):
        assert torch.equal(a, b), name


def test_grid_fits_the_multiprocessor():
    """Static assignment needs every program resident: the grid per multiprocessor follows the
    registers (in 256-register warp units), shared memory and threads (run 27 on an H200 hung
    when the grid was sized without the register count)."""
    assert ps.fit_per_sm(255, 41472, 4) == 2  # the persistent kernel on an H200: 2 x 32,768 registers
    assert ps.fit_per_sm(168, 41472, 4) == 3
    assert ps.fit_per_sm(144, 4096, 4) == 3
    assert ps.fit_per_sm(32, 0, 4) == 16  # threads bound it
    assert ps.fit_per_sm(32, 100_000, 4) == 2  # shared memory bounds it
    assert ps.fit_per_sm(255, 0, 8) == 1
    with pytest.raises(ValueError, match="regs"):
        ps.fit_per_sm(0, 0, 4)
