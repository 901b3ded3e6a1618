"""The two memory forms on their own (workbench.memory), without the scheduler: what each one
promises the scheduler at its seams. The scheduler tests cover them in use."""

import pytest

from fake_runner import FakePagedRunner, FakeRunner
from workbench.engine_config import EngineConfig
from workbench.memory import STEP_STAT_KEYS, CacheMemory, PagedMemory, ReservedMemory
from workbench.planner import DecodeGroup, PrefillChunk, StepPlan


def plan(decode=(), chunks=()):
    groups = (DecodeGroup(tuple(decode), True, "exact-batch"),) if decode else ()
    return StepPlan(groups, tuple(PrefillChunk(s, 0, n) for s, n in chunks), 64, "override", "decode-first", False)


def paged_memory(pool_tokens=64, **config):
    config = EngineConfig(memory_budget_bytes=1 << 30, kv_resident_tokens=pool_tokens, admission_headroom_tokens=0,
                          **config)
    return PagedMemory(config, FakePagedRunner(slot_capacity=400), 1 << 30, 400)


def test_both_forms_have_every_operation_of_the_protocol():
    ops = {n for n in vars(CacheMemory) if not n.startswith("_")}
    assert ops >= {"admit", "fit", "release", "retire", "commit", "check_fits", "step_stats"}
    for form in (ReservedMemory, PagedMemory):
        assert ops <= set(dir(form)), form.__name__


def test_reserved_admits_while_the_budget_holds_each_full_cache_and_one_row_a_slot():
    runner = FakeRunner()  # 1024 B a token, 256 B a row, 4096 B fixed
    mem = ReservedMemory(runner, 4096 + 2 * 100 * 1024 + 2 * 256)
    assert mem.admit("a", (1,) * 10, 100) == 0 and mem.admit("b", (1,) * 10, 100) == 0
    assert mem.admit("c", (1,), 1) is None  # a third row does not fit
    assert mem.reserved_bytes == 200 * 1024
    mem.release("a", fence=None)
    assert mem.reserved_bytes == 100 * 1024 and mem.admit("c", (1,), 1) == 0
    p = plan(decode=[0])
    assert mem.fit(p, {0: "b", 1: "c"}, None) is p  # a reservation never grows
    with pytest.raises(RuntimeError, match="preempted"):
        mem.release("b", None, preempted=True)


def test_without_pages_the_step_columns_are_none():
    assert ReservedMemory(FakeRunner(), 1 << 30).step_stats() == dict.fromkeys(STEP_STAT_KEYS)


def test_paged_fit_that_fails_takes_nothing_and_counts_no_preemption_until_release():
    mem = paged_memory(64)  # 4 pages of 16 in each group
    assert mem.admit("a", tuple(range(48)), 100) == 0  # 3 pages
    assert mem.fit(plan(chunks=[(0, 48)]), {0: "a"}, 0) is not None
    mem.commit("a", tuple(range(48)))
    assert mem.admit("b", (5,) * 16, 100) == 0
    mem.fit(plan(chunks=[(1, 16)]), {0: "a", 1: "b"}, 1)  # the pool is full now
    free = {g: p.num_available for g, p in mem.allocator.pools.items()}
    assert mem.fit(plan(decode=[0, 1]), {0: "a", 1: "b"}, 2) is None  # a's page 4 is not there
    assert {g: p.num_available for g, p in mem.allocator.pools.items()} == free
    mem.allocator.check()
    assert mem.step_stats()["num_preemptions"] == 0
    mem.release("b", 2, preempted=True)
    stats = mem.step_stats()
    assert set(STEP_STAT_KEYS) <= set(stats) and stats["num_preemptions"] == 1
    assert mem.step_stats()["num_preemptions"] == 0  # counted since the previous read


def test_paged_fit_shrinks_a_chunk_to_the_pages_left_oldest_admission_first():
    mem = paged_memory(64)
    assert mem.admit("old", (1,) * 40, 100) == 0 and mem.admit("new", (2,) * 40, 100) == 0
    fitted = mem.fit(plan(chunks=[(1, 40), (0, 40)]), {0: "old", 1: "new"}, 0)
    assert {c.slot_id: c.length for c in fitted.prefill_chunks} == {0: 40, 1: 16}  # 3 pages, then 1
    tables, copies = mem.segment_fields("new")
    assert len(tables["global"]) == 1 and copies == ()
