"""The QSA kernels (kernels/qsa.py) against their torch references and the definition: block
summaries bitwise the reference's ops, selection exactly the reference's (tie-free inputs;
explicit ties to the earlier block), attention within float32 tolerance, through scattered
block tables with NaN in every cache entry a row must not read; rows bitwise the same alone or
in any batch; rows below the QSA boundary left untouched."""

import pytest
import torch

from workbench.kernels import qsa as qsa_mod
from workbench.kernels.qsa import (
    qsa_attention,
    qsa_attention_ref,
    qsa_attention_workspace,
    qsa_select,
    qsa_select_ref,
    qsa_summaries,
    qsa_summaries_ref,
)

Hkv, G, D, B, PAGE = 2, 2, 16, 4, 32
TOP_K, SINK, LOCAL = 5, 1, 2
KEPT = SINK + TOP_K + LOCAL
DENSE = KEPT * B  # 32: rows at pos >= 32 are sparse
SCALE = 0.25
LENS = [300, 150, 33, 20]  # cache lengths of the sequences
# (seq, pos): decode rows at a sequence's end (their own block's tail unwritten: NaN), rows
# inside a sequence (a prefill row: later positions written), at and around the boundary, dense rows
ROWS = [(0, 299), (1, 149), (2, 32), (3, 19), (0, 100), (1, 31), (0, 35), (1, 147), (0, 0)]
SENTINEL_SEL = -7
SENTINEL_OUT = 123.0
TOL = dict(rtol=1e-4, atol=1e-5)


def _case(dtype, seed, lens=LENS, keys=None):
    """(k pages, v pages, block table, per-sequence contiguous (k, v)): each sequence's first
    lens[s] positions on shuffled pages, NaN everywhere else (spare pages too); table entries
    past a sequence's pages -1. keys: optional per-sequence K [L, Hkv, D] to use."""
    gen = torch.Generator().manual_seed(seed)
    W = -(-max(lens) // PAGE)
    need = [-(-n // PAGE) for n in lens]
    P = sum(need) + 3
    order = torch.randperm(P, generator=gen).tolist()
    kp = torch.full((P, PAGE, Hkv, D), float("nan"), dtype=dtype)
    vp = torch.full_like(kp, float("nan"))
    table = torch.full((len(lens), W), -1, dtype=torch.int32)
    seqs = []
    for s, n in enumerate(lens):
        k = (torch.randn(n, Hkv, D, generator=gen) if keys is None else keys[s]).to(dtype)
        v = torch.randn(n, Hkv, D, generator=gen).to(dtype)
        seqs.append((k, v))
        for i in range(need[s]):
            p = order.pop()
            table[s, i] = p
            m = min(PAGE, n - i * PAGE)
            kp[p, :m], vp[p, :m] = k[i * PAGE : i * PAGE + m], v[i * PAGE : i * PAGE + m]
    return kp, vp, table, seqs


def _rows(rows=ROWS):
    seq = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    pos = torch.tensor([p for _, p in rows], dtype=torch.int32)
    return seq, pos


def _summ_shape(kp, summary):
    return (kp.shape[0], PAGE // B, 1 if summary == "mean" else 2, Hkv, D)


def _all_summaries(kp, table, summary, lens=LENS):
    """The summaries of every complete block of every sequence (the reference), NaN elsewhere."""
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]).int()
    pos = torch.cat([torch.arange(n) for n in lens]).int()
    summ = torch.full(_summ_shape(kp, summary), float("nan"))
    return qsa_summaries_ref(kp, table, seq, pos, B, summary, summ)


def _q(n, seed):
    return torch.randn(n, Hkv * G, D, generator=torch.Generator().manual_seed(seed))


# the top-k search's forms: the default (the scored range one resident tile, 2 bits a pass),
# and the tiled form (every pass re-reads the scores in tiles) at 1 and 4 bits a pass
SEARCHES = {"resident": {}, "tiled-16-1bit": dict(QSA_RESIDENT_KEYS=0, QSA_KEY_TILE=16, QSA_RADIX_BITS=1),
            "tiled-32-4bit": dict(QSA_RESIDENT_KEYS=0, QSA_KEY_TILE=32, QSA_RADIX_BITS=4)}


@pytest.fixture(params=list(SEARCHES))
def search(request, monkeypatch):
    for name, value in SEARCHES[request.param].items():
        monkeypatch.setattr(qsa_mod, name, value)
    return request.param


def _on(device, *ts):
    return [None if t is None else t.to(device) for t in ts]


def _select(q, summ, table, seq, pos, summary, device, scratch=None):
    """The kernel on ``device`` (inputs built on the CPU), sel back on the CPU."""
    sel = torch.full((q.shape[0], Hkv, KEPT), SENTINEL_SEL, dtype=torch.int32, device=device)
    scratch = None if scratch is None else scratch.to(device)
    out = qsa_select(*_on(device, q, summ, table, seq, pos), B, TOP_K, SINK, LOCAL, summary, sel, scratch=scratch)
    return out.cpu()


def _attend(q, kp, vp, table, seq, pos, sel, device, counters=None, workspace=None, **kw):
    """The kernel on ``device`` (inputs built on the CPU), out back on the CPU."""
    out = torch.full(q.shape, SENTINEL_OUT, device=device)
    got = qsa_attention(*_on(device, q, kp, vp, table, seq, pos, sel), B, SCALE, out, DENSE, counters=counters,
                        workspace=workspace, **kw)
    return got.cpu()


def _assert_tie_free(q, summ, table, seq, pos):
    """The inputs' top_k-th and next scores are well apart (float64), so rounding cannot swap them."""
    for r in range(q.shape[0]):
        p = int(pos[r])
        if p < DENSE:
            continue
        first = torch.arange(SINK, p // B + 1 - LOCAL) * B
        t = table[int(seq[r])].long()
        sm = summ[t[first // PAGE], (first % PAGE) // B].double()  # [n, S, Hkv, D]
        qg = q[r].double().view(Hkv, G, D)
        s = torch.einsum("hgd,nhd->hn", qg, sm[:, 0])
        if sm.shape[1] == 2:
            s = s + torch.einsum("hgd,nhd->hn", qg.abs(), sm[:, 1])
        top = s.sort(-1, descending=True).values
        assert (top[:, TOP_K - 1] - top[:, TOP_K]).min() > 1e-4, f"row {r} has a near tie: pick another seed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_summaries_match_reference_bitwise(summary, dtype, device):
    """Every row of a launch that completes a block writes that block's summary, bitwise the
    reference's ops; rows that complete none, and every other slot, are left as they were. A
    launch of prefill chunks and decode rows of several sequences equals the reference."""
    kp, _, table, _ = _case(dtype, seed=1)
    rows = [(0, p) for p in range(40, 72)] + [(1, p) for p in range(0, 150, 7)] + [(2, 31), (3, 19), (0, 299)]
    seq, pos = _rows(rows)
    base = torch.full(_summ_shape(kp, summary), float("nan"))
    kd, td, sd, pd = _on(device, kp, table, seq, pos)
    got = qsa_summaries(kd, td, sd, pd, B, summary, base.to(device)).cpu()
    want = qsa_summaries_ref(kp, table, seq, pos, B, summary, base.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    written = ~torch.isnan(got)
    completing = sum(1 for _, p in rows if (p + 1) % B == 0)
    assert written.sum() == completing * got[0, 0].numel()
    # every block's summary is the same bits whichever launch wrote it (one row per launch here)
    one = base.to(device)
    for r in range(len(rows)):
        qsa_summaries(kd, td, sd[r : r + 1], pd[r : r + 1], B, summary, one)
    torch.testing.assert_close(one.cpu(), got, rtol=0, atol=0, equal_nan=True)


def test_summaries_of_a_strided_layer_view(device):
    """summ may be one layer's view of a page payload [pages, layers, PAGE // B, S, Hkv, D]."""
    kp, _, table, _ = _case(torch.float32, seed=2)
    seq, pos = _rows([(0, 299), (1, 147), (0, 3)])
    payload = torch.zeros(kp.shape[0], 3, PAGE // B, 2, Hkv, D, device=device)
    qsa_summaries(*_on(device, kp, table, seq, pos), B, "minmax", payload[:, 1])
    payload = payload.cpu()
    want = qsa_summaries_ref(kp, table, seq, pos, B, "minmax", torch.zeros(kp.shape[0], PAGE // B, 2, Hkv, D))
    assert torch.equal(payload[:, 1], want)
    assert not payload[:, 0].any() and not payload[:, 2].any()


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_select_matches_reference_exactly(summary, search, device):
    kp, _, table, _ = _case(torch.float32, seed=3)
    summ = _all_summaries(kp, table, summary)
    seq, pos = _rows()
    q = _q(len(ROWS), seed=4)
    _assert_tie_free(q, summ, table, seq, pos)
    scratch = torch.full((len(ROWS), Hkv, 100), float("nan"), device=device)
    got = _select(q, summ, table, seq, pos, summary, device, scratch=scratch)
    scratch = scratch.cpu()
    want = qsa_select_ref(q, summ, table, seq, pos, B, TOP_K, SINK, LOCAL, summary,
                          torch.full_like(got, SENTINEL_SEL))
    assert torch.equal(got, want)
    sparse = pos >= DENSE
    assert (got[~sparse] == SENTINEL_SEL).all()  # dense rows untouched
    nblk = (pos[sparse] // B + 1).long()
    s = got[sparse].long()
    assert (s.diff(dim=-1) > 0).all() and (s[:, :, -1] == (nblk - 1)[:, None]).all()
    # the scores the kernel kept are the float32 formula's
    r = 0
    t = table[int(seq[r])].long()
    first = torch.arange(SINK, int(pos[r]) // B + 1 - LOCAL) * B
    sm = summ[t[first // PAGE], (first % PAGE) // B]
    want_s = torch.einsum("hgd,nhd->hn", q[r].view(Hkv, G, D), sm[:, 0])
    if summary == "minmax":
        want_s = want_s + torch.einsum("hgd,nhd->hn", q[r].view(Hkv, G, D).abs(), sm[:, 1])
    torch.testing.assert_close(scratch[r, :, SINK : SINK + len(first)], want_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_select_ties_go_to_the_earlier_block(summary, search, device):
    """Blocks of identical keys have identical summaries and scores. Every block of sequence 0's
    scored range is w_b * v (v per KV head; q's heads are v, so the score grows with w_b):
    three blocks at w = 3, a dozen at w = 2 and the rest at w = 1, so the top 5 are the three
    w = 3 blocks and the two EARLIEST w = 2 blocks; sequence 1 is one block repeated (all
    scores tied: the first top_k blocks)."""
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(Hkv, D, generator=gen)
    L0 = 300
    w = torch.ones(L0 // B)
    w[[60, 17, 44]] = 3.0
    w[[50, 9, 63, 30, 22, 57, 38, 12, 70, 41, 25, 33]] = 2.0
    k0 = w.repeat_interleave(B)[:, None, None] * v
    k1 = torch.randn(B, Hkv, D, generator=gen).repeat(150 // B + 1, 1, 1)[:150]
    kp, _, table, _ = _case(torch.float32, seed=6, lens=[L0, 150], keys=[k0, k1])
    summ = _all_summaries(kp, table, summary, lens=[L0, 150])
    seq, pos = _rows([(0, 299), (0, 287), (1, 149), (1, 60)])
    q = v.repeat_interleave(G, 0)[None].expand(4, -1, -1).contiguous()
    got = _select(q, summ, table, seq, pos, summary, device)
    want = qsa_select_ref(q, summ, table, seq, pos, B, TOP_K, SINK, LOCAL, summary,
                          torch.full_like(got, SENTINEL_SEL))
    assert torch.equal(got, want)
    for h in range(Hkv):
        assert got[0, h].tolist() == [0, 9, 12, 17, 44, 60, 73, 74]
        assert got[1, h].tolist() == [0, 9, 12, 17, 44, 60, 70, 71]  # (blocks 70, 71 are local here)
        assert got[2, h].tolist() == [0, 1, 2, 3, 4, 5, 36, 37]
        assert got[3, h].tolist() == [0, 1, 2, 3, 4, 5, 14, 15]


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_select_many_ties_and_signs_exactly(summary, search, device):
    """Small-integer keys and queries: every score is exact in float32 whatever the summation
    order (so the kernel's and the reference's are the same numbers), with many ties, negative
    scores and zeros: the selection is exactly the stable sort's."""
    gen = torch.Generator().manual_seed(19)
    keys = [torch.randint(-2, 3, (n, Hkv, D), generator=gen).float() for n in LENS]
    kp, _, table, _ = _case(torch.float32, seed=20, keys=keys)
    summ = _all_summaries(kp, table, summary)
    seq, pos = _rows()
    q = torch.randint(-1, 2, (len(ROWS), Hkv * G, D), generator=gen).float()
    q[4] = 0.0  # a row whose scores are all zero (+0 and -0): the first top_k blocks
    got = _select(q, summ, table, seq, pos, summary, device)
    want = qsa_select_ref(q, summ, table, seq, pos, B, TOP_K, SINK, LOCAL, summary,
                          torch.full_like(got, SENTINEL_SEL))
    assert torch.equal(got, want)
    assert got[4, 0].tolist() == got[4, 1].tolist() == [0, 1, 2, 3, 4, 5, 24, 25]


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_select_rows_are_batch_invariant(summary, device):
    """A row's selection is the same alone, in the batch, in the reversed batch, and with a
    larger scratch (more score programs)."""
    kp, _, table, _ = _case(torch.float32, seed=7)
    summ = _all_summaries(kp, table, summary)
    seq, pos = _rows()
    q = _q(len(ROWS), seed=8)
    whole = _select(q, summ, table, seq, pos, summary, device)
    rev = torch.arange(len(ROWS) - 1, -1, -1)
    assert torch.equal(_select(q[rev], summ, table, seq[rev], pos[rev], summary, device), whole[rev])
    big = torch.empty(len(ROWS), Hkv, 700)
    assert torch.equal(_select(q, summ, table, seq, pos, summary, device, scratch=big), whole)
    for r in range(len(ROWS)):
        s = slice(r, r + 1)
        assert torch.equal(_select(q[s], summ, table, seq[s], pos[s], summary, device), whole[s]), f"row {r}"


@pytest.mark.parametrize("split", [8, 16, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_attention_matches_reference(summary, dtype, split, device):
    """Selection then attention over the kept blocks, against the float64 reference over the
    same blocks; unwritten cache entries are NaN and never enter; dense rows untouched. split
    8 / 16: 4 / 2 partial programs per row and KV head (the default: one; 8-entry key tiles
    are too narrow for tl.dot, so not on a GPU)."""
    if split == 8 and device.type == "cuda":
        pytest.skip("tl.dot needs key tiles of 16 or more")
    kp, vp, table, _ = _case(dtype, seed=9)
    summ = _all_summaries(kp, table, summary)
    seq, pos = _rows()
    q = _q(len(ROWS), seed=10)
    sel = _select(q, summ, table, seq, pos, summary, device)
    got = _attend(q, kp, vp, table, seq, pos, sel, device, split=split)
    want = qsa_attention_ref(q, kp, vp, table, seq, pos, sel, B, SCALE, torch.full(q.shape, SENTINEL_OUT))
    torch.testing.assert_close(got, want, **TOL)
    sparse = pos >= DENSE
    assert (got[~sparse] == SENTINEL_OUT).all()
    assert not torch.isnan(got).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_are_batch_invariant(dtype, device):
    """A row's attention is bitwise the same alone, in the batch, in the reversed batch, and
    with the fused combine (counters, left zero for the next call)."""
    kp, vp, table, _ = _case(dtype, seed=11)
    summ = _all_summaries(kp, table, "mean")
    seq, pos = _rows()
    q = _q(len(ROWS), seed=12)
    sel = _select(q, summ, table, seq, pos, "mean", device)
    whole = _attend(q, kp, vp, table, seq, pos, sel, device, split=16)
    rev = torch.arange(len(ROWS) - 1, -1, -1)
    assert torch.equal(_attend(q[rev], kp, vp, table, seq[rev], pos[rev], sel[rev], device, split=16), whole[rev])
    for r in range(len(ROWS)):
        s = slice(r, r + 1)
        one = _attend(q[s], kp, vp, table, seq[s], pos[s], sel[s], device, split=16)
        assert torch.equal(one, whole[s]), f"row {r}"
    counters = torch.zeros(2 * len(ROWS) * Hkv, dtype=torch.int32, device=device)
    ws = qsa_attention_workspace(*_on(device, q, kp), KEPT, B, split=16)
    for _ in range(2):
        fused = _attend(q, kp, vp, table, seq, pos, sel, device, split=16, counters=counters, workspace=ws)
        assert torch.equal(fused, whole)
        assert not counters.any()


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_kernels_end_to_end_match_the_definition(summary, device):
    """Summaries written by the kernel for every position, then selection and attention,
    against workbench.sparse_attention.qsa_ref (the float64 definition of one row)."""
    from workbench.qsa import QSAConfig
    from workbench.sparse_attention import qsa_ref

    cfg = QSAConfig(block=B, top_k=TOP_K, sink_blocks=SINK, local_blocks=LOCAL, summary=summary)
    assert cfg.dense_positions == DENSE
    lens = [300, 150]
    kp, vp, table, seqs = _case(torch.float32, seed=13, lens=lens)
    all_seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]).int()
    all_pos = torch.cat([torch.arange(n) for n in lens]).int()
    summ = torch.full(_summ_shape(kp, summary), float("nan"), device=device)
    summ = qsa_summaries(*_on(device, kp, table, all_seq, all_pos), B, summary, summ).cpu()
    rows = [(0, 299), (1, 149), (0, 150), (1, 40)]
    seq, pos = _rows(rows)
    q = _q(len(rows), seed=14)
    _assert_tie_free(q, summ, table, seq, pos)
    sel = _select(q, summ, table, seq, pos, summary, device)
    got = _attend(q, kp, vp, table, seq, pos, sel, device, split=16)
    for r, (s, p) in enumerate(rows):
        k, v = seqs[s]
        torch.testing.assert_close(got[r], qsa_ref(q[r], k, v, p, cfg, SCALE), **TOL)


def test_attention_dot_form_and_bf16_products(device):
    """The tl.dot form (the GPU default; under the interpreter numpy's product) within float32
    tolerance; precision="bf16" (a bfloat16 engine's) within bfloat16 tolerance, rows invariant."""
    kp, vp, table, _ = _case(torch.bfloat16, seed=15)
    summ = _all_summaries(kp, table, "mean")
    seq, pos = _rows()
    q = _q(len(ROWS), seed=16)
    sel = _select(q, summ, table, seq, pos, "mean", device)
    want = qsa_attention_ref(q, kp, vp, table, seq, pos, sel, B, SCALE, torch.full(q.shape, SENTINEL_OUT))
    torch.testing.assert_close(_attend(q, kp, vp, table, seq, pos, sel, device, split=16, use_dot=True), want, **TOL)
    bf = _attend(q, kp, vp, table, seq, pos, sel, device, split=16, precision="bf16")
    torch.testing.assert_close(bf, want, rtol=1.6e-2, atol=1e-2)
    one = _attend(q[:1], kp, vp, table, seq[:1], pos[:1], sel[:1], device, split=16, precision="bf16")
    assert torch.equal(one, bf[:1])


def test_qsa_rejects_bad_inputs():
    kp, vp, table, _ = _case(torch.float32, seed=17, lens=[64])
    seq, pos = _rows([(0, 40)])
    q = _q(1, seed=18)
    summ = torch.zeros(_summ_shape(kp, "mean"))
    with pytest.raises(ValueError, match="power of two"):
        qsa_summaries(kp, table, seq, pos, 3, "mean", summ)
    with pytest.raises(ValueError, match="summary="):
        qsa_summaries(kp, table, seq, pos, B, "max", summ)
    with pytest.raises(ValueError, match="summ must be float32"):
        qsa_summaries(kp, table, seq, pos, B, "minmax", summ)
    with pytest.raises(ValueError, match="sel must be int32"):
        qsa_select(q, summ, table, seq, pos, B, TOP_K, SINK, LOCAL, "mean", torch.zeros(1, Hkv, KEPT))
    sel = torch.zeros(1, Hkv, KEPT, dtype=torch.int32)
    with pytest.raises(ValueError, match="pos must lie below"):
        qsa_select(q, summ, table, seq, pos, B, TOP_K, SINK, LOCAL, "mean", sel, scratch=torch.empty(1, Hkv, 8))
    with pytest.raises(ValueError, match="dense_positions"):
        qsa_attention(q, kp, vp, table, seq, pos, sel, B, SCALE, torch.empty_like(q), DENSE + 4)
    with pytest.raises(ValueError, match="workspace"):
        qsa_attention(q, kp, vp, table, seq, pos, sel, B, SCALE, torch.empty_like(q),
                      workspace=qsa_attention_workspace(q, kp, KEPT, B, split=8))
