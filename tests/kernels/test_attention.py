import pytest
import torch

from workbench.kernels import attention as attention_mod
from workbench.kernels.attention import (
    attention_rows,
    decode_attention,
    decode_attention_ref,
    prefill_attention,
    prefill_attention_ref,
)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _randn(*shape, dtype=torch.float32, device="cpu", gen):
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def _poison_beyond(cache, lens):
    """NaN in every cache position a row must not read (>= its length)."""
    cache = cache.clone()
    for b, n in enumerate(lens.tolist()):
        cache[b, n:] = float("nan")
    return cache


def _decode_case(B, Hq, Hkv, D, L, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = _randn(B, Hq, D, dtype=dtype, device=device, gen=gen)
    lens = torch.randint(1, L + 1, (B,), generator=gen)
    lens[0], lens[-1] = 1, L
    k = _poison_beyond(_randn(B, L, Hkv, D, dtype=dtype, device=device, gen=gen), lens)
    v = _poison_beyond(_randn(B, L, Hkv, D, dtype=dtype, device=device, gen=gen), lens)
    window = torch.tensor([(0, 16, 37)[b % 3] for b in range(B)])
    return q, k, v, lens.to(device), window.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 32), (3, 1, 24), (2, 2, 64)])
def test_decode_matches_reference(Hq, Hkv, D, dtype, device):
    q, k, v, lens, window = _decode_case(5, Hq, Hkv, D, 77, dtype, device, seed=D + Hq)
    out = torch.full_like(q, float("nan"))
    o = decode_attention(q, k, v, lens, window, D**-0.5, out=out)
    assert o is out
    torch.testing.assert_close(o, decode_attention_ref(q, k, v, lens, window, D**-0.5), **TOL[dtype])


def test_decode_gemma_shape(device):
    """Gemma 3 270M: 4 q heads on 1 kv head, head dim 256, sliding window and global rows."""
    q, k, v, lens, window = _decode_case(3, 4, 1, 256, 40, torch.float32, device, seed=1)
    window = torch.tensor([0, 24, 0], device=device)
    o = decode_attention(q, k, v, lens, window, 256**-0.5)
    torch.testing.assert_close(o, decode_attention_ref(q, k, v, lens, window, 256**-0.5), **TOL[torch.float32])


def test_decode_dot_form_matches_reference(device):
    """The tl.dot form (the GPU default), multi-segment, checked for accuracy on any device."""
    q, k, v, lens, window = _decode_case(3, 4, 2, 32, 77, torch.float32, device, seed=8)
    o = decode_attention(q, k, v, lens, window, 0.2, use_dot=True, segment=32)
    torch.testing.assert_close(o, decode_attention_ref(q, k, v, lens, window, 0.2), **TOL[torch.float32])


def test_decode_rows_are_batch_invariant(device):
    q, k, v, lens, window = _decode_case(5, 4, 2, 32, 77, torch.float32, device, seed=5)
    o = decode_attention(q, k, v, lens, window, 0.2)
    for b in range(5):
        s = slice(b, b + 1)
        assert torch.equal(o[s], decode_attention(q[s], k[s], v[s], lens[s], window[s], 0.2)), f"row {b}"


@pytest.mark.parametrize("window,segment", [(0, None), (24, None), (0, 32), (40, 32)])
def test_prefill_chunking_is_invariant_and_equals_decode(window, segment, device):
    """Any chunking of a prefill gives bitwise the same rows, and each row is bitwise the decode
    attention at that position (same kernels: same segments, key blocks and order). segment=32
    splits the 70 keys over 3 partial programs per row (the default: one)."""
    L, Hq, Hkv, D, scale = 70, 4, 1, 32, 0.17
    gen = torch.Generator().manual_seed(11 + window)
    q = _randn(L, Hq, D, device=device, gen=gen)
    k = _randn(L, Hkv, D, device=device, gen=gen)
    v = _randn(L, Hkv, D, device=device, gen=gen)

    def run(chunks):
        out, start = [], 0
        for c in chunks:
            kc, vc = k.clone(), v.clone()  # the cache holds only positions < start + c
            kc[start + c :], vc[start + c :] = float("nan"), float("nan")
            out.append(prefill_attention(q[start : start + c], kc, vc, start, window, scale, segment=segment))
            start += c
        assert start == L
        return torch.cat(out)

    whole = run([L])
    torch.testing.assert_close(whole, prefill_attention_ref(q, k, v, 0, window, scale), **TOL[torch.float32])
    for chunks in ([10] * 7, [33, 37], [1, 16, 5, 48], [1] * 9 + [61]):
        assert torch.equal(run(chunks), whole), chunks

    lens = torch.arange(1, L + 1, device=device)
    dec = decode_attention(q, k.expand(L, L, Hkv, D), v.expand(L, L, Hkv, D), lens,
                           torch.full((L,), window, device=device), scale, segment=segment)
    assert torch.equal(dec, whole)


def test_attention_rows_mixes_decode_and_prefill(device):
    """One launch over rows of different sequences equals the per-sequence calls."""
    gen = torch.Generator().manual_seed(2)
    S, L, Hq, Hkv, D = 3, 50, 2, 1, 16
    k = _randn(S, L, Hkv, D, device=device, gen=gen)
    v = _randn(S, L, Hkv, D, device=device, gen=gen)
    q = _randn(6, Hq, D, device=device, gen=gen)
    row_seq = torch.tensor([2, 0, 0, 0, 1, 2], device=device)
    row_pos = torch.tensor([49, 10, 11, 12, 0, 20], device=device)
    row_win = torch.tensor([8, 0, 0, 0, 0, 8], device=device)
    o = attention_rows(q, k, v, row_seq, row_pos, row_win, 0.25)
    assert torch.equal(o[1:4], prefill_attention(q[1:4], k[0], v[0], 10, 0, 0.25))
    for r in (0, 4, 5):
        s = slice(r, r + 1)
        assert torch.equal(o[s], attention_rows(q[s], k, v, row_seq[s], row_pos[s], row_win[s], 0.25))


def test_attention_rejects_bad_inputs(device):
    q = torch.randn(2, 3, 16, device=device)
    k = torch.randn(2, 10, 2, 16, device=device)
    lens = torch.tensor([3, 4], device=device)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, k, k, lens, torch.zeros_like(lens), 1.0)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="row_pos"):
            decode_attention(q[:, :2], k, k, torch.tensor([3, 11]), torch.zeros(2, dtype=torch.int64), 1.0)


@pytest.mark.parametrize("segment", [32, 64])
def test_fused_combine_equals_two_launches(segment, device):
    """With caller-owned counters the last partial program of a row merges the row (one launch):
    bitwise the two-launch result, rows spanning 1..4 segments with and without a window, and
    the counters are left zero, so the same buffer serves the next call (twice here)."""
    gen = torch.Generator().manual_seed(4)
    S, L, Hq, Hkv, D = 2, 130, 4, 2, 32
    k = _randn(S, L, Hkv, D, device=device, gen=gen)
    v = _randn(S, L, Hkv, D, device=device, gen=gen)
    q = _randn(5, Hq, D, device=device, gen=gen)
    row_seq = torch.tensor([0, 1, 1, 0, 1], device=device)
    row_pos = torch.tensor([129, 3, 70, 64, 127], device=device)
    row_win = torch.tensor([0, 0, 40, 16, 0], device=device)
    two = attention_rows(q, k, v, row_seq, row_pos, row_win, 0.3, segment=segment)
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    for _ in range(2):
        one = attention_rows(q, k, v, row_seq, row_pos, row_win, 0.3,
                             out=torch.full_like(q, float("nan")), counters=counters, segment=segment)
        assert torch.equal(one, two)
        assert not counters.any()
    with pytest.raises(ValueError, match="counters must be int32"):
        attention_rows(q, k, v, row_seq, row_pos, row_win, 0.3, counters=counters[:4])


@pytest.mark.parametrize("use_dot", [False, True])
def test_bf16_products_close_and_rows_invariant(use_dot, device):
    """precision="bf16" (a bfloat16 engine's attention): single bf16 products, close to the
    float32 reference at bfloat16 tolerance, a row in a batch bitwise the row alone, several
    segments per row. (The tl.dot form on a GPU only: the interpreter's tl.dot has no bfloat16.)"""
    if use_dot and device.type != "cuda":
        pytest.skip("bfloat16 tl.dot needs a GPU")
    q, k, v, lens, window = _decode_case(4, 4, 1, 64, 77, torch.bfloat16, device, seed=21)
    q = q.float()
    seq = torch.arange(4, device=device, dtype=torch.int32)
    pos = (lens - 1).to(torch.int32)
    win = window.to(torch.int32)
    o = attention_rows(q, k, v, seq, pos, win, 0.125, use_dot=use_dot, precision="bf16", segment=32)
    torch.testing.assert_close(o, decode_attention_ref(q, k, v, lens, window, 0.125), **TOL[torch.bfloat16])
    for b in (0, 3):
        s = slice(b, b + 1)
        one = attention_rows(q[s], k, v, seq[s], pos[s], win[s], 0.125, use_dot=use_dot, precision="bf16",
                             segment=32)
        assert torch.equal(one, o[s]), f"row {b}"
    with pytest.raises(ValueError, match="precision="):
        attention_rows(q, k, v, seq, pos, win, 0.125, precision="fp8")


@pytest.mark.parametrize("norm,segment", [(True, 64), (False, 64), (True, 32), (False, 32)])
def test_rope_prologue_is_the_separate_kernel(norm, segment, device):
    """attention_rows(rope=): QK-norm + rope + the KV write as every attention program's
    prologue (one launch) instead of step_fused.qk_rope_kv before it: q, the pools and the
    output bitwise the two-launch form's, rows of distinct slots at several segments (a window
    starting inside one, a position at a segment's start); refused without the fused combine.
    32-key segments are one 32-key block here (the runner's case: 64-key segments of one block
    at D = 256): the segment's older K/V rows are loaded before the prologue and the current row
    read back, the same bits; 64-key segments are two blocks, loaded after the prologue."""
    from workbench.kernels.attention import RopePrologue
    from workbench.kernels.step_fused import qk_rope_kv

    preload = attention_mod._attention_config(16, 32, 2, segment)[0] == segment  # (one block per segment)
    assert preload == (segment == 32)
    gen = torch.Generator().manual_seed(12)
    R, Hq, Hkv, D, S, L, splits = 3, 4, 2, 32, 4, 96, 2
    part = torch.randn(splits, R, (Hq + 2 * Hkv) * D, generator=gen).to(device)
    kp = _randn(S, L, Hkv, D, dtype=torch.bfloat16, device=device, gen=gen)
    vp = _randn(S, L, Hkv, D, dtype=torch.bfloat16, device=device, gen=gen)
    seq = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([70, 0, 33] if not preload else [64, 0, 33], dtype=torch.int32, device=device)
    win = torch.tensor([0, 0, 16], dtype=torch.int32, device=device)
    inv = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    qn = torch.randn(D, generator=gen).to(device) if norm else None
    kn = torch.randn(D, generator=gen).to(device) if norm else None
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    got = {}
    for fused in (False, True):
        q = torch.full((R, Hq, D), float("nan"), device=device)
        k, v = kp.clone(), vp.clone()
        if fused:
            o = attention_rows(q, k, v, seq, pos, win, 0.2, counters=counters, precision="bf16",
                               rope=RopePrologue(part, qn, kn, inv, 1e-6), segment=segment)
        else:
            qk_rope_kv(part, q, k, v, seq, pos, qn, kn, inv, 1e-6)
            o = attention_rows(q, k, v, seq, pos, win, 0.2, counters=counters, precision="bf16", segment=segment)
        got[fused] = (q, k, v, o)
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
    assert not counters.any()
    with pytest.raises(ValueError, match="rope prologue needs the fused combine"):
        attention_rows(got[True][0], kp, vp, seq, pos, win, 0.2, rope=RopePrologue(part, qn, kn, inv, 1e-6))


def test_keys_per_block_follow_shape_kv_size_and_segment():
    """Keys per block: by padded head dim and K/V element size (bf16 pools at D = 256 take 64,
    float32 ones 16: their shared memory), never more than the segment; a segment that is not a
    multiple of the block is refused."""
    from workbench.kernels.attention import _attention_config

    assert _attention_config(16, 256, 2, 64)[0] == 64 and _attention_config(16, 256, 4, 64)[0] == 16
    assert _attention_config(16, 256, 2, 32)[0] == 32 and _attention_config(16, 64, 4, 32)[0] == 32
    with pytest.raises(ValueError, match="segment=24 must be a multiple of BLOCK_N"):
        _attention_config(16, 256, 4, 24)
    with pytest.raises(ValueError, match="head dim up to 512"):
        _attention_config(16, 1024, 2)


@pytest.mark.parametrize("segment", [32, 64])
def test_a_span_grid_is_bitwise_the_context_grid(segment, device):
    """attention_rows(span=): the grid as wide as the segments a row's keys can touch (each
    row's programs from its first segment) instead of one program per segment of the context:
    windows starting inside a segment and at one, positions near the start, the two-launch and
    the fused combine, and the rope prologue; bitwise the context-wide grid's output."""
    from workbench.kernels.attention import RopePrologue

    gen = torch.Generator().manual_seed(31)
    S, L, Hq, Hkv, D, W = 3, 320, 4, 2, 32, 40
    k = _randn(S, L, Hkv, D, device=device, gen=gen)
    v = _randn(S, L, Hkv, D, device=device, gen=gen)
    q = _randn(6, Hq, D, device=device, gen=gen)
    seq = torch.tensor([0, 1, 2, 0, 1, 2], device=device)
    pos = torch.tensor([319, 3, 200, 64, 255, 39], device=device)
    win = torch.full((6,), W, device=device)
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    for c in (None, counters):
        full = attention_rows(q, k, v, seq, pos, win, 0.3, segment=segment, counters=c)
        narrow = attention_rows(q, k, v, seq, pos, win, 0.3, segment=segment, counters=c, span=W,
                                out=torch.full_like(q, float("nan")))
        assert torch.equal(narrow, full)
    one = torch.ones(6, dtype=torch.int64, device=device)  # (QSA's sparse rows: one key)
    assert torch.equal(attention_rows(q, k, v, seq, pos, one, 0.3, segment=segment, span=1),
                       attention_rows(q, k, v, seq, pos, one, 0.3, segment=segment))
    # the rope prologue (a decode step: one row per slot)
    part = torch.randn(2, 3, (Hq + 2 * Hkv) * D, generator=gen).to(device)
    inv = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    p3, s3, w3 = pos[:3].to(torch.int32), seq[:3].to(torch.int32), win[:3].to(torch.int32)
    got = []
    for span in (None, W):
        qq = torch.full((3, Hq, D), float("nan"), device=device)
        kk, vv = kb.clone(), vb.clone()
        o = attention_rows(qq, kk, vv, s3, p3, w3, 0.2, counters=counters, precision="bf16", segment=segment,
                           rope=RopePrologue(part, None, None, inv, 1e-6), span=span)
        got.append((qq, kk, vv, o))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert not counters.any()


@pytest.mark.parametrize("span", [None, 40])
def test_segment_mass_is_each_pages_softmax_share(span, device):
    """attention_rows(mass=): each page's share of every row's and head's softmax (eviction
    "scored"), from the partials' (max, sum), through scattered pages, with a window (the span
    grid's relative slots too) and the fused combine; the output's bits unchanged."""
    gen = torch.Generator().manual_seed(41)
    P, W, Hq, Hkv, D = 64, 4, 4, 2, 32
    pages = _randn(9, P, Hkv, D, device=device, gen=gen), _randn(9, P, Hkv, D, device=device, gen=gen)
    table = torch.tensor([[3, 7, 0, 5], [8, 1, 2, 6]], dtype=torch.int32, device=device)
    seq = torch.tensor([0, 1, 0, 1, 1], device=device)
    pos = torch.tensor([255, 130, 70, 5, 200], device=device)
    win = torch.tensor([40] * 5 if span else [0, 0, 40, 40, 0], device=device)  # (span: every row within it)
    q = _randn(5, Hq, D, device=device, gen=gen)
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    for c in (None, counters):
        mass = torch.zeros(10, dtype=torch.float32, device=device)
        kw = dict(counters=c, block_table=table, span=span, segment=32)
        got = attention_rows(q, *pages, seq, pos, win, 0.3, mass=mass, **kw)
        assert torch.equal(got, attention_rows(q, *pages, seq, pos, win, 0.3, **kw))
        want = torch.zeros(10, dtype=torch.float64)
        for r in range(5):
            t = table[int(seq[r])].long().cpu()
            k = pages[0][t].reshape(W * P, Hkv, D).double().cpu().repeat_interleave(Hq // Hkv, 1)
            hi = int(pos[r]) + 1
            lo = max(0, hi - int(win[r])) if int(win[r]) else 0
            p = (torch.einsum("hd,lhd->hl", q[r].double().cpu(), k[lo:hi]) * 0.3).softmax(-1).sum(0)  # [hi - lo]
            for j, key in enumerate(range(lo, hi)):
                want[t[key // P]] += p[j]
        assert torch.allclose(mass.double().cpu(), want, rtol=1e-4, atol=1e-5), (mass, want)
        assert abs(float(mass.sum()) - 5 * Hq) < 1e-4


@pytest.mark.parametrize("window,precision", [(0, None), (40, None), (40, "bf16")])
def test_rows_that_run_together_are_bitwise_each_row_alone(window, precision, device):
    """attention_rows(runs=True): consecutive rows of one sequence at consecutive positions (a
    verify's, a prefill chunk's) are computed RUN at a time by their run's first row's programs
    (4 here: 4 query heads a kv head fill a 16-row tile). Bitwise the rows computed one by one:
    runs of 1 to 9 rows, cut at positions that are multiples of RUN, interleaved with each other
    and with single rows, across segment and page edges, through scattered pages, with a window
    (and its span grid) and without, the two-launch and the fused combine; the cache NaN beyond
    every sequence's last row."""
    if precision == "bf16" and device.type == "cpu":
        pytest.skip("bf16 products: the tl.dot form only (the interpreter's tl.dot has no bfloat16)")
    gen = torch.Generator().manual_seed(53)
    P, W, Hq, Hkv, D = 32, 4, 8, 2, 32
    table = torch.tensor([[3, 7, 0, 5], [8, 1, 2, 6], [4, 9, 10, 11]], dtype=torch.int32, device=device)
    runs = [(0, 29, 9), (1, 2, 3), (2, 63, 1), (0, 38, 1), (1, 5, 4), (2, 64, 2), (1, 9, 1)]  # (seq, first pos, rows)
    seq = torch.tensor([s for s, _, n in runs for _ in range(n)], device=device)
    pos = torch.tensor([p + i for _, p, n in runs for i in range(n)], device=device)
    last = {s: p + n - 1 for s, p, n in runs}
    k, v = (_randn(12, P, Hkv, D, device=device, gen=gen) for _ in range(2))
    for s, p in last.items():  # NaN past each sequence's last position
        for key in range(p + 1, W * P):
            k[table[s, key // P], key % P] = float("nan")
            v[table[s, key // P], key % P] = float("nan")
    R = len(seq)
    q = _randn(R, Hq, D, device=device, gen=gen)
    win = torch.full((R,), window, device=device)
    counters = torch.zeros(R * Hkv, dtype=torch.int32, device=device)
    for c in (None, counters):
        kw = dict(block_table=table, segment=32, counters=c, precision=precision, span=window or None)
        alone = attention_rows(q, k, v, seq, pos, win, 0.3, **kw)
        assert not alone.isnan().any()
        together = attention_rows(q, k, v, seq, pos, win, 0.3, runs=True, out=torch.full_like(q, float("nan")), **kw)
        assert torch.equal(together, alone)
        assert not counters.any()
