"""Token trees (issue 21, SpecConfig.tree): a slot verifies its main draft and alternative paths
in one forward, each path on its own fork of the slot's pages, and keeps the path that keeps
the most; output stays bitwise speculation-off's, tokens and logits, greedy and seeded, on
both runners. Every test asserts that an alternative path ran (and, where it is the point,
won), so none can pass with chains alone."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.errors import ConfigError, WorkbenchError
from workbench.spec import SpecConfig
from workbench.spec.proposers import NgramProposer, SuffixProposer, tree_paths
from workbench.state import KVGroup, PageAllocator, StateLayout

from engine_drive import serve_arrivals
from test_paged_engine import _no_page_left, _reference, _same
from test_speculation import TRITON_GRAPHS, _engine, _ids, _refs, _run, _triton


class TreeOracle:
    """A tree whose main draft is wrong from `wrong_from` on and whose second path is the
    reference continuation; a third path is wrong from its first token. Only the second path
    can keep more than `wrong_from` tokens."""

    name = "tree-oracle"

    def __init__(self, refs, wrong_from=0, vocab=390):
        self.refs, self.wrong_from, self.vocab = refs, wrong_from, vocab
        self.prompts = {}

    def start(self, rid, prompt_ids):
        self.prompts[rid] = tuple(prompt_ids)

    def _right(self, rid, context, k):
        p = self.prompts[rid]
        done = len(context) - len(p)
        return list(self.refs[p][done : done + k])

    def propose(self, rid, context, k):
        d = self._right(rid, context, k)
        return tuple(t if i < self.wrong_from else (t + 1) % self.vocab for i, t in enumerate(d))

    def propose_tree(self, rid, context, k, budget):
        right = self._right(rid, context, k)
        wrong = [(t + 2) % self.vocab for t in right]
        return tree_paths([self.propose(rid, context, k), right, wrong], k, budget, 8)

    def finish(self, rid, context, num_prompt):
        self.prompts.pop(rid)


def _oracle(prompts, refs, **kw):
    return TreeOracle({tuple(p): r[0] for p, r in zip(prompts, refs)}, **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_right_alternative_wins_and_the_output_is_bitwise_ar(tiny_model, temperature):
    m = tiny_model()
    prompts = [_ids(n, s) for n, s in ((9, 1), (23, 2), (5, 3))]
    refs = _refs(m, prompts, 17, temperature, seed=7)
    e = _engine(m, 3, SpecConfig(k=4, tree=12, guard=False), _oracle(prompts, refs, wrong_from=1))
    out = _run(e, prompts, 17, temperature, seed=7)
    for r, ref in zip(out, refs):
        _same(r, ref)
        # every verify: the second path (the reference) won, kept whole
        assert r.spec.tree_wins == r.spec.verify_steps > 0 and r.spec.tree_paths == 2 * r.spec.verify_steps
        assert r.spec.hist[4] >= 3 and r.spec.drafted == r.spec.accepted
    steps = e.telemetry.steps()
    assert steps["tree_paths"].sum() == sum(r.spec.tree_paths for r in out)
    assert steps["tree_rows"].sum() == sum(r.spec.tree_tokens + r.spec.tree_paths for r in out)
    _no_page_left(e)


@pytest.mark.parametrize("n,proposer,temperature", [(1, "ngram", 0.0), (4, "ngram", 0.0)])
def test_ngram_trees_at_any_concurrency_are_bitwise_ar(tiny_model, n, proposer, temperature):
    m = tiny_model()
    # repeated blocks with a changed token in each copy, so a suffix recurs with several continuations
    prompts = []
    for i in range(n):
        base = _ids(40 + 9 * i, 10 + i, period=4 + i % 3)
        prompts.append([t if j % 11 else (t + 7) % 390 for j, t in enumerate(base)])
    max_tokens = [14 + 3 * (i % 3) for i in range(n)]
    refs = _refs(m, prompts, max_tokens, temperature, seed=11)
    e = _engine(m, n, SpecConfig(proposer=proposer, k=3, tree=9, guard=False))
    out = _run(e, prompts, max_tokens, temperature, seed=11)
    for r, ref in zip(out, refs):
        _same(r, ref)
    assert sum(r.spec.tree_paths for r in out) > 0
    _no_page_left(e)


def test_a_stop_token_inside_a_winning_alternative_ends_the_request_there(tiny_model):
    m = tiny_model()
    prompt = _ids(10, 11)
    ref = _reference(m, prompt, 12)[0]
    stop = ref[5]
    first = ref.index(stop)
    e = _engine(m, 1, SpecConfig(k=4, tree=8, guard=False), TreeOracle({tuple(prompt): ref}))
    e.stop_ids = (stop,)
    r = e.submit(prompt, max_tokens=12).result()
    assert r.token_ids == ref[: first + 1] and r.finish_reason == "eos"
    assert r.spec.tree_wins >= 1
    _no_page_left(e)


def test_a_cancel_with_a_tree_planned_frees_its_forks_and_leaves_the_others_exact(tiny_model):
    m = tiny_model()
    prompts = [_ids(n, 20 + n, period=4) for n in (9, 15, 21)]
    refs = _refs(m, prompts, 30)
    e = _engine(m, 3, SpecConfig(k=3, tree=6, guard=False), _oracle(prompts, refs, wrong_from=1))
    hs = [e.submit(p, max_tokens=30, index=i, ignore_eos=True) for i, p in enumerate(prompts)]
    for _ in range(3):
        e.step()
    plan = e.scheduler.schedule(e._step_index, e._drafts(), e.speculator.branches)
    assert plan.branches  # forks were made for the planned trees ...
    hs[1].cancel()  # ... and are freed with the discarded plan
    e.run_until_done()
    assert hs[1].result().finish_reason == "cancelled"
    for i in (0, 2):
        _same(hs[i].result(), refs[i])
        assert hs[i].result().spec.tree_wins > 0
    _no_page_left(e)


def test_trees_under_a_small_pool_give_way_and_stay_exact(tiny_model):
    """Short of pages, alternatives are dropped before any draft or decode row is (and requests
    are preempted as without trees): exact either way."""
    m = tiny_model()
    prompts = [_ids(200 + 40 * i, 30 + i, period=5) for i in range(3)]
    refs = _refs(m, prompts, 40)
    e = _engine(m, 3, SpecConfig(k=4, tree=12, guard=False), _oracle(prompts, refs, wrong_from=1),
                kv_resident_tokens=768)
    out = _run(e, prompts, 40)
    for r, ref in zip(out, refs):
        _same(r, ref)
    assert sum(r.spec.tree_wins for r in out) > 0
    # some verifies ran their main draft alone (no pages for the forks) or were preempted
    assert sum(r.num_preemptions for r in out) > 0 or any(
        r.spec.tree_paths < 2 * r.spec.verify_steps for r in out)
    _no_page_left(e)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_soak_trees_with_arrivals_cancels_preemptions_and_prefix_hits(tiny_model, data):
    """Random arrivals, cancels, pools small enough to preempt, the prefix cache on or off,
    greedy and seeded requests, n-gram trees of random budgets: every request that finishes is
    bitwise its reference, and no page or fork is left behind."""
    m = tiny_model()
    n_slots = data.draw(st.integers(1, 4))
    k = data.draw(st.integers(1, 4))
    spec = SpecConfig(k=k, tree=data.draw(st.integers(k + 1, 3 * k + 2)), guard=data.draw(st.booleans()),
                      measure_cost=False)
    e = _engine(m, n_slots, spec, kv_resident_tokens=256 * data.draw(st.integers(2, 5)),
                prefix_cache=data.draw(st.booleans()), chunk_size=data.draw(st.sampled_from([None, 16])))
    shared = _ids(120, 77, period=6)
    specs = []
    for i in range(data.draw(st.integers(1, 6))):
        n = data.draw(st.integers(2, 110))
        base = shared[:n] if data.draw(st.booleans()) else _ids(n, 500 + i, period=data.draw(st.integers(3, 7)))
        prompt = [t if j % 5 else (t + i + 1) % 390 for j, t in enumerate(base)] + [4 + i]
        specs.append((prompt, data.draw(st.integers(1, 40)), data.draw(st.sampled_from([0.0, 0.8]))))
    arrive = [data.draw(st.integers(0, 6)) for _ in specs]
    cancel_at = [data.draw(st.one_of(st.none(), st.integers(0, 20))) for _ in specs]

    def submit(i):
        prompt, mt, temp = specs[i]
        return e.submit(prompt, max_tokens=mt, temperature=temp, top_k=40 if temp else None, seed=3, index=i,
                        ignore_eos=True)

    handles = serve_arrivals(e, submit, arrive, cancel_at, 300, after_cancel=e.scheduler.allocator.check)
    for i, h in handles.items():
        r = h.result()
        if r.finish_reason != "cancelled":
            prompt, mt, temp = specs[i]
            _same(r, _reference(m, prompt, mt, temp, 3, i))
    _no_page_left(e)


def test_the_tree_guard_drops_alternatives_that_never_win_and_keeps_those_that_do(tiny_model):
    """Guard on: a tree whose main draft is right and whose alternatives are wrong branches for
    a trial window, then drafts chains for a growing wait; one whose right path is an
    alternative keeps branching. Both outputs are bitwise AR."""
    m = tiny_model()
    prompts = [_ids(12, 90)]
    refs = _refs(m, prompts, 60)
    spec = SpecConfig(k=3, tree=9, guard=True, row_cost=0.1, measure_cost=False)
    never = TreeOracle({tuple(prompts[0]): refs[0][0]}, wrong_from=99)  # (main right: alternatives never win)
    [r] = _run(_engine(m, 1, spec, never), prompts, 60)
    _same(r, refs[0])
    assert r.spec.tree_wins == 0 and 0 < r.spec.tree_paths <= 2 * (4 + 4) and r.spec.verify_steps >= 12
    [w] = _run(_engine(m, 1, spec, _oracle(prompts, refs, wrong_from=1)), prompts, 60)
    _same(w, refs[0])
    assert w.spec.tree_wins == w.spec.verify_steps > 10


def test_tree_guard_units():
    from workbench.spec.guard import TreeGuard

    g = TreeGuard(trials=2, wait=3, wait_max=6)
    seen = []
    for _ in range(16):
        ok = g.allows("r")
        seen.append(ok)
        if ok:
            g.observe("r", rows=4, gained=0, cost=0.1)
    # 2 trials, 3 chains, 2 trials, 6 chains, 2 trials, then 6 again (at wait_max)
    assert seen == [True] * 2 + [False] * 3 + [True] * 2 + [False] * 6 + [True] * 2 + [False]
    g = TreeGuard(trials=2)
    for _ in range(6):
        assert g.allows("w")
        g.observe("w", rows=4, gained=1, cost=0.1)  # 1 token per 4 rows > 0.1: it pays
    assert TreeGuard(enabled=False).allows("x")


def test_tree_paths_proposals_and_adoption_units():
    assert tree_paths([(1, 2, 3), (1, 2), (4, 5, 6), (), (7,)], k=2, budget=5, most=8) == ((1, 2), (4, 5), (7,))
    assert tree_paths([(1, 2, 3), (4, 5, 6)], k=3, budget=4, most=8) == ((1, 2, 3), (4,))
    assert tree_paths([(1,), (2,), (3,)], k=3, budget=9, most=2) == ((1,), (2,))
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3, 7, 7, 1, 2, 3]
    ng = NgramProposer(4, 2, tree=True)
    ng.start(0, ctx)
    assert ng.propose_tree(0, ctx, 3, 9) == ((7, 7, 1), (8, 5, 1), (9, 1, 2))
    assert ng.propose_tree(0, ctx, 3, 9)[0] == ng.propose(0, ctx, 3)
    su = SuffixProposer(8, 2)
    su.start(0, ctx)
    assert su.propose_tree(0, ctx, 3, 9)[0] == su.propose(0, ctx, 3) and len(su.propose_tree(0, ctx, 3, 9)) == 3
    # adopt: the fork's pages become the parent's, the parent's own tail is freed
    alloc = PageAllocator(StateLayout((KVGroup("g", (0,), 0, 8),), 4, key_blocks=(4,)), {"g": 16})
    alloc.add("a")
    alloc.append("a", 6)
    alloc.commit("a", [1, 2, 3, 4, 5, 6])
    alloc.fork("a", "b", 6)
    alloc.append("b", 3)
    alloc.append("a", 2)
    mine = alloc.block_table("b", "g").ids()
    alloc.adopt("a", "b")
    assert alloc.block_table("a", "g").ids() == mine and alloc.sequence("a").length == 9 and "b" not in alloc
    alloc.check()
    with pytest.raises(WorkbenchError):
        alloc.adopt("a", "b")  # (b is gone)


def test_tree_bad_input_is_refused_in_one_line():
    for kw, word in (({"k": 4, "tree": 4}, r"allowed None \(a linear chain\) or a node budget 5\.\.128"),
                     ({"k": 2, "tree": 129}, "3..128"), ({"tree": True}, "node budget"),
                     ({"tree": 8, "verify": "rejection"}, "allowed verify='exact'")):
        with pytest.raises(ConfigError, match=word) as err:
            SpecConfig(**kw)
        assert "\n" not in str(err.value)


# ---- the Triton runner (the interpreter here, natively on the device) -------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_triton_tree_paths_are_bitwise_its_decode_steps(tiny_model, temperature):
    """Three slots, each with a three-path tree whose second path is right: the winning forks'
    KV carries every later step, and tokens and logits are plain decoding's on the same runner,
    each request alone (sliding window 8, so forks drop and share sliding pages too)."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=8)
    prompts = [_ids(n, 60 + n, vocab=m.config.vocab_size) for n in (5, 11, 3)]
    kw = dict(max_tokens=9, temperature=temperature, seed=5, ignore_eos=True)
    solo_eng = _triton(m, 1, graphs=False)
    solo = [solo_eng.submit(p, index=i, **kw).result() for i, p in enumerate(prompts)]
    oracle = TreeOracle({tuple(p): s.token_ids for p, s in zip(prompts, solo)}, wrong_from=1,
                        vocab=m.config.vocab_size)
    e = _triton(m, 3, SpecConfig(k=3, tree=9, guard=False), oracle)
    out = e.generate(prompts, **kw)
    for r, s in zip(out, solo):
        assert r.token_ids == s.token_ids and torch.equal(r.logits, s.logits)
        assert r.spec.tree_wins > 0
    _no_page_left(e)
    if TRITON_GRAPHS:
        assert any(sel > 1 for _, sel, _ in e.runner.graphs.chunk_keys)


def test_bench_spec_tree_rows_carry_the_tree_and_bad_budgets_are_one_line(tiny_gguf, tmp_path, capsys):
    import polars as pl

    from workbench.cli import main

    base = ["bench", "--model", str(tiny_gguf("llama")), "--concurrency", "2", "--prompt-len", "24", "--gen", "8",
            "--data-dir", str(tmp_path), "--no-progress", "--spec", "ngram", "--spec-k", "3", "--no-spec-guard"]
    assert main([*base, "--spec-tree", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculation tree=3 is out of range" in err[0] and "4..128" in err[0]
    assert main([*base, "--spec-tree", "9"]) == 0
    [summary] = list(tmp_path.glob("runs/*/summary.parquet"))
    row = pl.read_parquet(summary).row(0, named=True)
    assert row["speculation"] == "ngram:k3+tree9+noguard"
    # the activation proof: a tree that never branched is flagged, one that did is not
    flagged = row["flag"] is not None and "token trees asked" in row["flag"]
    assert flagged == (row["spec_verify_steps"] > 0 and row["spec_tree_paths"] == 0)
