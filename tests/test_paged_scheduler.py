"""The scheduler over a paged runner (issue 19), on the fake runner: admission by pages,
preemption by recompute, prefix-cache hits, cancels. The fake reads every token back through
the block tables (fake_runner.FakePagedRunner), so a wrong page anywhere changes the output."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import VOCAB, FakePagedRunner, drive, solo_reference
from test_scheduler import check_invariants, make, req
from workbench.errors import WorkbenchError
from workbench.scheduler import Request


def paged(pool_tokens, budget=1 << 30, **config):
    runner = FakePagedRunner(slot_capacity=400)
    config.setdefault("admission_headroom_tokens", 0)
    return make(runner, budget=budget, kv_resident_tokens=pool_tokens, **config)


def check_paged(sched, plan) -> None:
    check_invariants(sched, plan)
    alloc = sched.allocator
    alloc.check()
    assert alloc.num_sequences == sched.num_running  # a preempted or finished request holds nothing
    for slot, rid in sched.running_ids().items():
        assert rid in alloc
    for pool in alloc.pools.values():
        assert pool.num_used + pool.num_free + pool.num_cached + pool.num_quarantined == pool.num_pages


def test_a_small_pool_preempts_the_newest_and_outputs_stay_solo():
    sched, runner = paged(64, max_concurrency=4, chunk_size=8)  # 4 pages of 16
    reqs = [req(f"r{i}", 10 + i, max_tokens=30, seed=i) for i in range(4)]
    result = drive(sched, runner, arrivals={0: reqs}, check=check_paged)
    events = [result.events[r.request_id] for r in reqs]
    assert sum(ev.num_preemptions for ev in events) > 0
    assert sum(ev.recomputed_tokens for ev in events) > 0
    assert events[0].num_preemptions == 0  # the oldest is never the one preempted
    for r, ev in zip(reqs, events):
        assert (list(ev.output_ids), ev.reason) == solo_reference(r, 400)
    assert sched.allocator.num_sequences == 0


def test_prefix_hits_skip_the_cached_prefill():
    sched, runner = paged(400, max_concurrency=3, chunk_size=64)
    shared = [(7 * i) % VOCAB for i in range(50)]
    first = Request("a", shared + [1], 3)
    later = [Request(f"b{i}", shared + [2 + i, 3], 3) for i in range(3)]
    result = drive(sched, runner, arrivals={0: [first], 6: later}, check=check_paged)
    for r in [first, *later]:
        assert (list(result.events[r.request_id].output_ids), result.events[r.request_id].reason) == solo_reference(r, 400)
    assert result.events["a"].cached_tokens == 0
    assert [result.events[r.request_id].cached_tokens for r in later] == [48] * 3  # 3 full pages of 16
    # the hits' prefill started at 48
    starts = [s for step in runner.steps for fwd in step for (rid, _, s, n) in fwd if rid == "b0"]
    assert starts[0] == 48


def test_a_request_that_never_fits_the_pool_is_refused_in_one_line():
    sched, _ = paged(64)
    with pytest.raises(WorkbenchError, match=r"^request 'big' needs 5 pages .* KV pool holds 4 pages \(64 tokens\)"):
        sched.add(req("big", 40, max_tokens=30))
    sched.add(req("ok", 40, max_tokens=24))  # 64 positions: fits alone


def test_a_budget_too_small_for_the_pool_is_refused():
    with pytest.raises(WorkbenchError, match="kv_resident_tokens=64000 .* exceeds the memory budget"):
        paged(64000, budget=1 << 20)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 10))
    shared = [draw(st.integers(0, VOCAB - 1)) for _ in range(40)]
    requests, arrivals, cancels = [], {}, {}
    for i in range(n):
        prompt_len = draw(st.integers(1, 60))
        head = shared[: min(prompt_len, 40)] if draw(st.booleans()) else []
        prompt = head + [(i * 5 + 3 * k) % VOCAB for k in range(prompt_len - len(head))] or [i % VOCAB]
        r = Request(i, prompt, draw(st.integers(1, 40)), stop_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=1)))
        requests.append(r)
        at = draw(st.integers(0, 15))
        arrivals.setdefault(at, []).append(r)
        if draw(st.integers(0, 3)) == 0:
            cancels.setdefault(at + draw(st.integers(0, 40)), []).append(i)
    return requests, arrivals, cancels


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 6), st.integers(7, 16), st.sampled_from(["decode-first", "prefill-first"]),
       st.one_of(st.none(), st.integers(1, 40)), st.booleans(), st.sampled_from([0, 16, 40]))
def test_soak(workload, concurrency, pool_pages, policy, chunk_size, prefix_cache, headroom):
    requests, arrivals, cancels = workload
    sched, runner = paged(16 * pool_pages, max_concurrency=concurrency, policy=policy, chunk_size=chunk_size,
                          chunk_cap=32, prefix_cache=prefix_cache, admission_headroom_tokens=headroom)
    fits = []
    for at in list(arrivals):
        for r in list(arrivals[at]):
            if len(r.prompt_ids) + r.max_tokens > 16 * pool_pages:  # refused at add (global group)
                with pytest.raises(WorkbenchError, match="KV pool holds"):
                    sched.add(r)
                arrivals[at].remove(r)
                cancels = {k: [i for i in v if i != r.request_id] for k, v in cancels.items()}
            else:
                fits.append(r)
    result = drive(sched, runner, arrivals=arrivals, cancels=cancels, check=check_paged, max_steps=20_000)
    assert set(result.events) == {r.request_id for r in fits}, "every request finishes or is cancelled"
    for r in fits:
        ev = result.events[r.request_id]
        out, reason = solo_reference(r, 400)
        if ev.kind == "cancelled":
            assert list(ev.output_ids) == out[: len(ev.output_ids)]
        else:
            assert (list(ev.output_ids), ev.reason) == (out, reason)
    assert result.touched_after_event(runner) == []
    alloc = sched.allocator
    alloc.check()
    assert alloc.num_sequences == 0 and sched.slots.num_used == 0 and not sched.has_work()
    assert all(p.num_used == 0 and p.num_quarantined == 0 for p in alloc.pools.values())


def test_a_prompt_sharing_a_cached_prefix_is_admitted_by_a_small_sliding_pool():
    """The soak's find: a finished request leaves two cached pages of zeros; the next prompt
    starts with them, and its sliding group's need was counted as the hit's two pages beside a
    full window's new ones, 6 pages of a 5-page pool, so it waited at the head of the queue for
    ever. The hit's pages are among those it holds at once: it is admitted and runs."""
    zeros = lambda n: (0,) * n  # noqa: E731
    first = Request(0, zeros(32), 1)
    second = Request(2, zeros(40) + (10,), 40)
    third = Request(3, (15,), 1)
    sched, runner = paged(16 * 7, max_concurrency=1, policy="decode-first", chunk_size=11, chunk_cap=32,
                          prefix_cache=True, admission_headroom_tokens=40)
    result = drive(sched, runner, arrivals={0: [first, second, third]}, check=check_paged, max_steps=2_000)
    assert {rid: ev.kind for rid, ev in result.events.items()} == {0: "finished", 2: "finished", 3: "finished"}
    for r in (first, second, third):
        assert (list(result.events[r.request_id].output_ids), result.events[r.request_id].reason) == \
            solo_reference(r, 400)
