"""Host backing (issue 20, items 1-2): paging sequences out to a host store and back leaves every
request's tokens and logits bitwise what it gives alone; the resident set turns over so that
every admitted request waits a bounded number of steps; swap and recompute are both exact.

Three levels: the allocator's swap_out / swap_in (plain Python, invariants checked after each
operation); the scheduler on the fake paged runner (tests/fake_runner.py copies pages to its
host store and back, so a page moved wrongly changes the output); and the engine on the real
forward, the torch runner and the Triton runner (under the interpreter here, natively on the
device), against each request run alone. Every test asserts the counters of what it is about
(pages out and in, swaps, recomputes) so that it cannot pass without it."""

from __future__ import annotations

import random

import pytest

from fake_runner import FakePagedRunner, drive, solo_reference
from test_paged_engine import _engine, _ids, _reference, _same
from test_scheduler import make, req
from workbench import EngineConfig
from workbench.errors import ConfigError, WorkbenchError
from workbench.state import KVGroup, PageAllocator, StateLayout


# -- the allocator -----------------------------------------------------------------------------

def _alloc(pages=8, host=8, window=0):
    groups = (KVGroup("global", (0,), 0, 8),) + ((KVGroup("sliding", (1,), window, 8),) if window else ())
    lay = StateLayout(groups, 4, key_blocks=(4,))
    return PageAllocator(lay, {g.name: pages for g in groups}, num_host_pages={g.name: host for g in groups})


def test_swap_out_moves_private_pages_keeps_shared_ones_and_swap_in_restores_the_tables():
    a = _alloc()
    a.add("x")
    a.append("x", 10)  # pages 0..2 (positions 0..9)
    a.commit("x", list(range(10)))  # two full pages hashed
    a.add("y", a.match(list(range(9))))  # shares x's first two pages
    a.check()
    before = a.block_table("x", "global").ids()
    assert a.pages_to_swap_out("x") == {"global": 1}  # only the partial last page is x's alone
    moves = a.swap_out("x")
    a.check()
    assert [(m.device, m.to_host) for m in moves] == [(before[2], True)]
    assert not a.sequence("x").resident and a.num_paged_out == 1
    assert a.block_table("x", "global").entries == (before[0], before[1], None)
    assert a.pages_to_swap_in("x") == {"global": 1}
    with pytest.raises(WorkbenchError, match="paged out: it cannot grow"):
        a.append("x", 1)
    with pytest.raises(WorkbenchError, match="paged out: it cannot commit"):
        a.commit("x", [1])
    back = a.swap_in("x")
    a.check()
    assert [(m.host, m.to_host) for m in back] == [(moves[0].host, False)]
    assert a.sequence("x").resident and a.block_table("x", "global")[2] == back[0].device
    st = a.read_stats()
    assert (st.pages_out, st.pages_in, st.host_used) == (1, 1, 0)


def test_a_full_host_store_refuses_and_free_hands_back_host_pages():
    a = _alloc(pages=8, host=2, window=6)
    a.add("x")
    a.append("x", 12)  # 3 pages in each group; the sliding group has dropped what no query sees
    need = a.pages_to_swap_out("x")
    assert need["global"] == 3 and not a.can_swap_out("x")
    with pytest.raises(WorkbenchError, match="needs host pages"):
        a.swap_out("x")
    a.add("y")
    a.append("y", 5)
    assert a.can_swap_out("y")
    a.swap_out("y", fence=3)  # its device pages stay fenced until step 3 retires
    a.check()
    assert a.pools["global"].num_quarantined == 2
    a.free("y")
    a.check()
    assert all(h.num_used == 0 for h in a.host.values())
    a.retire(3)
    assert a.pools["global"].num_quarantined == 0


def test_without_a_host_store_swap_out_is_refused():
    lay = StateLayout((KVGroup("global", (0,), 0, 8),), 4, key_blocks=(4,))
    a = PageAllocator(lay, {"global": 4})
    a.add("x")
    a.append("x", 3)
    assert not a.can_swap_out("x")
    with pytest.raises(WorkbenchError, match="needs a host store"):
        a.swap_out("x")


# -- the scheduler on the fake paged runner --------------------------------------------------------

def _sched(pool_tokens, host_tokens, **config):
    config.setdefault("admission_headroom_tokens", 0)
    return make(FakePagedRunner(slot_capacity=400), kv_resident_tokens=pool_tokens, kv_host_tokens=host_tokens, **config)


def _check(sched, plan) -> None:
    alloc = sched.allocator
    alloc.check()
    waiting = len(sched.memory._waiting)  # (admitted, holding nothing until their first page-in)
    assert alloc.num_sequences == sched.num_running - waiting
    assert alloc.num_paged_out + waiting == sched.num_paged_out
    for slot in plan.slot_ids():  # only resident requests run
        assert alloc.sequence(sched.running_ids()[slot]).resident


@pytest.mark.parametrize("quantum", [1, 4, 16])
def test_the_resident_set_turns_over_with_a_bounded_wait_and_outputs_stay_solo(quantum):
    n = 8
    sched, runner = _sched(128, 4096, max_concurrency=n, chunk_size=8, residency_quantum=quantum)
    reqs = [req(f"r{i}", 10 + 3 * i, max_tokens=40, seed=i) for i in range(n)]
    result = drive(sched, runner, arrivals={0: reqs}, check=_check)
    events = [result.events[r.request_id] for r in reqs]
    for r, ev in zip(reqs, events):
        assert list(ev.output_ids) == solo_reference(r, 400)[0]
        assert ev.num_preemptions == 0  # the host store had room: every preemption was a swap
    assert sum(ev.num_swaps for ev in events) >= n  # the pool holds about a third of the live KV
    assert runner.num_moved > 0 and not runner.host  # every page paged out came back (or was freed)
    # the head of the paged-out queue is paged in within a quantum and a step (every resident
    # request's quantum has run by then), so a request waits at most that per request ahead of it
    bound = (n - 1) * (quantum + 1)
    assert max(ev.max_wait_steps for ev in events) <= bound
    assert all(ev.max_wait_steps > 0 for ev in events[1:])


def test_recompute_policy_recomputes_and_swap_policy_swaps():
    outs = {}
    for policy in ("swap", "recompute"):
        sched, runner = _sched(64, 4096, max_concurrency=4, chunk_size=8, preemption=policy, residency_quantum=4)
        reqs = [req(f"r{i}", 10 + i, max_tokens=30, seed=i) for i in range(4)]
        result = drive(sched, runner, arrivals={0: reqs}, check=_check)
        events = [result.events[r.request_id] for r in reqs]
        swaps, recomputes = sum(e.num_swaps for e in events), sum(e.num_preemptions for e in events)
        assert (swaps > 0, recomputes > 0) == ((True, False) if policy == "swap" else (False, True))
        outs[policy] = [list(e.output_ids) for e in events]
        assert outs[policy] == [solo_reference(r, 400)[0] for r in reqs]


def test_a_small_host_store_falls_back_to_recompute():
    # 5 host pages per global group, each request up to 5: once one is paged out, others are recomputed
    sched, runner = _sched(64, 80, max_concurrency=4, chunk_size=8, residency_quantum=2)
    reqs = [req(f"r{i}", 12 + 5 * i, max_tokens=30, seed=i) for i in range(4)]
    result = drive(sched, runner, arrivals={0: reqs}, check=_check)
    events = [result.events[r.request_id] for r in reqs]
    assert sum(e.num_swaps for e in events) > 0 and sum(e.num_preemptions for e in events) > 0
    assert [list(e.output_ids) for e in events] == [solo_reference(r, 400)[0] for r in reqs]


@pytest.mark.parametrize("seed", range(12))
def test_random_arrivals_and_cancels_with_paging_stay_solo(seed):
    rnd = random.Random(seed)
    sched, runner = _sched(16 * rnd.randint(6, 10), 16 * rnd.choice([6, 64]), max_concurrency=rnd.randint(2, 8),
                           chunk_size=rnd.choice([4, 8, 16]), residency_quantum=rnd.randint(1, 8),
                           prefix_cache=rnd.random() < 0.5, preemption=rnd.choice(["swap", "recompute"]))
    arrivals: dict[int, list] = {}
    cancels: dict[int, list] = {}
    reqs = []
    for i in range(12):
        r = req(f"r{i}", rnd.randint(3, 40), max_tokens=rnd.randint(1, 40), seed=rnd.randrange(5))
        reqs.append(r)
        at = rnd.randint(0, 30)
        arrivals.setdefault(at, []).append(r)
        if rnd.random() < 0.25:
            cancels.setdefault(at + rnd.randint(0, 40), []).append(r.request_id)
    result = drive(sched, runner, arrivals=arrivals, cancels=cancels, check=_check)
    for r in reqs:
        ev = result.events[r.request_id]
        ref = solo_reference(r, 400)[0]
        if ev.kind == "finished":
            assert list(ev.output_ids) == ref
        else:
            assert list(ev.output_ids) == ref[: len(ev.output_ids)]
    # (a request cancelled while paged out leaves its copy in the fake's store; the allocator's
    # host pages are what must all come back)
    assert sched.allocator.num_sequences == 0
    assert all(h.num_used == 0 for h in sched.allocator.host.values())


# -- the engine: torch runner (tests/test_paged_engine.py's engine, prompts and reference) ---------


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_paging_out_and_in_is_bitwise_the_all_resident_run(tiny_model, preemption, temperature):
    """Four requests of 300-420 positions (two pages of 256 each) on a four-page pool: half the
    live KV fits. Against the same requests on a pool that holds them all, tokens and logits."""
    m = tiny_model("llama", "bfloat16")
    prompts = [_ids(100 + 40 * i, seed=i) for i in range(4)]
    kw = dict(max_tokens=200, temperature=temperature, top_k=40 if temperature else None,
              seed=7 if temperature else None, ignore_eos=True)
    e = _engine(m, 4, kv_resident_tokens=4 * 256, kv_host_tokens=16 * 256, preemption=preemption,
                residency_quantum=8, chunk_size=64)
    hs = [e.submit(p, index=i, **kw) for i, p in enumerate(prompts)]
    e.run_until_done()
    rs = [h.result() for h in hs]
    steps, reqs = e.telemetry.steps(), e.telemetry.requests()
    if preemption == "swap":
        assert sum(r.num_swaps for r in rs) > 0 and sum(r.num_preemptions for r in rs) == 0
        assert steps["pages_out"].sum() > 0 and steps["pages_out"].sum() == steps["pages_in"].sum()
        assert steps["bytes_out"].sum() > 0 and steps["transfer_ms"].sum() > 0
        assert steps["swaps_out"].sum() == reqs["num_swaps"].sum()
    else:
        assert sum(r.num_swaps for r in rs) == 0 and sum(r.num_preemptions for r in rs) > 0
        assert steps["pages_out"].sum() == 0
    for i, (p, r) in enumerate(zip(prompts, rs)):
        _same(r, _reference(m, p, 200, temperature, 7 if temperature else None, i))
    alloc = e.scheduler.allocator
    alloc.check()
    assert alloc.num_sequences == 0 and all(h.num_used == 0 for h in alloc.host.values())


def test_engine_cancel_while_paged_out_frees_its_host_pages(tiny_model):
    m = tiny_model("llama", "bfloat16")
    e = _engine(m, 3, kv_resident_tokens=2 * 256, kv_host_tokens=8 * 256, residency_quantum=50, chunk_size=64)
    hs = [e.submit(_ids(200, seed=i), max_tokens=120, ignore_eos=True) for i in range(3)]
    alloc = e.scheduler.allocator
    while not sum(h.num_used for h in alloc.host.values()):  # until one is paged out holding host pages
        e.step()
    paged = [h for h in hs if h.request_id in alloc and not alloc.sequence(h.request_id).resident]
    assert paged
    e.cancel(paged[0].request_id)
    e.run_until_done()
    alloc.check()
    assert alloc.num_sequences == 0 and all(h.num_used == 0 for h in alloc.host.values())
    assert [h.result().finish_reason for h in hs if h is not paged[0]] == ["max_tokens"] * 2


# -- config ---------------------------------------------------------------------------------------

def test_a_request_the_host_store_cannot_hold_alone_is_refused_in_one_line():
    sched, _ = _sched(256, 32, max_concurrency=2, chunk_size=8)  # 2 host pages of 16
    with pytest.raises(WorkbenchError, match=r"^request 'r0' needs 3 host pages \(48 positions\) of KV group "
                                             r"'global' for 40 tokens but the host store holds 2: allowed "
                                             r"kv_host_tokens >= 48, or lower max_tokens$"):
        sched.add(req("r0", 20, max_tokens=20))


@pytest.mark.parametrize("kw, msg", [
    (dict(eviction="fifo"), "eviction='fifo' is not allowed: allowed lru"),
    (dict(preemption="drop"), "preemption='drop' is not allowed: allowed swap, recompute"),
    (dict(kv_host_tokens=0), "kv_host_tokens=0 is out of range: allowed >= 1 or None"),
    (dict(residency_quantum=0), "residency_quantum=0 is out of range: allowed >= 1"),
])
def test_bad_residency_options_name_what_is_allowed(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig(**kw)


# -- the engine: Triton runner (the interpreter here, natively on the device) --------------------

def test_triton_paging_out_and_in_is_bitwise_each_request_alone(tiny_model):
    """Three requests of a page each on a two-page pool (tests/test_paged_triton.py's menu and
    reference: each alone on a fresh one-slot engine, NaN-poisoned pools): when the oldest grows
    into its second page the newest is paged out, and the quantum of two steps turns the
    resident set over; tokens and logits are bitwise the solo runs."""
    from test_paged_triton import PAGE, _engine as triton_engine, _llama, _no_page_left, _ref, _same, _submit

    m = _llama(tiny_model)
    e = triton_engine(m, 3, kv_resident_tokens=2 * PAGE, kv_host_tokens=8 * PAGE, residency_quantum=2)
    e.runner.host.k[e.runner.kv.groups[0]].fill_(float("nan"))  # (a host page read before written shows)
    names = ("p0", "p1", "q")
    hs = [_submit(e, n) for n in names]
    e.run_until_done()
    rs = [h.result() for h in hs]
    steps = e.telemetry.steps()
    assert sum(r.num_swaps for r in rs) > 0 and sum(r.num_preemptions for r in rs) == 0
    assert steps["pages_out"].sum() > 0 and steps["pages_in"].sum() == steps["pages_out"].sum()
    assert steps["bytes_in"].sum() > 0
    for n, r in zip(names, rs):
        _same(r, _ref(m, n))
    _no_page_left(e)
    assert all(h.num_used == 0 for h in e.scheduler.allocator.host.values())
