"""The engine's contract: every slot produces exactly what it would alone (tokens and logits,
bitwise), whatever else runs, arrives, finishes or is cancelled."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench
from workbench.errors import WorkbenchError

from engine_drive import serve_arrivals


def _engine(model, n=4, **kw):
    return workbench.Engine(model, workbench.EngineConfig(max_concurrency=n, dtype=model.dtype_name, **kw), keep_logits=True)


def _prompt(n, seed, vocab=390):
    rnd = random.Random(seed)
    return [2] + [rnd.randrange(4, vocab) for _ in range(n - 1)]


def _solo(model, prompt, max_tokens, **kw):
    return _engine(model, 1).generate([prompt], max_tokens=max_tokens, ignore_eos=True, **kw)[0]


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.logits.shape == b.logits.shape
    assert (a.logits - b.logits).abs().max().item() == 0.0  # max_abs_delta == 0


@pytest.fixture(params=[("gemma3", "float32"), ("gemma3", "bfloat16"), ("llama", "bfloat16")], ids=lambda p: "-".join(p))
def model(request, tiny_model):
    return tiny_model(*request.param)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_identical_and_distinct_prompts_match_solo(model, n):
    distinct = [_prompt(3 + 17 * i, seed=i) for i in range(n)]
    identical = [distinct[0]] * n
    for prompts in (identical, distinct):
        solos = [_solo(model, p, 6) for p in prompts]
        got = _engine(model, n).generate(prompts, max_tokens=6, ignore_eos=True)
        for a, b in zip(got, solos):
            _same(a, b)


def test_mixed_lengths_across_sliding_window_and_chunks(tiny_model):
    m = tiny_model("gemma3", "float32")  # tiny gemma3: 64-token window
    prompts = [_prompt(n, seed=n) for n in (150, 9, 70, 1)]
    solos = [_solo(m, p, 8) for p in prompts]
    for chunk in (None, 5, 33):
        got = _engine(m, 4, chunk_size=chunk).generate(prompts, max_tokens=8, ignore_eos=True)
        for a, b in zip(got, solos):
            _same(a, b)


def test_row_permutation(model):
    prompts = [_prompt(5 + 11 * i, seed=40 + i) for i in range(4)]
    base = _engine(model).generate(prompts, max_tokens=5, ignore_eos=True)
    perm = [2, 0, 3, 1]
    got = _engine(model).generate([prompts[i] for i in perm], max_tokens=5, ignore_eos=True)
    for j, i in enumerate(perm):
        _same(got[j], base[i])


def test_untouched_slot_isolation_and_cancel_reset_reuse(model):
    e = _engine(model, 3)
    watched = _prompt(20, seed=1)
    solo = _solo(model, watched, 12)
    h = e.submit(watched, max_tokens=12, ignore_eos=True)
    others = [e.submit(_prompt(8, seed=s), max_tokens=3, ignore_eos=True) for s in (2, 3)]
    e.step(); e.step()
    others[0].cancel()  # cancelled mid-flight: its slot is reset and reused
    late = e.submit(_prompt(30, seed=4), max_tokens=4, ignore_eos=True)
    e.step()
    late2 = e.submit(_prompt(12, seed=5), max_tokens=2, ignore_eos=True)  # queues, then reuses a slot
    r = h.result()
    _same(r, solo)
    assert others[0].result().finish_reason == "cancelled"
    for hh, s in ((late, 4), (late2, 5)):
        _same(hh.result(), _solo(model, _prompt(30 if s == 4 else 12, seed=s), 4 if s == 4 else 2))


def test_seeded_sampling_does_not_depend_on_neighbours(model):
    prompts = [_prompt(6 + i, seed=i) for i in range(3)]
    kw = dict(max_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    together = _engine(model, 3).generate(prompts, **kw)
    for i, p in enumerate(prompts):
        alone = _engine(model, 1).submit(p, index=i, **{k: v for k, v in kw.items()}).result()
        assert alone.token_ids == together[i].token_ids
    again = _engine(model, 2).generate(prompts, **kw)
    assert [r.token_ids for r in again] == [r.token_ids for r in together]


def test_prefill_first_policy_is_exact_too(tiny_model):
    m = tiny_model("gemma3", "bfloat16")
    prompts = [_prompt(n, seed=n) for n in (100, 3, 45)]
    solos = [_solo(m, p, 5) for p in prompts]
    got = _engine(m, 2, policy="prefill-first", chunk_size=16).generate(prompts, max_tokens=5, ignore_eos=True)
    for a, b in zip(got, solos):
        _same(a, b)


def test_telemetry_records_decisions(tiny_model):
    m = tiny_model("llama", "bfloat16")
    e = _engine(m, 4, chunk_size=8)
    e.generate([_prompt(20, seed=i) for i in range(4)], max_tokens=4, ignore_eos=True)
    steps = e.telemetry.steps()
    assert set(steps["phase"].unique()) >= {"prefill", "decode"}
    assert (steps["prefill_rows"] <= 8).all()
    assert steps.filter(steps["decode_rows"] == 4)["decode_mode"].str.contains("batched:exact-batch").all()
    assert steps["chunk_reason"].str.contains("override").all()
    reqs = e.telemetry.requests()
    assert reqs.height == 4 and (reqs["generated_tokens"] == 4).all()
    for col in ("queue_s", "ttft_s", "decode_tok_s", "itl_p50_ms", "itl_p99_ms"):
        assert reqs[col].null_count() == 0
    assert e.peak_memory_bytes > 0


def test_step_wall_time_includes_its_bookkeeping(tiny_model, monkeypatch):
    """A step's wall_ms runs to the end of its commit and finish events (the host bookkeeping a
    run-ahead device overlaps is the step's; bench's decode time goes further, to the next
    step's start: tests/test_bench.py)."""
    import time

    m = tiny_model("llama", "bfloat16")
    e = _engine(m, 2)
    commit = e.scheduler.commit

    def slow_commit(plan, sampled, *rest):
        time.sleep(0.02)
        return commit(plan, sampled, *rest)

    monkeypatch.setattr(e.scheduler, "commit", slow_commit)
    e.generate([_prompt(6, seed=i) for i in range(2)], max_tokens=3, ignore_eos=True)
    steps = e.telemetry.steps()
    assert steps.height >= 3 and (steps["wall_ms"] >= 20.0).all()


def test_bad_inputs_keep_the_engine_serving(tiny_model):
    m = tiny_model("llama", "float32", context_length=64)
    with pytest.raises(WorkbenchError, match="max_concurrency=65 is out of range"):
        workbench.EngineConfig(max_concurrency=65)
    with pytest.raises(WorkbenchError, match="chunk_cap"):
        workbench.EngineConfig(chunk_cap=0)
    e = _engine(m, 2)
    h = e.submit(_prompt(10, seed=1), max_tokens=5, ignore_eos=True)
    with pytest.raises(WorkbenchError, match="does not fit the context of 64"):
        e.submit(_prompt(80, seed=2), max_tokens=2)
    with pytest.raises(WorkbenchError, match="unknown request"):
        e.cancel("nope")
    with pytest.raises(WorkbenchError, match="temperature"):
        e.submit(_prompt(5, seed=3), temperature=-1)
    with pytest.raises(WorkbenchError, match="top_p"):
        e.submit(_prompt(5, seed=3), top_p=0)
    r = h.result()
    with pytest.raises(WorkbenchError, match="already finished"):
        e.cancel(r.request_id)
    _same(r, _solo(m, _prompt(10, seed=1), 5))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_soak_random_arrivals_and_cancels(tiny_model, data):
    m = tiny_model("gemma3", "bfloat16")
    n_slots = data.draw(st.integers(1, 5))
    chunk = data.draw(st.sampled_from([None, 3, 16]))
    e = _engine(m, n_slots, chunk_size=chunk)
    n_req = data.draw(st.integers(1, 7))
    specs = [(data.draw(st.integers(1, 90)), data.draw(st.integers(1, 6)), data.draw(st.integers(0, 10**6))) for _ in range(n_req)]
    arrive = [data.draw(st.integers(0, 6)) for _ in range(n_req)]
    cancel_at = [data.draw(st.one_of(st.none(), st.integers(0, 10))) for _ in range(n_req)]
    def submit(i):
        n, mt, seed = specs[i]
        return e.submit(_prompt(n, seed), max_tokens=mt, ignore_eos=True)

    handles = serve_arrivals(e, submit, arrive, cancel_at, 40)
    for i, h in handles.items():
        r = h.result()
        if r.finish_reason == "cancelled":
            continue
        n, mt, seed = specs[i]
        _same(r, _solo(m, _prompt(n, seed), mt))
    assert e.scheduler.slots.num_free == n_slots


@pytest.mark.real_model
def test_real_model_four_slots_bitwise_equal_solo(real_model_bf16):
    m = real_model_bf16
    long_text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i * 7}." for i in range(45))
    prompts = ["The capital of France is", "def fibonacci(n):", long_text, "Once upon a time"]
    ids = [m.tokenize(p) for p in prompts]
    assert len(ids[2]) > 512  # crosses the sliding window
    solos = [_solo(m, p, 8) for p in ids]
    got = _engine(m, 4, chunk_size=128).generate(ids, max_tokens=8, ignore_eos=True)
    for a, b in zip(got, solos):
        _same(a, b)


@pytest.mark.real_model
def test_real_model_eight_slots_identical_and_distinct(real_model_bf16):
    m = real_model_bf16
    texts = ["Hello", "The year 1969 saw", "import numpy as np\n", "Les fleurs du", "2 + 2 =", "Dear Sir,", "\u4f60\u597d", "In summary"]
    ids = [m.tokenize(t) for t in texts]
    for prompts in (ids, [ids[1]] * 8):
        solos = {tuple(p): _solo(m, p, 4) for p in prompts}
        got = _engine(m, 8).generate(prompts, max_tokens=4, ignore_eos=True)
        for p, r in zip(prompts, got):
            _same(r, solos[tuple(p)])


def test_engine_precision_follows_the_model(tiny_model):
    m = tiny_model("llama", "float32")
    r = workbench.Engine(m).generate([_prompt(5, seed=1)], max_tokens=2, ignore_eos=True)[0]
    assert len(r.token_ids) == 2
    with pytest.raises(WorkbenchError, match="loaded as 'float32'"):
        workbench.Engine(m, workbench.EngineConfig(dtype="bfloat16"))
