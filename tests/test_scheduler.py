import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import VOCAB, FakeRunner, drive, fake_token, solo_reference
from workbench.engine_config import ConfigError, EngineConfig
from workbench.errors import WorkbenchError
from workbench.planner import DecodeGroup, PrefillChunk
from workbench.scheduler import Request, Scheduler


def make(runner=None, budget=1 << 30, **config):
    runner = runner or FakeRunner()
    return Scheduler(EngineConfig(memory_budget_bytes=budget, **config), runner), runner


def check_invariants(sched: Scheduler, plan) -> None:
    """Called after every schedule(); what must hold at every step."""
    cfg, runner = sched.config, sched.runner
    sched.slots.check()
    assert sched.slots.num_free + sched.slots.num_used == sched.slots.num_slots
    assert sched.slots.num_used == sched.num_running <= cfg.max_concurrency
    ids = plan.slot_ids()
    assert len(ids) == len(set(ids)), "a slot appears twice in one step"
    owners = sched.running_ids()
    assert all(s in owners for s in ids), "the plan touches a free slot"
    assert set(owners.values()).isdisjoint(sched.waiting_ids())
    assert plan.num_prefill_rows <= plan.chunk_size
    reserved = runner.fixed_bytes + sched.reserved_cache_bytes
    assert reserved + runner.bytes_per_prefill_row * sched.num_running <= sched.budget_bytes
    if cfg.chunk_size is None:
        assert plan.chunk_size <= cfg.chunk_cap
        rows = plan.num_prefill_rows + plan.num_decode_rows
        assert reserved + runner.bytes_per_prefill_row * rows <= sched.budget_bytes
    else:
        assert plan.chunk_size == cfg.chunk_size and plan.chunk_reason == "override"


def req(rid, prompt_len, max_tokens=8, seed=0, stop_ids=()):
    prompt = [(seed * 31 + i * 7 + len(str(rid))) % VOCAB for i in range(prompt_len)]
    return Request(rid, prompt, max_tokens, stop_ids=stop_ids)


def assert_solo(result, requests, capacity):
    for r in requests:
        ev = result.events[r.request_id]
        out, reason = solo_reference(r, capacity)
        assert ev.kind == "finished"
        assert (list(ev.output_ids), ev.reason) == (out, reason), r.request_id


# -- config ----------------------------------------------------------------------------------


def test_config_defaults_round_trip():
    cfg = EngineConfig()
    assert cfg.max_concurrency == 4 and cfg.chunk_cap == 4096 and cfg.policy == "decode-first"
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert EngineConfig.from_dict({"max_concurrency": 8}).max_concurrency == 8


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_concurrency", 65, "max_concurrency=65 is out of range: allowed 1..64"),
        ("max_concurrency", 0, "max_concurrency=0 is out of range: allowed 1..64"),
        ("max_concurrency", True, "max_concurrency=True is not an integer: allowed 1..64"),
        ("max_concurrency", 2.0, "max_concurrency=2.0 is not an integer"),
        ("max_context", 0, "max_context=0 is out of range: allowed >= 1 or None"),
        ("chunk_size", 0, "chunk_size=0 is out of range: allowed >= 1 or None"),
        ("chunk_cap", 0, "chunk_cap=0 is out of range: allowed >= 1"),
        ("memory_budget_bytes", 0, "memory_budget_bytes=0 is out of range"),
        ("max_batch_rows", -1, "max_batch_rows=-1 is out of range: allowed >= 1"),
        ("policy", "fifo", "policy='fifo' is not allowed: allowed decode-first, prefill-first"),
        ("backend", "cuda", "backend='cuda' is not allowed: allowed torch, triton"),
        ("dtype", "float16", "dtype='float16' is not allowed: allowed bfloat16, float32"),
        ("head_matmul", "cublas", "head_matmul='cublas' is not allowed: allowed dense"),
    ],
)
def test_bad_config_names_field_and_range(field, value, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{field: value})
    assert message in str(e.value)
    assert isinstance(e.value, WorkbenchError)


def test_head_matmul_is_the_triton_backends():
    with pytest.raises(ConfigError, match="head_matmul='q8i8' is the triton backend's: allowed with backend='triton' "
                                          "only"):
        EngineConfig(head_matmul="q8i8")
    assert EngineConfig(backend="triton", head_matmul="dense").head_matmul == "dense"


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown engine config key.*'slots'.*valid keys: max_concurrency, max_context"):
        EngineConfig.from_dict({"slots": 4})


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        EngineConfig().max_concurrency = 2


def test_scheduler_construction_errors():
    with pytest.raises(WorkbenchError, match="memory budget unknown"):
        Scheduler(EngineConfig(), FakeRunner())
    with pytest.raises(WorkbenchError, match="max_context=600 exceeds the runner's slot capacity: allowed 1..512"):
        make(max_context=600)
    with pytest.raises(WorkbenchError, match="below the runner's fixed"):
        make(budget=100)
    # the budget learnt at run time is used when the config leaves it unset, not written back
    cfg = EngineConfig()
    sched = Scheduler(cfg, FakeRunner(), budget_bytes=1 << 20)
    assert sched.budget_bytes == 1 << 20 and cfg.memory_budget_bytes is None


# -- requests --------------------------------------------------------------------------------


def test_add_refuses_what_never_fits():
    sched, _ = make(max_context=100)
    with pytest.raises(WorkbenchError, match="prompt of 100 tokens does not fit the context of 100 tokens"):
        sched.add(req("a", 100))
    sched.add(req("b", 99))
    with pytest.raises(WorkbenchError, match="request 'b' already exists"):
        sched.add(req("b", 3))
    with pytest.raises(WorkbenchError, match="empty prompt"):
        Request("c", [], 4)
    with pytest.raises(WorkbenchError, match="max_tokens=0 is out of range"):
        Request("c", [1], 0)
    small, _ = make(budget=4096 + 10 * 1024 + 256 - 1)
    with pytest.raises(WorkbenchError, match="request 'x' needs .* alone"):
        small.add(req("x", 5, max_tokens=5))


def test_finish_reasons():
    runner = FakeRunner(slot_capacity=40)
    sched, _ = make(runner, max_concurrency=3)
    long = req("ctx", 30, max_tokens=100)
    short = req("tok", 4, max_tokens=3)
    first = fake_token(list(req("eos", 6).prompt_ids))
    eos = req("eos", 6, max_tokens=50, stop_ids=(first,))
    result = drive(sched, runner, arrivals={0: [long, short, eos]}, check=check_invariants)
    reasons = {rid: ev.reason for rid, ev in result.events.items()}
    assert reasons == {"ctx": "max_context", "tok": "max_tokens", "eos": "eos"}
    assert len(result.events["ctx"].output_ids) == 40 - 30
    assert result.events["eos"].output_ids == (first,)
    assert_solo(result, [long, short, eos], 40)


def test_cancel_errors():
    sched, runner = make()
    with pytest.raises(WorkbenchError, match="unknown request 'nope'"):
        sched.cancel("nope")
    result = drive(sched, runner, arrivals={0: [req("a", 3, max_tokens=2)]})
    assert result.events["a"].kind == "finished"
    with pytest.raises(WorkbenchError, match="request 'a' already finished"):
        sched.cancel("a")
    sched.add(req("b", 3))
    sched.cancel("b")
    with pytest.raises(WorkbenchError, match="request 'b' already cancelled"):
        sched.cancel("b")


def test_cancel_in_queue_leaves_no_trace():
    sched, runner = make(max_concurrency=1)
    sched.add(req("a", 5))
    sched.add(req("b", 5))
    sched.schedule()
    assert sched.waiting_ids() == ["b"]
    (ev,) = sched.cancel("b")
    assert (ev.kind, ev.slot_id, ev.output_ids) == ("cancelled", None, ())
    assert sched.waiting_ids() == [] and sched.running_ids() == {0: "a"}


def test_cancel_while_running_frees_the_slot_and_discards_the_pending_plan():
    sched, runner = make(max_concurrency=2)
    a, b = req("a", 20, max_tokens=30), req("b", 20, max_tokens=30)
    result = drive(sched, runner, arrivals={0: [a, b]}, cancels={5: ["a"]}, check=check_invariants)
    ev = result.events["a"]
    assert ev.kind == "cancelled" and ev.slot_id == 0 and 0 < len(ev.output_ids) < 30
    assert ev.output_ids == tuple(solo_reference(a, 512)[0][: len(ev.output_ids)])
    assert result.touched_after_event(runner) == []
    assert_solo(result, [b], 512)

    sched, runner = make()
    sched.add(req("c", 4))
    plan = sched.schedule()
    sched.cancel("c")
    assert sched.slots.num_used == 0 and not sched.has_work()
    with pytest.raises(RuntimeError, match="not the pending one"):
        sched.commit(plan, {0: 1})


def test_commit_needs_a_sample_where_the_plan_samples():
    sched, _ = make()
    sched.add(req("a", 4))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for slot 0"):
        sched.commit(plan, {})


# -- planning through the scheduler ----------------------------------------------------------


def test_long_prompts_interleave():
    sched, runner = make(max_concurrency=2, chunk_size=64)
    result = drive(sched, runner, arrivals={0: [req("a", 300, seed=1), req("b", 300, seed=2)]},
                   check=check_invariants)
    first_two = result.plans[:2]
    assert all({c.slot_id for c in p.prefill_chunks} == {0, 1} for p in first_two)
    assert first_two[0].prefill_chunks == (PrefillChunk(0, 0, 32), PrefillChunk(1, 0, 32))
    # both prompts finish prefill in the same step, so first tokens arrive together
    done = [i for i, p in enumerate(result.plans) if any(c.start + c.length == 300 for c in p.prefill_chunks)]
    assert len(done) == 1
    assert_solo(result, [req("a", 300, seed=1), req("b", 300, seed=2)], 512)


@pytest.mark.parametrize("policy", ["decode-first", "prefill-first"])
def test_policy_decides_whether_decode_waits_for_prefill(policy):
    sched, runner = make(max_concurrency=2, chunk_size=16, policy=policy)
    a, b = req("a", 4, max_tokens=40), req("b", 100, max_tokens=4)
    result = drive(sched, runner, arrivals={0: [a], 3: [b]}, check=check_invariants)
    b_prefill = [p for p in result.plans if any(c.slot_id == 1 for c in p.prefill_chunks)]
    assert len(b_prefill) == 100 // 16 + 1
    for p in b_prefill:
        if policy == "decode-first":
            assert p.decode_groups == (DecodeGroup((0,), False, "single"),) and p.fused
        else:
            assert p.decode_groups == () and not p.fused
    assert_solo(result, [a, b], 512)


def test_batched_then_solo_past_the_dense_boundary():
    runner = FakeRunner(dense_boundary=20)
    sched, _ = make(runner, max_concurrency=3)
    reqs = [req(f"r{i}", 10 + i, max_tokens=20, seed=i) for i in range(3)]
    result = drive(sched, runner, arrivals={0: reqs}, check=check_invariants)
    groups = [g for p in result.plans for g in p.decode_groups]
    assert DecodeGroup((0, 1, 2), True, "exact-batch") in groups
    solo = [g for g in groups if g.reason == "sparse past dense boundary 20"]
    assert solo and all(not g.batched and len(g.slot_ids) == 1 for g in solo)
    assert sum(p.num_solo_fallback for p in result.plans) == len(solo)
    assert_solo(result, reqs, 512)


def test_admission_waits_for_memory_and_chunk_shrinks_as_slots_fill():
    runner = FakeRunner(bytes_per_token=1000, bytes_per_prefill_row=100, fixed_bytes=5000)
    # room for two 100-token reservations (200 KB) plus rows, not three
    budget = 5000 + 2 * 100_000 + 30_000
    sched, _ = make(runner, budget=budget, max_concurrency=4, chunk_cap=250)
    reqs = [req(f"r{i}", 60, max_tokens=40, seed=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert sched.running_ids() == {0: "r0", 1: "r1"} and sched.waiting_ids() == ["r2", "r3"]
    assert plan.chunk_size == 250
    assert plan.chunk_reason.endswith("-> 300 rows, capped at 250")
    result = drive(sched, runner, check=check_invariants)  # its schedule() replaces the plan
    assert_solo(result, reqs, 512)
    assert max(len(p.slot_ids()) for p in result.plans) <= 2


@pytest.mark.parametrize("concurrency", [1, 2, 5, 8])
@pytest.mark.parametrize("policy", ["decode-first", "prefill-first"])
def test_outputs_equal_solo_at_any_concurrency(concurrency, policy):
    sched, runner = make(max_concurrency=concurrency, policy=policy, chunk_cap=37, max_batch_rows=3)
    reqs = [req(f"r{i}", 5 + 23 * i % 90, max_tokens=3 + 7 * i % 25, seed=i) for i in range(10)]
    arrivals = {2 * i: [r] for i, r in enumerate(reqs)}
    result = drive(sched, runner, arrivals=arrivals, check=check_invariants)
    assert_solo(result, reqs, 512)
    assert result.touched_after_event(runner) == []
    assert sched.slots.num_used == 0 and not sched.has_work()


# -- soak ------------------------------------------------------------------------------------


@st.composite
def workloads(draw):
    capacity = draw(st.integers(8, 200))
    n = draw(st.integers(1, 12))
    requests, arrivals, cancels = [], {}, {}
    for i in range(n):
        prompt_len = draw(st.one_of(st.integers(1, capacity // 2), st.integers(1, capacity - 1)))
        max_tokens = draw(st.integers(1, 30))
        stop = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))
        r = Request(i, [draw(st.integers(0, VOCAB - 1))] + [(i + 3 * k) % VOCAB for k in range(prompt_len - 1)],
                    max_tokens, stop_ids=stop)
        at = draw(st.integers(0, 15))
        requests.append(r)
        arrivals.setdefault(at, []).append(r)
        if draw(st.integers(0, 3)) == 0:
            cancels.setdefault(at + draw(st.integers(0, 20)), []).append(i)
    return capacity, requests, arrivals, cancels


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.integers(1, 8),
    st.sampled_from(["decode-first", "prefill-first"]),
    st.one_of(st.none(), st.integers(4, 64)),
    st.integers(4, 128),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 120)),
    st.booleans(),
    st.one_of(st.integers(0, 3000), st.integers(3000, 40_000)),  # budget slack: tight or roomy
)
def test_soak(workload, concurrency, policy, chunk_size, chunk_cap, max_rows, boundary, fuse, slack):
    capacity, requests, arrivals, cancels = workload
    runner = FakeRunner(slot_capacity=200, bytes_per_token=16, bytes_per_prefill_row=8, fixed_bytes=64,
                        dense_boundary=boundary, supports_fused_step=fuse)
    alone = max(runner.cache_bytes(min(len(r.prompt_ids) + r.max_tokens, capacity)) for r in requests)
    budget = runner.fixed_bytes + alone + runner.bytes_per_prefill_row + slack
    sched, _ = make(runner, budget=budget, max_concurrency=concurrency, policy=policy, chunk_size=chunk_size,
                    chunk_cap=chunk_cap, max_batch_rows=max_rows, max_context=capacity)
    result = drive(sched, runner, arrivals=arrivals, cancels=cancels, check=check_invariants, max_steps=20_000)
    cancelled = {rid for ids in cancels.values() for rid in ids}
    assert set(result.events) == {r.request_id for r in requests}, "every request finishes or is cancelled"
    for r in requests:
        ev = result.events[r.request_id]
        out, reason = solo_reference(r, capacity)
        if ev.kind == "cancelled":
            assert r.request_id in cancelled
            assert list(ev.output_ids) == out[: len(ev.output_ids)] and len(ev.output_ids) < len(out)
        else:
            assert (list(ev.output_ids), ev.reason) == (out, reason)
    assert result.touched_after_event(runner) == []
    assert sched.slots.num_used == 0 and sched.reserved_cache_bytes == 0 and not sched.has_work()


def test_scheduling_core_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, workbench.engine_config, workbench.slots, workbench.planner, workbench.scheduler;"
        "sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_repeats_after_says_when_the_next_step_is_the_same_decode_rows():
    """The run-ahead hint: true only for a one-forward decode step of every running slot with
    nothing waiting and no slot at its token limit after this step."""
    sched, _ = make(max_concurrency=2)
    sched.add(req("a", 3, max_tokens=4))
    sched.add(req("b", 2, max_tokens=3))
    sched.add(req("c", 2, max_tokens=3))  # waits for a slot
    hints = []
    while sched.has_work():
        plan = sched.schedule()
        hints.append((plan.num_prefill_rows, plan.num_decode_rows, sched.num_waiting, sched.repeats_after(plan)))
        sched.commit(plan, {slot: 1 for slot in plan.slot_ids()})
    assert not any(h for p, d, w, h in hints if p or w)  # prefill rows or a waiting request: never
    # "b" (3 tokens) ends after its third sample: the step sampling its second token says no
    assert hints[1][:3] == (0, 2, 1) and not hints[1][3]
    assert any(h for *_, h in hints)  # "a" and "c" decode together with nothing waiting: yes
    assert not hints[-1][3]  # the last step finishes everything
