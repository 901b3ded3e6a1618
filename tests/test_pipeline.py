"""The pipeline (SpecConfig.pipeline, engine.py): from N decoding slots on, a step that drafts
splits the slots into two halves whose steps alternate, one half's host work running while the
other's forward is on the device. It is a schedule, not an approximation: every token and logit
is bitwise what plain decoding gives, each request alone. Every test asserts that half steps
ran (the `pipelined` step column), so none passes with the pipeline idle."""

import pytest
import torch

from workbench.errors import ConfigError
from workbench.spec import SpecConfig
from workbench.spec.config import AUTO_PIPELINE

from test_paged_engine import _no_page_left, _same
from test_speculation import TRITON_GRAPHS, Adversary, Oracle, _engine, _ids, _refs, _run, _triton


def _pipelined(e) -> int:
    """Half steps run (from the step records: no polars on the device image)."""
    return sum(bool(r["pipelined"]) for r in e.telemetry.step_records)


def _oracle(prompts, refs, wrong_from=None):
    return Oracle({tuple(p): r[0] for p, r in zip(prompts, refs)}, wrong_from=wrong_from)


@pytest.mark.parametrize("n,temperature", [(4, 0.0), (8, 0.0), (4, 0.9)])
def test_halves_verify_in_turn_bitwise_ar(tiny_model, n, temperature):
    """Mixed prompt lengths and max_tokens, drafts kept in part (right for two tokens, then
    wrong): each request's tokens and logits are the reference's, and half steps ran."""
    m = tiny_model()
    prompts = [_ids(5 + 7 * i, 100 + i) for i in range(n)]
    max_tokens = [14 + 3 * (i % 3) for i in range(n)]
    refs = _refs(m, prompts, max_tokens, temperature, seed=11)
    e = _engine(m, n, SpecConfig(k=4, guard=False, pipeline=2), _oracle(prompts, refs, wrong_from=2))
    out = _run(e, prompts, max_tokens, temperature, seed=11)
    for r, ref in zip(out, refs):
        _same(r, ref)
        assert r.spec.accepted > 0 and r.spec.drafted > r.spec.accepted
    steps = e.telemetry.steps()
    half = steps.filter(steps["pipelined"])
    assert half.height > 4
    # a half's step holds at most its half of the slots, and its step ids are the engine's own
    assert int(half["num_slots"].max()) <= (n + 1) // 2
    assert steps["step"].to_list() == sorted(steps["step"].to_list())
    assert len(set(steps["step"].to_list())) == steps.height
    _no_page_left(e)


def test_a_permutation_and_more_requests_than_slots_stay_exact(tiny_model):
    """Six requests through four slots, submitted in a shuffled order: a finished request with
    others waiting winds the pipeline down (their prefills are whole steps), and it starts
    again once every slot decodes."""
    m = tiny_model()
    prompts = [_ids(6 + 5 * i, 120 + i) for i in range(6)]
    order = [3, 0, 5, 1, 4, 2]
    refs = _refs(m, prompts, 16)
    e = _engine(m, 4, SpecConfig(k=3, guard=False, pipeline=2), _oracle(prompts, refs, wrong_from=1))
    hs = {i: e.submit(prompts[i], max_tokens=16, index=i, ignore_eos=True) for i in order}
    e.run_until_done()
    for i, h in hs.items():
        _same(h.result(), refs[i])
    steps = e.telemetry.steps()
    assert _pipelined(e) > 4
    # whole steps came between half steps: the prefills of the requests that waited
    flips = sum(a != b for a, b in zip(steps["pipelined"].to_list(), steps["pipelined"].to_list()[1:]))
    assert flips >= 3
    _no_page_left(e)


def test_a_cancel_while_halves_are_in_flight_leaves_the_others_exact(tiny_model):
    m = tiny_model()
    prompts = [_ids(n, 140 + n) for n in (9, 15, 21, 6)]
    refs = _refs(m, prompts, 24)
    e = _engine(m, 4, SpecConfig(k=3, guard=False, pipeline=2), _oracle(prompts, refs))
    hs = [e.submit(p, max_tokens=24, index=i, ignore_eos=True) for i, p in enumerate(prompts)]
    while len(e._flights) < 2:
        e.step()
    hs[2].cancel()  # (both halves' steps land first, then the cancel)
    assert not e._flights
    e.run_until_done()
    assert hs[2].result().finish_reason == "cancelled"
    for i in (0, 1, 3):
        _same(hs[i].result(), refs[i])
    assert _pipelined(e) > 2
    _no_page_left(e)


def test_an_always_wrong_proposer_under_the_guard_leaves_the_pipeline(tiny_model):
    """The guard turns drafting off: a half whose guard drafts nothing winds the pipeline down,
    and the rest is plain whole steps. Tokens bitwise AR's."""
    m = tiny_model()
    prompts = [_ids(n, 160 + n) for n in (7, 12, 9, 14)]
    refs = _refs(m, prompts, 40)
    spec = SpecConfig(k=4, guard=True, pipeline=2, row_cost=0.3, measure_cost=False)
    e = _engine(m, 4, spec, Adversary({tuple(p): r[0] for p, r in zip(prompts, refs)}))
    out = _run(e, prompts, 40)
    for r, ref in zip(out, refs):
        _same(r, ref)
        assert r.spec.accepted == 0 and r.spec.guard_skips > 0
    steps = e.telemetry.steps()
    assert 0 < _pipelined(e) < steps.height // 2  # it ran, then the guard stopped it
    assert not steps["pipelined"].to_list()[-1]


def test_ngram_under_the_guard_pipelines_bitwise_ar(tiny_model):
    """The configuration a GPU run uses: n-gram drafts chosen by the guard (shadow drafts, the
    step rule), the pipeline from 4 slots; repeating prompts so drafts are kept."""
    m = tiny_model()
    prompts = [_ids(24 + 3 * i, 180 + i, period=4 + i % 3) for i in range(6)]
    refs = _refs(m, prompts, 30)
    e = _engine(m, 6, SpecConfig(proposer="ngram", k=4, pipeline=4, measure_cost=False))
    out = _run(e, prompts, 30)
    for r, ref in zip(out, refs):
        _same(r, ref)
    assert sum(r.spec.accepted for r in out) > 0
    assert _pipelined(e) > 0


def test_below_its_slots_the_pipeline_stays_off(tiny_model):
    m = tiny_model()
    prompts = [_ids(n, 190 + n) for n in (7, 12, 9)]
    refs = _refs(m, prompts, 12)
    e = _engine(m, 3, SpecConfig(k=3, guard=False, pipeline=4), _oracle(prompts, refs))
    for r, ref in zip(_run(e, prompts, 12), refs):
        _same(r, ref)
        assert r.spec.accepted > 0
    assert _pipelined(e) == 0


@pytest.mark.parametrize("keep_logits", [True, False])
def test_triton_halves_launch_in_turn_bitwise_its_plain_decoding(tiny_model, keep_logits):
    """The Triton runner (chunk graphs emulated on the CPU, natively on the device): each half's
    verify launched behind the other's, its answer read later; tokens (and logits, where kept)
    bitwise those of plain decoding on the same runner."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=8)
    prompts = [_ids(n, 200 + n, vocab=m.config.vocab_size) for n in (5, 11, 3, 8)]
    kw = dict(max_tokens=9, temperature=0.0, ignore_eos=True)
    plain = _triton(m, 4, keep_logits=keep_logits).generate(prompts, **kw)
    oracle = Oracle({tuple(p): r.token_ids for p, r in zip(prompts, plain)}, wrong_from=2)
    e = _triton(m, 4, SpecConfig(k=3, guard=False, pipeline=2), oracle, keep_logits=keep_logits)
    out = e.generate(prompts, **kw)
    for r, p in zip(out, plain):
        assert r.token_ids == p.token_ids
        if keep_logits:
            assert torch.equal(r.logits, p.logits)
        assert r.spec.accepted > 0
    assert _pipelined(e) > 2
    if TRITON_GRAPHS:
        assert any(sel > 1 for _, sel, _ in e.runner.graphs.chunk_keys)  # the halves' verifies took chunk graphs


def test_pipeline_bad_input_is_refused_in_one_line():
    for kw, words in [(dict(pipeline=1), "allowed 'auto', 0 (off) or the slots it starts at"),
                      (dict(pipeline=True), "allowed 'auto', 0 (off)"),
                      (dict(pipeline="on"), "allowed 'auto', 0 (off)"),
                      (dict(pipeline=4, proposer="self", draft_layers=2), "allowed with ngram or suffix"),
                      (dict(pipeline=4, tree=8), "allowed tree=None")]:
        with pytest.raises(ConfigError, match="pipeline") as err:
            SpecConfig(**kw)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_a_step_runs_whole_where_its_halves_would_go_slower_on_a_simulated_device(tiny_model, monkeypatch):
    """A modelled device whose verify forward costs 1 ms whatever its rows and whose host is
    nearly free: two halves pay that millisecond twice, so with drafts always kept the guard
    runs whole verify steps (after the warm-up measured both kinds), bitwise AR's."""
    m = tiny_model()
    prompts = [_ids(8 + 3 * i, 400 + i) for i in range(8)]
    refs = _refs(m, prompts, 48)
    table = {tuple(p): r[0] for p, r in zip(prompts, refs)}
    e = _engine(m, 8, SpecConfig(k=4, pipeline=4), _ShadowOracle(table))
    _simulated(e, monkeypatch, plain=(0.6, 0.01), other=(1.0, 0.001), host_ms=(0.02, 0.0))
    out, decode = _second_pass(e, prompts, refs)
    whole = decode.filter((decode["verify_slots"] > 0) & ~decode["pipelined"]).height
    assert sum(r.spec.accepted for r in out) > 8 * 24
    assert whole > decode.height // 2 and int(decode["pipelined"].sum()) <= 2, decode


def test_auto_starts_the_pipeline_where_it_can_run_and_overlap():
    """pipeline="auto" (the default): from AUTO_PIPELINE slots on for a lookup proposer's chains
    on a runner whose launch leaves its forward running; off on the CPU's synchronous runner,
    for a model's drafts and for trees. A number is taken as given."""
    auto = SpecConfig(k=4)
    assert auto.pipeline == "auto"
    assert auto.pipeline_slots(asynchronous=True) == AUTO_PIPELINE
    assert auto.pipeline_slots(asynchronous=False) == 0
    assert SpecConfig(proposer="suffix").pipeline_slots(True) == AUTO_PIPELINE
    assert SpecConfig(proposer="self", draft_layers=2).pipeline_slots(True) == 0
    assert SpecConfig(k=4, tree=8).pipeline_slots(True) == 0
    assert SpecConfig(k=4, pipeline=0).pipeline_slots(True) == 0
    assert SpecConfig(k=4, pipeline=4).pipeline_slots(False) == 4
    assert SpecConfig.from_dict(auto.to_dict()) == auto and auto.overridden("pipeline=auto") == auto


def test_auto_pipelines_on_a_modelled_device_and_not_on_the_cpu(tiny_model, monkeypatch):
    """The default config at AUTO_PIPELINE slots: the torch runner decodes in whole steps, the
    same engine on a modelled GPU (asynchronous launches) runs half steps; both bitwise AR."""
    m = tiny_model()
    n = AUTO_PIPELINE
    prompts = [_ids(8 + 3 * i, 300 + i) for i in range(n)]
    refs = _refs(m, prompts, 24)
    table = {tuple(p): r[0] for p, r in zip(prompts, refs)}
    halves = []
    for modelled in (False, True):
        e = _engine(m, n, SpecConfig(k=4, guard=False), Oracle(table))
        if modelled:
            _simulated(e, monkeypatch)
        for r, ref in zip(_run(e, prompts, 24), refs):
            _same(r, ref)
            assert r.spec.accepted > 0
        halves.append(_pipelined(e))
    assert halves[0] == 0 and halves[1] > 2, halves


def test_bench_names_the_pipeline_and_flags_it_idle(tiny_gguf, tmp_path, capsys):
    from workbench.bench import activation_flag, spec_text
    from workbench.cli import main

    assert spec_text(SpecConfig(k=8, pipeline=8)) == "ngram:k8+pipeline8"
    assert spec_text(SpecConfig(k=8, pipeline=0)) == "ngram:k8+nopipeline"
    assert spec_text(SpecConfig(k=8)) == "ngram:k8"  # ("auto", the default)
    idle = {"spec_verify_steps": 5, "spec_pipelined_steps": 0}
    assert "no step ran as a half" in activation_flag(idle, prefix_cache=False, shared_prefix_len=0,
                                                       speculation=True, pipeline=True)
    assert activation_flag({**idle, "spec_pipelined_steps": 3}, prefix_cache=False, shared_prefix_len=0,
                           speculation=True, pipeline=True) is None
    rc = main(["bench", "--model", str(tiny_gguf("gemma3")), "--concurrency", "2", "--prompt-len", "16", "--gen", "2",
               "--spec", "ngram", "--spec-pipeline", "1", "--data-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline=1 is out of range: allowed 'auto', 0 (off)" in err[0]
    with pytest.raises(SystemExit) as ex:
        main(["bench", "--model", str(tiny_gguf("gemma3")), "--spec", "ngram", "--spec-pipeline", "fast",
              "--data-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert ex.value.code == 2 and len(err) == 1 and "'fast' is not allowed: allowed auto, 0 (off)" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


class _ShadowOracle(Oracle):
    """The oracle, drafting as a lookup does (shadow drafts measure it at k = 0)."""

    shadows = True


def _simulated(e, monkeypatch, plain=(0.3, 0.01), other=(0.6, 0.01), host_ms=(0.3, 0.014)):
    """The engine's runner on a modelled GPU with a virtual clock (workbench/runners/simulated.py),
    shaped like an H100 at 16 slots, scaled to 8: a plain step of n rows 0.3 + 0.01 n ms (run
    ahead), a verify's forward 0.6 + 0.01 a row, the host 0.3 + 0.014 ms a row before each
    forward, so every step time the guard measures is the model's. Drafts of 4 all kept: a
    whole verify step (40 rows, ~1.9 ms with its host unhidden) emits 21.5 tokens a ms against
    plain decoding's 21 (8 in 0.38 ms), short of the rule's 5%; a half (20 rows) adds its 0.8 ms
    of device, its host hidden under the other's: 25 a ms. (`plain`, `other`, `host_ms`:
    another device.)"""
    import workbench.engine
    import workbench.spec.speculator
    from workbench.runners.simulated import DeviceModel, SimulatedDevice, VirtualClock

    clock = VirtualClock()
    e.runner = SimulatedDevice(e.runner, DeviceModel(plain, other), clock, host_ms=host_ms)
    monkeypatch.setattr(workbench.engine, "time", clock)
    monkeypatch.setattr(workbench.spec.speculator, "time", clock)
    return clock


def _second_pass(e, prompts, refs):
    """A pass that measures every kind of step (as a benchmark's warm-up), then the timed one,
    its fits the first's: its results (each bitwise its reference) and its decode steps."""
    _run(e, prompts, 48)
    first = e.telemetry.steps().height
    e.speculator.forget_proposals()
    out = _run(e, prompts, 48)
    for r, ref in zip(out, refs):
        _same(r, ref)
    decode = e.telemetry.steps().slice(first)
    return out, decode.filter(decode["phase"] == "decode")


@pytest.mark.parametrize("proposer", ["oracle", "adversary"])
def test_the_guard_starts_the_pipeline_where_halves_pay_on_a_simulated_device(tiny_model, monkeypatch, proposer):
    """Eight slots on the modelled GPU (`_simulated`: deterministic step times), the guard on
    and measuring, as a benchmark runs it (the second of two passes is looked at, its fits the
    first's): drafts that are always kept start the pipeline and keep it, most decode steps
    being half steps; drafts that are never kept get one pair of half steps, which measures the
    halves, then none. Tokens and logits bitwise AR's. (The step rule's pricing of a split step
    is unit-tested in test_spec_units.py: `test_a_whole_step_the_pipeline_may_split_...`.)"""
    m = tiny_model()
    prompts = [_ids(8 + 3 * i, 200 + i) for i in range(8)]
    refs = _refs(m, prompts, 48)
    table = {tuple(p): r[0] for p, r in zip(prompts, refs)}
    drafter = _ShadowOracle(table) if proposer == "oracle" else Adversary(table)
    e = _engine(m, 8, SpecConfig(k=4, pipeline=4), drafter)
    _simulated(e, monkeypatch)
    out, decode = _second_pass(e, prompts, refs)
    half = int(decode["pipelined"].sum())
    if proposer == "oracle":
        assert sum(r.spec.accepted for r in out) > 8 * 24
        assert half > decode.height // 2, (half, decode.height)
    else:
        assert sum(r.spec.accepted for r in out) == 0
        assert half <= 2  # (a half pays until one was measured: one pair tried, then none)
