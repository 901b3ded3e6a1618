import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.errors import WorkbenchError
from workbench.planner import (
    BatchPlanner,
    ChunkSizer,
    DecodeGroup,
    Forward,
    PrefillChunk,
    SlotView,
)

GiB = 1 << 30


def prefill(slot, prompt_len, done=0):
    return SlotView(slot, f"r{slot}", "prefill", prompt_len, done, 0, done, prompt_len + 8)


def decode(slot, context=10, batchable=True, reason=None):
    return SlotView(slot, f"r{slot}", "decode", 5, 5, context - 4, context, 64, batchable, reason)


# -- ChunkSizer ------------------------------------------------------------------------------


def test_auto_chunk_is_what_the_budget_leaves():
    sizer = ChunkSizer(cap=4096)
    chunk, reason = sizer.size(
        budget_bytes=10_000, reserved_cache_bytes=3_000, fixed_bytes=2_000, bytes_per_prefill_row=100
    )
    assert chunk == 50
    assert reason.startswith("auto: budget") and reason.endswith("-> 50 rows")


def test_auto_chunk_is_capped():
    # seed 000: uncapped, auto-sizing picked 12,800 rows and stalled the other slots' decode
    sizer = ChunkSizer(cap=4096)
    chunk, reason = sizer.size(
        budget_bytes=2 * GiB, reserved_cache_bytes=GiB, fixed_bytes=0, bytes_per_prefill_row=1 << 16
    )
    assert chunk == 4096
    assert reason == "auto: budget 2.0GiB - reserved 1.0GiB - fixed 0B -> 16384 rows, capped at 4096"


def test_auto_chunk_reserves_decode_rows():
    sizer = ChunkSizer(cap=4096)
    chunk, reason = sizer.size(
        budget_bytes=1000, reserved_cache_bytes=0, fixed_bytes=0, bytes_per_prefill_row=10, decode_rows=3
    )
    assert chunk == 97 and "- 3 decode rows -> 97 rows" in reason


def test_override_wins():
    sizer = ChunkSizer(cap=4096, override=7)
    assert sizer.size(
        budget_bytes=1, reserved_cache_bytes=10, fixed_bytes=10, bytes_per_prefill_row=10
    ) == (7, "override")


def test_budget_that_fits_no_row_raises():
    sizer = ChunkSizer(cap=4096)
    with pytest.raises(WorkbenchError, match="cannot fit one prefill row"):
        sizer.size(budget_bytes=1000, reserved_cache_bytes=900, fixed_bytes=91, bytes_per_prefill_row=10)
    with pytest.raises(WorkbenchError, match="cannot fit one prefill row"):
        sizer.size(budget_bytes=100, reserved_cache_bytes=200, fixed_bytes=0, bytes_per_prefill_row=10)


@pytest.mark.parametrize("kwargs,field", [({"cap": 0}, "chunk_cap"), ({"override": 0}, "chunk_size")])
def test_sizer_bad_values(kwargs, field):
    with pytest.raises(WorkbenchError, match=field):
        ChunkSizer(**kwargs)


# -- decode groups ---------------------------------------------------------------------------


def test_decode_groups_batch_exact_slots_up_to_max_rows():
    plan = BatchPlanner().plan(
        [decode(s) for s in (4, 0, 2, 1, 3)], chunk_size=8, max_batch_rows=2, policy="decode-first"
    )
    assert plan.decode_groups == (
        DecodeGroup((0, 1), True, "exact-batch"),
        DecodeGroup((2, 3), True, "exact-batch"),
        DecodeGroup((4,), False, "single"),
    )
    assert plan.num_solo_fallback == 0 and plan.num_decode_rows == 5


def test_non_batchable_slots_run_solo_with_their_reason():
    views = [decode(0), decode(1, batchable=False, reason="sparse past 2051"), decode(2), decode(3, batchable=False)]
    plan = BatchPlanner().plan(views, chunk_size=8, max_batch_rows=64, policy="decode-first")
    assert plan.decode_groups == (
        DecodeGroup((0, 2), True, "exact-batch"),
        DecodeGroup((1,), False, "sparse past 2051"),
        DecodeGroup((3,), False, "not exactly batchable"),
    )
    assert plan.num_solo_fallback == 2


# -- prefill chunks --------------------------------------------------------------------------


def test_prefill_splits_fairly_and_interleaves():
    planner = BatchPlanner()
    plan = planner.plan([prefill(0, 1000), prefill(1, 1000)], chunk_size=64, max_batch_rows=64, policy="decode-first")
    assert plan.prefill_chunks == (PrefillChunk(0, 0, 32), PrefillChunk(1, 0, 32))


def test_prefill_short_prompt_gives_its_leftover_to_the_others():
    plan = BatchPlanner().plan(
        [prefill(0, 5), prefill(1, 1000, done=100), prefill(2, 1000)],
        chunk_size=65, max_batch_rows=64, policy="decode-first",
    )
    assert plan.prefill_chunks == (PrefillChunk(0, 0, 5), PrefillChunk(1, 100, 30), PrefillChunk(2, 0, 30))


def test_rotation_shares_leftover_rows_so_nobody_starves():
    planner = BatchPlanner()
    views = [prefill(s, 100) for s in range(3)]
    firsts = []
    for _ in range(3):
        plan = planner.plan(views, chunk_size=2, max_batch_rows=64, policy="decode-first")
        assert plan.num_prefill_rows == 2
        firsts.append({c.slot_id for c in plan.prefill_chunks})
    assert firsts == [{0, 1}, {1, 2}, {2, 0}]


def test_policies():
    views = [decode(0), decode(1), prefill(2, 100)]
    df = BatchPlanner().plan(views, chunk_size=16, max_batch_rows=64, policy="decode-first")
    assert df.decode_groups == (DecodeGroup((0, 1), True, "exact-batch"),)
    assert df.prefill_chunks == (PrefillChunk(2, 0, 16),) and df.fused
    assert df.forwards() == (Forward((0, 1), (PrefillChunk(2, 0, 16),)),)

    pf = BatchPlanner().plan(views, chunk_size=16, max_batch_rows=64, policy="prefill-first")
    assert pf.decode_groups == () and pf.prefill_chunks == (PrefillChunk(2, 0, 16),) and not pf.fused

    only_decode = BatchPlanner().plan(views[:2], chunk_size=16, max_batch_rows=64, policy="prefill-first")
    assert only_decode.decode_groups == (DecodeGroup((0, 1), True, "exact-batch"),)


def test_not_fused_when_runner_refuses_or_first_group_is_solo():
    views = [decode(0, batchable=False, reason="sparse"), prefill(1, 10)]
    plan = BatchPlanner().plan(views, chunk_size=16, max_batch_rows=64, policy="decode-first")
    assert not plan.fused
    assert plan.forwards() == (Forward((0,), ()), Forward((), (PrefillChunk(1, 0, 10),)))
    views = [decode(0), prefill(1, 10)]
    plan = BatchPlanner().plan(views, chunk_size=16, max_batch_rows=64, policy="decode-first", fuse=False)
    assert not plan.fused and len(plan.forwards()) == 2


def test_bad_policy():
    with pytest.raises(WorkbenchError, match="policy='fifo' is not allowed: allowed decode-first, prefill-first"):
        BatchPlanner().plan([], chunk_size=1, max_batch_rows=1, policy="fifo")


@st.composite
def slot_views(draw):
    slots = draw(st.lists(st.integers(0, 15), unique=True, max_size=10))
    views = []
    for s in slots:
        if draw(st.booleans()):
            n = draw(st.integers(1, 300))
            views.append(prefill(s, n, done=draw(st.integers(0, n - 1))))
        else:
            views.append(decode(s, batchable=draw(st.booleans()), reason="r"))
    return views


@settings(max_examples=150, deadline=None)
@given(slot_views(), st.integers(1, 200), st.integers(1, 5), st.sampled_from(["decode-first", "prefill-first"]),
       st.integers(0, 5))
def test_plan_properties(views, chunk, max_rows, policy, rotation):
    planner = BatchPlanner()
    planner.rotation = rotation
    plan = planner.plan(views, chunk_size=chunk, max_batch_rows=max_rows, policy=policy)
    again = BatchPlanner()
    again.rotation = rotation
    assert again.plan(views, chunk_size=chunk, max_batch_rows=max_rows, policy=policy) == plan
    by_slot = {v.slot_id: v for v in views}
    ids = plan.slot_ids()
    assert len(ids) == len(set(ids)), "a slot appears twice in one step"
    assert plan.num_prefill_rows <= chunk
    prefilling = [v for v in views if v.phase == "prefill"]
    decoding = [v for v in views if v.phase == "decode"]
    for c in plan.prefill_chunks:
        v = by_slot[c.slot_id]
        assert v.phase == "prefill" and c.start == v.num_prefilled
        assert 1 <= c.length <= v.prompt_remaining
    # the budget is used up or every prompt is done
    assert plan.num_prefill_rows == min(chunk, sum(v.prompt_remaining for v in prefilling))
    # fair: no slot gets two rows more than another that still had prompt left
    given = {c.slot_id: c.length for c in plan.prefill_chunks}
    for a in prefilling:
        for b in prefilling:
            if given.get(a.slot_id, 0) < a.prompt_remaining:
                assert given.get(b.slot_id, 0) <= given.get(a.slot_id, 0) + 1
    if policy == "prefill-first" and prefilling:
        assert plan.decode_groups == ()
    else:
        assert sorted(s for g in plan.decode_groups for s in g.slot_ids) == sorted(v.slot_id for v in decoding)
    for g in plan.decode_groups:
        assert len(g.slot_ids) <= max_rows
        assert g.batched == (len(g.slot_ids) > 1)
        if any(not by_slot[s].exact_batchable for s in g.slot_ids):
            assert g.slot_ids and len(g.slot_ids) == 1 and g.reason == "r"
    rows = [s for f in plan.forwards() for s in f.decode_slot_ids] + [
        c.slot_id for f in plan.forwards() for c in f.prefill_chunks
    ]
    assert sorted(rows) == sorted(ids)
