"""QSA sparse attention on the torch path (issue 22): the indexer against a naive reference,
bitwise dense up to the boundary, one function of a row's own sequence above it (chunking,
batching, permutations, crossing the boundary mid-generation, paging, prefix hits,
speculation), and one-line errors for bad options.

The reference of an engine run is the model's teacher-forced logits with QSA on
(`Model.logits(prompt + tokens, qsa=...)`, one prefill in chunks of 512): a decoded row must be
bitwise the prefill row at its position, which is the chunk-invariant meaning QSA has here
(every row selects for itself, workbench/qsa.py). Every test asserts the sparse path ran."""

import random

import pytest
import torch

import workbench
from workbench.errors import ConfigError, WorkbenchError
from workbench.model import Segment
from workbench.qsa import QSAConfig
from workbench.sparse_attention import QSAIndex, qsa_ref
from workbench.state import KVGroup, StateLayout

SMALL = QSAConfig(block=4, top_k=4, sink_blocks=1, local_blocks=1)  # boundary: 24 positions
QUEST = QSAConfig(block=8, top_k=3, sink_blocks=0, local_blocks=2, summary="minmax")  # 40


def _ids(n, seed, vocab=390):
    rnd = random.Random(seed)
    return [rnd.randrange(4, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma(tiny_model):
    """Six layers, the last one global (Gemma 3's pattern), float32."""
    return tiny_model("gemma3", "float32", n_layers=6)


def _engine(m, n, qsa=SMALL, **kw):
    kw.setdefault("admission_headroom_tokens", 0)
    return workbench.Engine(m, workbench.EngineConfig(max_concurrency=n, dtype=m.dtype_name, qsa=qsa, **kw),
                            keep_logits=True)


def _teacher(m, prompt, tokens, qsa):
    return m.logits(list(prompt) + list(tokens[:-1]), qsa=qsa)[len(prompt) - 1:]


def _sparse_rows(e) -> int:
    return int(e.telemetry.steps()["qsa_sparse_rows"].sum())


# -- the indexer and the sparse row against the definition --------------------------------------

@pytest.mark.parametrize("cfg", [SMALL, QUEST, QSAConfig(block=1, top_k=9, sink_blocks=2, local_blocks=3)])
def test_sparse_rows_match_a_naive_float64_reference_through_scattered_pages(cfg):
    torch.manual_seed(0)
    hkv, g, d, length = 2, 2, 16, 700
    layout = StateLayout((KVGroup("global", (0,), 0, 1),))
    num_pages = 5
    table = torch.tensor([3, 0, 4])  # scattered pages: positions 0..767
    index = QSAIndex(cfg, (0,), layout, {"global": num_pages}, hkv, d)
    kc = torch.full((num_pages, hkv, d, 256), float("nan"))  # unwritten positions are NaN
    vc = torch.full((num_pages, hkv, 256, d), float("nan"))
    keys, values = torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    q = torch.randn(length, hkv * g, d)
    pos = torch.arange(length)
    page, off = table[pos // 256], pos % 256
    # written in uneven chunks, as a prefill and decodes would: summaries complete across them
    start = 0
    for n in (5, 250, 1, 3, 300, 141):
        p = pos[start : start + n]
        kc[page[p], :, :, off[p]] = keys[p]
        vc[page[p], :, off[p], :] = values[p]
        index.update(0, kc, table, start, n)
        start += n
    assert start == length
    rows = torch.tensor([0, 7, cfg.dense_positions - 1, cfg.dense_positions, 333, 512, length - 1])
    out = index.attend(0, q[rows], kc, vc, rows, 0.25, table)
    for r, p in enumerate(rows.tolist()):
        ref = qsa_ref(q[p], keys[: p + 1], values[: p + 1], p, cfg, 0.25)
        torch.testing.assert_close(out[r], ref, rtol=1e-4, atol=1e-5)
    stats = index.read_stats()
    assert stats["sparse_rows"] == 4 and stats["dense_rows"] == 3
    assert stats["blocks_kept"] == 4 * hkv * cfg.kept_blocks < stats["blocks_scored"] + 4 * hkv * (cfg.sink_blocks + cfg.local_blocks)


# -- exactness --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("cfg", [SMALL, QUEST])
def test_dense_up_to_the_boundary_and_chunk_invariant_above(tiny_model, arch, cfg):
    m = tiny_model(arch, "float32", n_layers=6 if arch == "gemma3" else 2)
    ids = _ids(150, 1)
    dense = m.logits(ids)
    state = m.new_state(len(ids), cfg)
    whole = m.forward([Segment(state, ids, "all")])[0]
    b = cfg.dense_positions
    assert torch.equal(whole[:b], dense[:b])  # bitwise dense up to the boundary
    assert not torch.equal(whole[b:], dense[b:])  # and sparse past it
    stats = state.pages.index.read_stats()
    n_qsa = len(cfg.resolve_layers(m.config))
    assert stats["sparse_rows"] == n_qsa * (len(ids) - b) and stats["dense_rows"] == n_qsa * b
    for chunk in (1, 7, 64):
        assert torch.equal(m.logits(ids, chunk=chunk, qsa=cfg), whole), chunk


def test_summaries_do_not_depend_on_how_the_blocks_were_written(gemma):
    ids = _ids(90, 2)
    a, b = gemma.new_state(len(ids), QUEST), gemma.new_state(len(ids), QUEST)
    gemma.forward([Segment(a, ids, "none")])
    for i in range(0, len(ids), 3):  # a prefill of 3s, then the decodes' single rows
        gemma.forward([Segment(b, ids[i : i + 3], "none")])
    nb = len(ids) // QUEST.block
    for name, t in a.pages.index.summ.items():
        assert torch.equal(t[0, :, :nb], b.pages.index.summ[name][0, :, :nb])


@pytest.mark.parametrize("cfg", [SMALL, QUEST])
def test_batched_decode_past_the_boundary_is_solo_and_crosses_it_mid_generation(gemma, cfg):
    """Mixed lengths: 10 and 20 start below the boundary and cross it while decoding, 70 and 150
    start past it. Four together, in two orders, and each alone: tokens and logits bitwise, and
    each equals the teacher-forced QSA logits of its own tokens."""
    prompts = [_ids(n, i) for i, n in enumerate([10, 20, 70, 150])]
    e = _engine(gemma, 4, cfg)
    batched = e.generate(prompts, max_tokens=40, ignore_eos=True)
    assert _sparse_rows(e) > 0
    steps = e.telemetry.steps()
    assert (steps["decode_rows"] >= 3).any()
    e2 = _engine(gemma, 4, cfg)
    rev = e2.generate(prompts[::-1], max_tokens=40, ignore_eos=True)[::-1]
    for i, p in enumerate(prompts):
        solo = _engine(gemma, 1, cfg).generate([p], max_tokens=40, ignore_eos=True)[0]
        for r in (batched[i], rev[i]):
            assert r.token_ids == solo.token_ids
            assert torch.equal(r.logits, solo.logits)
        assert torch.equal(solo.logits, _teacher(gemma, p, solo.token_ids, cfg))
    assert len(prompts[0]) < cfg.dense_positions < len(prompts[0]) + 40  # the crossing happened


def test_seeded_sampling_with_qsa_is_solo(gemma):
    prompts = [_ids(n, 10 + i) for i, n in enumerate([30, 60, 90])]
    kw = dict(max_tokens=30, temperature=0.9, top_k=40, seed=5, ignore_eos=True)
    batched = _engine(gemma, 3).generate(prompts, **kw)
    for i, p in enumerate(prompts):
        e = _engine(gemma, 1)
        solo = e.submit(p, index=i, **kw)
        e.run_until_done()
        assert solo.result().token_ids == batched[i].token_ids
        assert torch.equal(solo.result().logits, batched[i].logits)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_paging_out_and_in_keeps_the_indexer(gemma, preemption):
    """Four requests of two pages each on a four-page pool: swapped (pages and their summaries
    to host and back) or recomputed (re-prefilled rows select as their decodes did)."""
    prompts = [_ids(100 + 40 * i, 20 + i) for i in range(4)]
    e = _engine(gemma, 4, kv_resident_tokens=4 * 256, kv_host_tokens=16 * 256, preemption=preemption,
                residency_quantum=8, chunk_size=64)
    rs = e.generate(prompts, max_tokens=200, ignore_eos=True)
    if preemption == "swap":
        assert sum(r.num_swaps for r in rs) > 0
    else:
        assert sum(r.num_preemptions for r in rs) > 0
    assert _sparse_rows(e) > 0
    for p, r in zip(prompts, rs):
        assert torch.equal(r.logits, _teacher(gemma, p, r.token_ids, SMALL))


def test_prefix_cache_hits_share_summaries(gemma):
    shared = _ids(300, 30)  # one full page shared
    prompts = [shared + _ids(20, 31 + i) for i in range(3)]
    e = _engine(gemma, 1)
    rs = e.generate(prompts, max_tokens=20, ignore_eos=True)
    assert sum(r.cached_tokens for r in rs) >= 2 * 256
    for p, r in zip(prompts, rs):
        assert torch.equal(r.logits, _teacher(gemma, p, r.token_ids, SMALL))


def test_speculation_with_qsa_is_bitwise_speculation_off(gemma):
    """Verify rows select their own blocks as decode rows would (a verify is a prefill chunk)."""
    rep = _ids(12, 40) * 12  # repeats: n-gram drafts get accepted
    prompts = [rep[:70], rep[5:100], _ids(60, 41)]
    off = _engine(gemma, 3).generate(prompts, max_tokens=40, ignore_eos=True)
    e = _engine(gemma, 3, speculation=workbench.SpecConfig(proposer="ngram", k=4, guard=False))
    on = e.generate(prompts, max_tokens=40, ignore_eos=True)
    assert e.telemetry.steps()["accepted_tokens"].sum() > 0 and _sparse_rows(e) > 0
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)


def test_a_cancel_mid_run_leaves_the_others_exact(gemma):
    prompts = [_ids(n, 50 + i) for i, n in enumerate([40, 80, 120])]
    e = _engine(gemma, 3)
    hs = [e.submit(p, max_tokens=30, ignore_eos=True) for p in prompts]
    for _ in range(6):
        e.step()
    e.cancel(hs[1].request_id)
    e.run_until_done()
    for i in (0, 2):
        r = hs[i].result()
        assert torch.equal(r.logits, _teacher(gemma, prompts[i], r.token_ids, SMALL))
    assert e.scheduler.allocator.num_sequences == 0


def test_the_real_model_is_bitwise_dense_up_to_the_boundary(real_model_bf16):
    m = real_model_bf16
    cfg = QSAConfig(block=4, top_k=16, sink_blocks=1, local_blocks=2)  # boundary: 76 positions
    ids = m.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(ids) > cfg.dense_positions + 20
    dense, sparse = m.logits(ids), m.logits(ids, qsa=cfg)
    b = cfg.dense_positions
    assert torch.equal(sparse[:b], dense[:b]) and not torch.equal(sparse[b:], dense[b:])
    assert torch.equal(m.logits(ids, chunk=13, qsa=cfg), sparse)


# -- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(block=3), "qsa block=3 is not allowed: allowed 1, 2, 4, 8, 16, 32, 64, 128, 256 (a divisor of the 256-position page)"),
    (dict(top_k=0), "qsa top_k=0 is out of range: allowed 1..16384"),
    (dict(top_k=2.5), "qsa top_k=2.5 is not an integer: allowed 1..16384"),
    (dict(local_blocks=0), "qsa local_blocks=0 is out of range: allowed 1..4096"),
    (dict(sink_blocks=-1), "qsa sink_blocks=-1 is out of range: allowed 0..4096"),
    (dict(layers="sliding"), "qsa layers='sliding' is not allowed: allowed 'global' or a tuple of full-attention layer indices"),
    (dict(layers=()), "qsa layers=() is not allowed: allowed 'global' or a non-empty tuple of distinct full-attention layer indices"),
    (dict(summary="max"), "qsa summary='max' is not allowed: allowed mean, minmax"),
])
def test_bad_options_get_one_line_errors(kw, message):
    with pytest.raises(ConfigError) as err:
        QSAConfig(**kw)
    assert str(err.value) == message


def test_qsa_is_refused_where_it_cannot_run(tiny_model, gemma):
    # QSA runs on both runners, so the config itself carries it on either backend
    assert workbench.EngineConfig(qsa=SMALL, backend="triton").qsa == SMALL
    with pytest.raises(WorkbenchError, match=r"^QSA needs full-attention layers and this model has none .*allowed qsa=None for it$"):
        _engine(tiny_model("gemma3", "float32", n_layers=3), 1)
    with pytest.raises(WorkbenchError, match=r"^qsa layers=\(2,\): layer\(s\) \[2\] are not full-attention layers of this model: allowed a subset of \[5\]$"):
        _engine(gemma, 1, QSAConfig(layers=(2,)))
    cfg = workbench.EngineConfig(qsa=QSAConfig(layers=(5,), summary="minmax"))
    assert workbench.EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_the_cli_form_parses_and_refuses_in_one_line():
    assert QSAConfig.parse("on") == QSAConfig()
    cfg = QSAConfig.parse("top_k=256,block=8,summary=minmax,layers=5+11")
    assert cfg == QSAConfig(top_k=256, block=8, summary="minmax", layers=(5, 11))
    assert cfg.text() == "top_k=256,block=8,layers=5+11,summary=minmax"
    assert QSAConfig.parse(QSAConfig(sink_blocks=2).text()) == QSAConfig(sink_blocks=2)
    for text, message in [("k=4", "qsa option 'k=4' is not allowed: allowed 'on' or NAME=VALUE with NAME one of "
                                   "block, top_k, layers, sink_blocks, local_blocks, summary"),
                          ("top_k=many", "qsa top_k='many' is not an integer: allowed an integer")]:
        with pytest.raises(ConfigError) as err:
            QSAConfig.parse(text)
        assert str(err.value) == message


def test_bench_flags_a_qsa_run_that_never_went_sparse():
    from workbench.bench import activation_flag

    flag = activation_flag({"qsa_sparse_rows": 0}, prefix_cache=True, shared_prefix_len=0, qsa_boundary=2056)
    assert flag == ("QSA asked, but no row attended sparsely (every context stayed within its boundary of 2056 "
                    "positions: raise --prompt-len or lower top_k)")
    assert activation_flag({"qsa_sparse_rows": 9}, prefix_cache=True, shared_prefix_len=0, qsa_boundary=2056) is None


# -- the Triton runner (the interpreter here, natively on the H200: scripts/gpu_run.sh) ----------------

TINY_QSA = QSAConfig(block=2, top_k=3, sink_blocks=1, local_blocks=1)  # boundary: 10 positions


def _triton(m, n, qsa=TINY_QSA, graphs=None, max_context=64, **kw):
    from workbench.runners.triton_options import TritonOptions

    if graphs is None:
        graphs = True if torch.cuda.is_available() else "emulate"
    cfg = workbench.EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=n, max_context=max_context,
                                 memory_budget_bytes=1 << 30, chunk_size=8, qsa=qsa, admission_headroom_tokens=0,
                                 triton=TritonOptions(graphs=graphs, page_size=64), **kw)
    e = workbench.Engine(m, cfg, keep_logits=True)
    e.runner.kv.poison()  # (NaN in every page and summary: a read before a write shows)
    return e


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    """Every layer global, two KV heads: the kernels' head loop and every layer sparse."""
    return tiny_model("llama", "float32", "Q8_0", n_layers=2, n_embd=64, n_heads=4, n_kv_heads=2, n_ff=128)


def test_triton_qsa_is_dense_below_the_boundary_and_solo_above_it(tiny_llama):
    """Three requests (4 and 7 tokens cross the boundary while decoding, 20 start past it) in
    graphed steps (chunk and decode graphs, emulated on the CPU): each bitwise its own run alone
    on eager steps, and bitwise the dense Triton run's rows below the boundary."""
    m = tiny_llama
    prompts = [_ids(n, 80 + n, vocab=m.config.vocab_size) for n in (4, 7, 20)]
    kw = dict(max_tokens=9, ignore_eos=True)
    e = _triton(m, 3)
    got = e.generate(prompts, **kw)
    steps = e.telemetry.steps()
    assert steps["qsa_sparse_rows"].sum() > 0 and steps["qsa_dense_rows"].sum() > 0
    dense = _triton(m, 3, qsa=None).generate(prompts, **kw)
    b = TINY_QSA.dense_positions
    for p, r, d in zip(prompts, got, dense):
        solo = _triton(m, 1, graphs=False).generate([p], **kw)[0]
        assert r.token_ids == solo.token_ids and torch.equal(r.logits, solo.logits)
        below = max(0, b - len(p) + 1)  # rows sampled at positions < b
        assert torch.equal(r.logits[:below], d.logits[:below])
        if below < len(r.logits):
            assert not torch.equal(r.logits[below:], d.logits[below:])
    # the same function as the torch path's, to the kernels' rounding
    ref = _engine(m, 3, TINY_QSA).generate(prompts, **kw)
    for r, t in zip(got, ref):
        assert r.token_ids == t.token_ids
        torch.testing.assert_close(r.logits, t.logits, rtol=1e-4, atol=1e-4)


def test_triton_qsa_summaries_travel_with_swapped_pages(tiny_llama):
    """tests/test_residency.py's menu on a two-page pool: the 62-token request grows into its
    second page and the newest is paged out, its pages and their summaries to host and back."""
    m = tiny_llama
    prompts = [_ids(n, 90 + n, vocab=m.config.vocab_size) for n in (62, 12, 5)]
    kw = dict(max_tokens=6, ignore_eos=True)
    e = _triton(m, 3, max_context=256, kv_resident_tokens=2 * 64, kv_host_tokens=8 * 64, residency_quantum=2)
    got = e.generate(prompts, **kw)
    assert sum(r.num_swaps for r in got) > 0 and e.telemetry.steps()["qsa_sparse_rows"].sum() > 0
    for p, r in zip(prompts, got):
        solo = _triton(m, 1, graphs=False, max_context=256).generate([p], **kw)[0]
        assert r.token_ids == solo.token_ids and torch.equal(r.logits, solo.logits)
