"""Speculative decoding across slots (issue 21), exact: with speculation on, every request's
tokens and logits are bitwise what it gives with speculation off, for every proposer, at any
concurrency, greedy and seeded sampling alike.

The reference is test_paged_engine's: the model run directly on a private contiguous cache, a
token at a time, sampled with the request's own per-position generator. Every test asserts a
counter (draft tokens kept or rejected, verify steps) so that it cannot pass without the
mechanism running."""

import random

import pytest
import torch

import workbench
from workbench.errors import ConfigError, WorkbenchError
from workbench.spec import SpecConfig

from test_paged_engine import _no_page_left, _reference, _same


def _ids(n, seed, vocab=390, period=None):
    """n token ids; with `period`, a block of `period` ids repeated (so n-grams recur)."""
    rnd = random.Random(seed)
    if period is None:
        return [rnd.randrange(4, vocab) for _ in range(n)]
    block = [rnd.randrange(4, vocab) for _ in range(period)]
    return (block * (n // period + 1))[:n]


class Oracle:
    """Proposes the reference continuation itself: every draft token is the target's."""

    name = "oracle"

    def __init__(self, refs, wrong_from=None):
        self.refs = refs  # prompt tuple -> reference tokens
        self.prompts = {}
        self.wrong_from = wrong_from  # draft index from which to propose a wrong token

    def start(self, rid, prompt_ids):
        self.prompts[rid] = tuple(prompt_ids)

    def propose(self, rid, context, k):
        p = self.prompts[rid]
        done = len(context) - len(p)
        d = list(self.refs[p][done : done + k])
        if self.wrong_from is not None:
            d = [t if i < self.wrong_from else (t + 1) % 390 for i, t in enumerate(d)]
        return tuple(d)

    def finish(self, rid, context, num_prompt):
        self.prompts.pop(rid)


class Adversary:
    """Proposes k tokens that are never the target's next one (its reference token + 1)."""

    name = "adversary"

    def __init__(self, refs):
        self.oracle = Oracle(refs, wrong_from=0)

    def start(self, rid, prompt_ids):
        self.oracle.start(rid, prompt_ids)

    def propose(self, rid, context, k):
        return self.oracle.propose(rid, context, k)

    def finish(self, rid, context, num_prompt):
        self.oracle.finish(rid, context, num_prompt)


def _engine(m, n, spec=None, proposer=None, **kw):
    kw.setdefault("admission_headroom_tokens", 0)
    cfg = workbench.EngineConfig(max_concurrency=n, dtype=m.dtype_name, speculation=spec, **kw)
    return workbench.Engine(m, cfg, keep_logits=True, proposer=proposer)


def _run(e, prompts, max_tokens, temperature=0.0, seed=None):
    hs = [e.submit(p, max_tokens=max_tokens[i] if isinstance(max_tokens, list) else max_tokens,
                   temperature=temperature, top_k=40 if temperature else None, seed=seed, index=i,
                   ignore_eos=True) for i, p in enumerate(prompts)]
    e.run_until_done()
    return [h.result() for h in hs]


def _refs(m, prompts, max_tokens, temperature=0.0, seed=None):
    return [_reference(m, p, max_tokens[i] if isinstance(max_tokens, list) else max_tokens, temperature, seed, i)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_oracle_draft_is_kept_whole_and_the_output_is_bitwise_ar(tiny_model, temperature):
    m = tiny_model()
    prompts = [_ids(n, s) for n, s in ((9, 1), (23, 2), (5, 3))]
    refs = _refs(m, prompts, 17, temperature, seed=7)
    e = _engine(m, 3, SpecConfig(k=4, guard=False), Oracle({tuple(p): r[0] for p, r in zip(prompts, refs)}))
    out = _run(e, prompts, 17, temperature, seed=7)
    for r, ref in zip(out, refs):
        _same(r, ref)
        # every draft kept: 16 tokens after the first, in bursts of 5 (4 kept + the target's own)
        assert r.spec.drafted == r.spec.accepted > 0
        assert r.spec.hist[4] >= 3 and r.spec.draft_yield > 4
    _no_page_left(e)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_always_wrong_draft_keeps_nothing_and_changes_nothing(tiny_model, temperature):
    m = tiny_model()
    prompts = [_ids(n, s) for n, s in ((12, 4), (30, 5))]
    refs = _refs(m, prompts, 11, temperature, seed=3)
    e = _engine(m, 2, SpecConfig(k=3, guard=False), Adversary({tuple(p): r[0] for p, r in zip(prompts, refs)}))
    out = _run(e, prompts, 11, temperature, seed=3)
    for r, ref in zip(out, refs):
        _same(r, ref)
        # (the last token has no room for a draft: 11 tokens, the first from the prefill)
        assert r.spec.accepted == 0 and r.spec.verify_steps == 9 and r.spec.draft_yield == 1.0
    _no_page_left(e)


def test_a_draft_wrong_midway_keeps_its_right_prefix(tiny_model):
    m = tiny_model()
    prompts = [_ids(14, 6)]
    refs = _refs(m, prompts, 15)
    e = _engine(m, 1, SpecConfig(k=4, guard=False), Oracle({tuple(prompts[0]): refs[0][0]}, wrong_from=2))
    [r] = _run(e, prompts, 15)
    _same(r, refs[0])
    assert r.spec.accepted == 2 * r.spec.verify_steps - r.spec.hist[1] - 2 * r.spec.hist[0]
    assert max(i for i, c in enumerate(r.spec.hist) if c) == 2  # never more than the right two


@pytest.mark.parametrize("n,proposer", [(1, "ngram"), (4, "ngram"), (8, "suffix"), (4, "suffix")])
def test_ngram_and_suffix_drafts_at_any_concurrency_are_bitwise_ar(tiny_model, n, proposer):
    m = tiny_model()
    # repeated blocks, so that n-grams recur; mixed lengths and max_tokens
    prompts = [_ids(8 + 7 * i, 10 + i, period=3 + i % 4) for i in range(n)]
    max_tokens = [9 + 3 * (i % 3) for i in range(n)]
    refs = _refs(m, prompts, max_tokens)
    e = _engine(m, n, SpecConfig(proposer=proposer, k=1 + n % 4, guard=False))
    out = _run(e, prompts, max_tokens)
    for r, ref in zip(out, refs):
        _same(r, ref)
    assert sum(r.spec.verify_steps for r in out) > 0
    _no_page_left(e)


def test_max_tokens_inside_a_burst_ends_it_there(tiny_model):
    m = tiny_model()
    prompts = [_ids(10, 8), _ids(20, 9)]
    refs = _refs(m, prompts, [6, 3])
    e = _engine(m, 2, SpecConfig(k=8, guard=False), Oracle({tuple(p): r[0] for p, r in zip(prompts, refs)}))
    out = _run(e, prompts, [6, 3])
    for r, ref in zip(out, refs):
        _same(r, ref)
        assert r.finish_reason == "max_tokens"
    # the draft was cut to what each may still emit: one burst after the first token
    assert [r.spec.drafted for r in out] == [4, 1]
    _no_page_left(e)


def test_a_stop_token_inside_an_accepted_burst_ends_the_request_there(tiny_model):
    m = tiny_model()
    prompt = _ids(10, 11)
    ref = _reference(m, prompt, 12)[0]
    stop = ref[5]  # the 6th token, inside the second burst of k=4
    first = ref.index(stop)
    e = _engine(m, 1, SpecConfig(k=4, guard=False), Oracle({tuple(prompt): ref}))
    e.stop_ids = (stop,)
    r = e.submit(prompt, max_tokens=12).result()
    assert r.token_ids == ref[: first + 1] and r.finish_reason == "eos"
    assert r.spec.verify_steps >= 1
    _no_page_left(e)


def test_a_cancel_between_verifies_leaves_the_others_exact(tiny_model):
    m = tiny_model()
    prompts = [_ids(n, 20 + n, period=4) for n in (9, 15, 21)]
    refs = _refs(m, prompts, 30)
    e = _engine(m, 3, SpecConfig(k=3, guard=False), Oracle({tuple(p): r[0] for p, r in zip(prompts, refs)}))
    hs = [e.submit(p, max_tokens=30, index=i, ignore_eos=True) for i, p in enumerate(prompts)]
    for _ in range(3):
        e.step()
    plan = e.scheduler.schedule(e._step_index, e._drafts())
    assert plan.drafts  # a verify was planned ...
    hs[1].cancel()  # ... and is discarded with the cancel
    e.run_until_done()
    assert hs[1].result().finish_reason == "cancelled"
    for i in (0, 2):
        _same(hs[i].result(), refs[i])
    _no_page_left(e)


def test_verify_under_a_small_pool_preempts_and_stays_exact(tiny_model):
    m = tiny_model()
    prompts = [_ids(200 + 40 * i, 30 + i, period=5) for i in range(3)]
    refs = _refs(m, prompts, 40)
    e = _engine(m, 3, SpecConfig(k=4, guard=False), Oracle({tuple(p): r[0] for p, r in zip(prompts, refs)}),
                kv_resident_tokens=768)
    out = _run(e, prompts, 40)
    for r, ref in zip(out, refs):
        _same(r, ref)
    assert sum(r.num_preemptions for r in out) > 0 and sum(r.spec.accepted for r in out) > 0
    _no_page_left(e)


def test_the_guard_turns_an_always_wrong_proposer_off(tiny_model):
    m = tiny_model()
    prompt = _ids(12, 40)
    ref = _reference(m, prompt, 40)
    # (a fixed row cost: the guard's decisions then do not depend on this machine's timing)
    e = _engine(m, 1, SpecConfig(k=4, guard=True, row_cost=0.2, measure_cost=False), Adversary({tuple(prompt): ref[0]}))
    [r] = _run(e, [prompt], 40)
    _same(r, ref)
    assert r.spec.guard_skips > r.spec.verify_steps > 0 and r.spec.accepted == 0
    assert r.spec.hist == [r.spec.verify_steps]  # (its probes included: one row each, never kept)


@pytest.mark.parametrize("k, min_emitted, decision", [(4, 6, "off"), (8, 6, "on"), (4, 5, "on")])
def test_seed_002s_cohort_rule_decides_on_the_first_verify_and_changes_no_bit(tiny_model, k, min_emitted, decision):
    """guard="cohort": every slot drafts k until the first verify step; an oracle then emits k + 1
    a request, so with fewer than 6 (k = 4) speculation is off for the rest of the run and with
    k = 8, or a threshold of 5, it stays on at k. Tokens and logits bitwise plain decoding's."""
    m = tiny_model()
    prompts = [_ids(n, s) for n, s in ((10, 60), (21, 61))]
    refs = _refs(m, prompts, 30)
    spec = SpecConfig(k=k, guard="cohort", cohort_min_emitted=min_emitted)
    e = _engine(m, 2, spec, Oracle({tuple(p): r[0] for p, r in zip(prompts, refs)}))
    out = _run(e, prompts, 30)
    for r, ref in zip(out, refs):
        _same(r, ref)
    assert e.speculator.guard.decision == decision
    if decision == "off":  # the sample was the only verify step; every later one plain decoding
        assert [r.spec.verify_steps for r in out] == [1, 1] and all(r.spec.guard_skips > 20 for r in out)
    else:  # every draft kept, k at a time, to the end
        assert all(r.spec.guard_skips == 0 and r.spec.accepted == r.spec.drafted >= 20 for r in out)
    _no_page_left(e)


def test_quiet_steps_change_no_bit_and_no_count(tiny_model, monkeypatch):
    """The guard holding the slots at k = 0, the engine takes quiet steps (speculator.py: the
    held decision reused in constant time): tokens and logits bitwise AR's, and every request's
    speculation counters those of deciding each step in full, with requests of mixed lengths
    finishing and being admitted on the way."""
    from workbench.spec.speculator import Speculator

    m = tiny_model()
    prompts = [_ids(8 + 9 * i, 60 + i, period=3 + i % 3) for i in range(5)]
    max_tokens = [30 + 7 * i for i in range(5)]
    refs = _refs(m, prompts, max_tokens)
    # (a fixed row cost at which the guard drafts only where its shadows kept nearly all: the
    # slots are held at k = 0 but for the shadows, whose checks and the probe cadence end quiet runs)
    spec = SpecConfig(k=4, guard=True, row_cost=0.9, measure_cost=False)
    quiet = _engine(m, 3, spec)
    taken = []
    real = Speculator._is_quiet
    monkeypatch.setattr(Speculator, "_is_quiet", lambda sp, rids, split: taken.append(real(sp, rids, split)) or taken[-1])
    out = _run(quiet, prompts, max_tokens)
    monkeypatch.setattr(Speculator, "_is_quiet", lambda sp, rids, split: False)
    full = _run(_engine(m, 3, spec), prompts, max_tokens)
    for r, f, ref in zip(out, full, refs):
        _same(r, ref)
        assert r.spec == f.spec
    assert sum(taken) > 50 and sum(r.spec.guard_skips for r in out) > 150
    assert sum(r.spec.shadows for r in out) > 0 and not all(taken)
    _no_page_left(quiet)


def test_steps_and_requests_carry_the_activation_proof(tiny_model):
    m = tiny_model()
    prompts = [_ids(16, 50, period=4), _ids(16, 51, period=4)]
    e = _engine(m, 2, SpecConfig(k=3, guard=False))
    out = _run(e, prompts, 12)
    steps, reqs = e.telemetry.steps(), e.telemetry.requests()
    assert steps["draft_tokens"].sum() == sum(r.spec.drafted for r in out) > 0
    assert steps["accepted_tokens"].sum() == sum(r.spec.accepted for r in out)
    assert reqs["spec_drafted"].sum() == steps["draft_tokens"].sum()
    assert reqs["draft_yield"].min() >= 1.0


def test_speculation_bad_input_is_refused_in_one_line():
    for kw, word in (({"proposer": "mtp"}, "allowed ngram, suffix"), ({"k": 0}, "1..16"), ({"k": 17}, "1..16"),
                     ({"tree": 4}, "allowed None"), ({"verify": "lossy"}, "allowed exact, rejection"),
                     ({"row_cost": 2.0}, "0..1"), ({"ngram_min": 5}, "1..4"),
                     ({"guard": "seed002"}, "allowed True, False or 'cohort'"), ({"cohort_min_emitted": 0}, "1..17")):
        with pytest.raises(ConfigError, match=word):
            SpecConfig(**kw)
    with pytest.raises(ConfigError, match="allowed None or a SpecConfig"):
        workbench.EngineConfig(speculation="ngram")
    cfg = workbench.EngineConfig(speculation=SpecConfig(proposer="suffix", k=6))
    assert workbench.EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_a_proposer_without_speculation_is_refused(tiny_model):
    with pytest.raises(WorkbenchError, match="speculation is off"):
        workbench.Engine(tiny_model(), workbench.EngineConfig(), proposer=Oracle({}))


# ---- the Triton runner (the interpreter here, natively on the device) -------------------------

TRITON_GRAPHS = True if torch.cuda.is_available() else "emulate"


def _triton(m, n, spec=None, proposer=None, graphs=TRITON_GRAPHS, keep_logits=True):
    from workbench.runners.triton_options import TritonOptions

    cfg = workbench.EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=n, max_context=64,
                                 memory_budget_bytes=1 << 30, chunk_size=8, speculation=spec,
                                 triton=TritonOptions(graphs=graphs, page_size=64))
    return workbench.Engine(m, cfg, keep_logits=keep_logits, proposer=proposer)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_triton_verify_rows_are_bitwise_its_decode_steps(tiny_model, temperature):
    """Three slots verifying oracle drafts (every row scored: chunk graphs keyed by their scored
    rows, emulated on the CPU) give bitwise the tokens and logits of plain decoding on the same
    runner, each request alone."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=8)
    prompts = [_ids(n, 60 + n, vocab=m.config.vocab_size) for n in (5, 11, 3)]
    kw = dict(max_tokens=7, temperature=temperature, seed=5, ignore_eos=True)
    solo_eng = _triton(m, 1, graphs=False)
    solo = [solo_eng.submit(p, index=i, **kw).result() for i, p in enumerate(prompts)]
    oracle = Oracle({tuple(p): s.token_ids for p, s in zip(prompts, solo)}, wrong_from=2)
    e = _triton(m, 3, SpecConfig(k=3, guard=False), oracle)
    out = e.generate(prompts, **kw)
    for r, s in zip(out, solo):
        assert r.token_ids == s.token_ids and torch.equal(r.logits, s.logits)
        assert r.spec.accepted > 0 and r.spec.drafted > r.spec.accepted  # kept and rejected rows both
    if TRITON_GRAPHS:
        assert any(sel > 1 for _, sel, _ in e.runner.graphs.chunk_keys)  # verify rows took a chunk graph


def test_triton_greedy_verify_answers_with_device_tokens_and_run_ahead(tiny_model):
    """Greedy without kept logits: the runner answers a verify with its rows' argmax tokens, and
    plain steps between verifies may run ahead; the tokens are those of plain decoding."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=8)
    prompts = [_ids(n, 70 + n, vocab=m.config.vocab_size, period=3) for n in (7, 12, 9)]
    kw = dict(max_tokens=9, ignore_eos=True)
    plain = _triton(m, 3, keep_logits=False).generate(prompts, **kw)
    e = _triton(m, 3, SpecConfig(proposer="ngram", k=2), keep_logits=False)
    out = e.generate(prompts, **kw)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert sum(r.spec.verify_steps for r in out) > 0


def test_the_guards_k0_steps_run_ahead_as_plain_decoding_does(tiny_model):
    """An always-wrong proposer under the guard: once the guard keeps every slot at k = 0, the
    engine decides each next step's lengths a step early, so plain steps launch the next one
    ahead as the AR engine does, and only where it will be used (no launch is wasted on a step
    that then verifies a probe). Tokens bitwise those of plain decoding."""
    m = tiny_model("gemma3", "float32", "Q8_0", n_layers=1, sliding_window=8)
    prompts = [_ids(n, 80 + n, vocab=m.config.vocab_size) for n in (7, 12)]
    kw = dict(max_tokens=14, ignore_eos=True)
    plain_eng = _triton(m, 2, keep_logits=False)
    plain = plain_eng.generate(prompts, **kw)
    # (a fixed row cost at which the prior's acceptance does not pay either: k = 0 but for probes)
    spec = SpecConfig(k=4, guard=True, row_cost=0.6, measure_cost=False)
    e = _triton(m, 2, spec, Adversary({tuple(p): r.token_ids for p, r in zip(prompts, plain)}), keep_logits=False)
    e.speculator.guard.probe_every = e.speculator.guard.probe_max = 8  # (probes at the guard's steps 8 and 16 only)
    out = e.generate(prompts, **kw)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert all(r.spec.guard_skips > r.spec.verify_steps > 0 and r.spec.accepted == 0 for r in out)
    if TRITON_GRAPHS:
        g = e.runner.graphs
        assert g.ahead_launched > 6 and g.ahead_used == g.ahead_launched
        # the plain engine ran ahead over the same steps, bar the ones around the probe
        assert plain_eng.runner.graphs.ahead_launched - g.ahead_launched <= 3


def test_a_verify_after_a_wider_one_reads_no_stale_sampled_row(tiny_model):
    """Chunk graphs select their scored rows by index (input row 3), padded to a power of two
    that may exceed the row bucket (80 scored rows: bucket 96, 128 selected): after a call of
    120 scored rows, a call of 80 must find padding there, not the wider call's indices (an
    index past its rows failed on the H200, run 79). Each call's logits are the eager ones."""
    from workbench.runners.direct_pages import DirectPages
    from workbench.runners.triton_options import TritonOptions
    from workbench.runners.triton_runner import TritonRunner

    m = tiny_model("llama", "float32", "Q8_0", n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
    ids = _ids(200, 90, vocab=m.config.vocab_size)
    out = {}
    for graphs in (TRITON_GRAPHS, False):
        r = TritonRunner(m, 256, TritonOptions(graphs=graphs, page_size=64))
        pages = DirectPages(r, tokens_per_group=8 * 256)
        ctx = {0: 256, 1: 256, 2: 256}
        # (copies: on the CPU a graph's answer is a view of its buffers, valid until the next call)
        wide = [pages.segment(i, f"w{i}", ids[i : i + 60], 0, scored=60) for i in (0, 1)]
        got = [{s: v.clone() for s, v in r.run(wide, ctx).items()}]
        narrow = [pages.segment(2, "n", ids[:80], 0, scored=80)]
        got.append({s: v.clone() for s, v in r.run(narrow, ctx).items()})
        out[graphs] = got
        if graphs:
            assert {(128, 128), (96, 128)} <= {k[:2] for k in r.graphs.chunk_keys}
    for a, b in zip(out[TRITON_GRAPHS], out[False]):
        assert a.keys() == b.keys() and all(torch.equal(a[s], b[s]) for s in a)
