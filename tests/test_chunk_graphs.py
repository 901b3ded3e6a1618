"""Chunk graphs (`triton_graphs.StepGraphs.chunk`): prefill chunks and mixed steps of up to
`TritonOptions.chunk_graph_rows` rows replay a graph per (row bucket, sampled-row bucket,
attention-segment bucket), and give bitwise the eager forward's logits and greedy tokens.

One scenario drives two runners over the same pages (same allocator calls, so the same page
ids): the graph path (CUDA graphs, or under the interpreter the same path replayed eagerly) and
the eager one. Its steps cover the shapes the padding has to get right: a chunk that samples no
row, rows padded to a bucket, a chunk crossing into a new page beside another sequence's first
chunk, decode rows beside a prefill chunk (a mixed step), more sampled rows than the row bucket
(the sampled-row input padded past the rows), and a forward above the largest graphed bucket
(eager on both). Each pool is poisoned with NaN, so a padded row reading or writing anything but
the scratch page would show. The graphs captured are asserted, so the test cannot pass with the
chunk graphs unused.
"""

from __future__ import annotations

import pytest
import torch

from workbench.engine_config import ConfigError
from workbench.runners.direct_pages import DirectPages
from workbench.runners.triton_options import CHUNK_BUCKETS, TritonOptions
from workbench.runners.triton_runner import TritonRunner

GRAPHS = True if torch.cuda.is_available() else "emulate"
P = 64  # positions per page: the first sequence crosses into its second page in step 2


def _scenario(r: TritonRunner, toks: list[int]) -> list[dict]:
    pages = DirectPages(r, tokens_per_group=24 * P)
    r.kv.poison()
    ctx = {sl: 4 * P for sl in range(20)}
    greedy = frozenset({0, 3, 5})  # these slots' rows come back as tokens, the rest as logits
    seg = pages.segment
    steps = [
        # 20 rows, none sampled (bucket 24; the head on one row, its result dropped)
        [seg(0, "a", toks[:20], 0, samples=False)],
        # 50 rows across a's page boundary beside b's first 9 rows, both sampled (bucket 64, sampled 2)
        [seg(0, "a", toks[20:70], 20), seg(1, "b", toks[100:109], 0)],
        # a mixed step: two decode rows beside c's 5-row prompt (bucket 8, 3 sampled: bucket 4)
        [seg(0, "a", (toks[70],), 70), seg(1, "b", (toks[109],), 9), seg(2, "c", toks[120:125], 0)],
        # 14 one-token prompts, not sampled (bucket 16)
        [seg(3 + i, f"d{i}", (toks[130 + i],), 0, samples=False) for i in range(14)],
        # 17 sampled rows in 18 (bucket 24): the sampled-row input (bucket 32) runs past the rows
        [seg(0, "a", (toks[71],), 71), seg(1, "b", (toks[110],), 10), seg(2, "c", toks[125:127], 5)]
        + [seg(3 + i, f"d{i}", (toks[150 + i],), 1) for i in range(14)],
        # 65 rows: above chunk_graph_rows=64 below, so eager on both runners
        [seg(0, "a", toks[72:137], 72)],
    ]
    out = []
    for forward in steps:
        got = r.run(forward, ctx, argmax=greedy)
        out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in got.items()})
    return out


def test_chunk_graphs_give_the_eager_bits(tiny_model):
    m = tiny_model("llama", "float32", "Q8_0", n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
    toks = torch.randint(4, m.config.vocab_size, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    graphed = TritonRunner(m, 4 * P, TritonOptions(graphs=GRAPHS, page_size=P, chunk_graph_rows=64))
    eager = TritonRunner(m, 4 * P, TritonOptions(graphs=False, page_size=P))
    got, want = _scenario(graphed, toks), _scenario(eager, toks)
    assert eager.graphs is None
    assert [sorted(s) for s in got] == [sorted(s) for s in want] == [
        [], [0, 1], [0, 1, 2], [], list(range(17)), [0]]
    for g, w in zip(got, want):
        for slot, v in w.items():
            if isinstance(v, torch.Tensor):
                assert torch.isfinite(v).all()
                assert torch.equal(g[slot], v), slot
            else:
                assert isinstance(g[slot], int) and g[slot] == v, slot
    # every chunk step but the last took a graph: (row bucket, sampled bucket, 64-key segments)
    assert graphed.graphs.chunk_keys == [(8, 4, 2), (16, 1, 1), (24, 1, 1), (24, 32, 2), (64, 2, 2)]
    assert graphed.graphs.keys == []  # (no step was a pure decode step)


@pytest.mark.parametrize("rows", [-1, 7, 100, 1024, True])
def test_chunk_graph_rows_is_checked(rows):
    with pytest.raises(ConfigError) as e:
        TritonOptions(chunk_graph_rows=rows)
    assert str(e.value) == (f"chunk_graph_rows={rows!r} is not allowed: allowed 0 (off) or one of "
                            + ", ".join(map(str, CHUNK_BUCKETS)))


def _verify_steps(r: TritonRunner, toks: list[int]) -> list[dict]:
    """Prompts of three sequences, then verify-shaped forwards (every row scored): three slots
    of 3 rows, then of 1 / 5 / 2 rows, then one slot of 2 rows."""
    pages = DirectPages(r, tokens_per_group=12 * P)
    r.kv.poison()
    ctx = {sl: 4 * P for sl in range(3)}
    seg = pages.segment
    out = []
    steps = [[seg(sl, f"s{sl}", toks[40 * sl : 40 * sl + 30], 0) for sl in range(3)],
             [seg(sl, f"s{sl}", toks[40 * sl + 30 : 40 * sl + 33], 30, scored=3) for sl in range(3)],
             [seg(sl, f"s{sl}", toks[40 * sl + 33 : 40 * sl + 33 + n], 33, scored=n) for sl, n in enumerate((1, 5, 2))],
             [seg(0, "s0", toks[34:36], 34, scored=2)]]
    for forward in steps:
        got = r.run(forward, ctx, argmax=frozenset())
        out.append({k: v.clone() for k, v in got.items()})
    return out


@pytest.mark.parametrize("family", [True, False])
def test_a_verify_captures_its_family_up_front_with_the_same_bits(tiny_model, family):
    """The first all-scored forward at a segment bucket captures the chunk graph of every verify
    row count from its segment count up (a later verify of fewer segments extends it down), so a
    draft length that changes captures nothing new; logits bitwise the eager runner's either way."""
    m = tiny_model("llama", "float32", "Q8_0", n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
    toks = torch.randint(4, m.config.vocab_size, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    graphed = TritonRunner(m, 4 * P, TritonOptions(graphs=GRAPHS, page_size=P, chunk_graph_rows=64,
                                                   verify_graph_family=family))
    eager = TritonRunner(m, 4 * P, TritonOptions(graphs=False, page_size=P))
    got, want = _verify_steps(graphed, toks), _verify_steps(eager, toks)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for slot, v in w.items():
            assert torch.isfinite(v).all() and torch.equal(g[slot], v), slot
    # (the prompts' 90-row chunk is above chunk_graph_rows: eager; every position is below 64:
    # one 64-key segment)
    keys = graphed.graphs.chunk_keys
    if family:
        # rows 4..64 for the first verify's three segments, then 2..3 for the 1-slot one
        assert keys == [(8, 2, 1), (8, 4, 1), (8, 8, 1), (16, 16, 1), (24, 32, 1), (32, 32, 1),
                        (48, 64, 1), (64, 64, 1)], keys
    else:
        assert keys == [(8, 2, 1), (8, 8, 1), (16, 16, 1)], keys


def _cohorts(r: TritonRunner, toks: list[int], launch: bool) -> list[dict]:
    """Four sequences' prompts (80 rows: eager), then two rounds of two cohorts' verifies (slots
    0-1 and 2-3, 3 rows each: the same chunk graph), greedy tokens for slots 1 and 3, logits for
    0 and 2. With `launch`, each round's two verifies are launched back to back and their
    results asked for afterwards (round one B first, round two A first); else each is `run`."""
    pages = DirectPages(r, tokens_per_group=12 * P)
    r.kv.poison()
    ctx = {sl: 4 * P for sl in range(4)}
    seg = pages.segment
    greedy = frozenset({1, 3})
    prompts = [seg(sl, f"s{sl}", toks[40 * sl : 40 * sl + 20], 0) for sl in range(4)]
    first = r.launch(prompts, ctx, greedy) if launch else None  # (eager: answered at once)
    out = [first.result() if launch else r.run(prompts, ctx, greedy)]
    for rnd, at in enumerate((20, 23)):
        a, b = ([seg(sl, f"s{sl}", toks[40 * sl + at : 40 * sl + at + 3], at, scored=3) for sl in cohort]
                for cohort in ((0, 1), (2, 3)))
        if launch:
            la, lb = r.launch(a, ctx, greedy), r.launch(b, ctx, greedy)
            got = (lb.result(), la.result()) if rnd == 0 else (la.result(), lb.result())
            out += sorted(got, key=lambda d: min(d))
        else:
            out += [r.run(a, ctx, greedy), r.run(b, ctx, greedy)]
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()} for d in out]


def test_launches_in_flight_keep_their_own_answers(tiny_model):
    """TritonRunner.launch (a cohort's step enqueued while the host prepares another's): two
    verifies launched back to back over the same chunk graph, whose outputs the second replay
    overwrites, then asked for in either order, answer bitwise what `run` gives each; a forward
    that is no chunk graph's runs at once and answers the same."""
    m = tiny_model("llama", "float32", "Q8_0", n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
    toks = torch.randint(4, m.config.vocab_size, (200,), generator=torch.Generator().manual_seed(7)).tolist()
    opts = TritonOptions(graphs=GRAPHS, page_size=P, chunk_graph_rows=64, verify_graph_family=False)
    launched, ran = TritonRunner(m, 4 * P, opts), TritonRunner(m, 4 * P, opts)
    got, want = _cohorts(launched, toks, True), _cohorts(ran, toks, False)
    assert [sorted(d) for d in got] == [sorted(d) for d in want] == [[0, 1, 2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]
    for g, w in zip(got, want):
        for slot, v in w.items():
            if slot in (1, 3):
                assert isinstance(g[slot], (int, tuple)) and g[slot] == v, slot
            else:
                assert torch.isfinite(v).all() and torch.equal(g[slot], v), slot
    assert launched.graphs.chunk_keys == [(8, 8, 1)]  # (both cohorts' verifies: one graph)


def test_the_torch_runner_launches_by_running(tiny_model):
    """TorchRunner.launch: the forward runs at once and its answer is `run`'s (the engine may
    launch on either runner)."""
    from workbench.runner import TorchRunner

    m = tiny_model("llama", "float32", "Q8_0", n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
    toks = list(range(4, 30))
    outs = []
    for launch in (True, False):
        r = TorchRunner(m, 4 * P)
        pages = DirectPages(r, tokens_per_group=4 * P)
        fwd = [pages.segment(0, "a", toks[:20], 0)]
        outs.append(r.launch(fwd, {0: 4 * P}).result() if launch else r.run(fwd, {0: 4 * P}))
        fwd = [pages.segment(0, "a", toks[20:23], 20, scored=3)]
        outs.append(r.launch(fwd, {0: 4 * P}).result() if launch else r.run(fwd, {0: 4 * P}))
    for g, w in zip(outs[:2], outs[2:]):
        assert sorted(g) == sorted(w) == [0] and torch.equal(g[0], w[0])
    assert outs[1][0].shape[0] == 3
