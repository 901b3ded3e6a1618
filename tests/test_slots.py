import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.errors import WorkbenchError
from workbench.slots import SlotTable


def test_lowest_free_id_first():
    t = SlotTable(3)
    assert [t.allocate(r) for r in "abc"] == [0, 1, 2]
    assert not t.can_allocate()
    assert t.free(1) == "b"
    assert t.allocate("d") == 1
    t.free(0)
    t.free(2)
    assert t.allocate("e") == 0
    assert t.slot_of("d") == 1 and t.slot_of("b") is None
    assert (t.num_free, t.num_used) == (1, 2)
    assert t.used_slots() == [0, 1]


def test_refuses_double_ownership_and_bad_frees():
    t = SlotTable(2)
    t.allocate("a")
    with pytest.raises(WorkbenchError, match="already owns slot 0"):
        t.allocate("a")
    with pytest.raises(WorkbenchError, match="slot 1 is not in use"):
        t.free(1)
    with pytest.raises(WorkbenchError, match="slot 2 does not exist: allowed 0..1"):
        t.free(2)
    t.allocate("b")
    with pytest.raises(WorkbenchError, match="no free slot"):
        t.allocate("c")


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_bad_size(n):
    with pytest.raises(WorkbenchError, match="num_slots"):
        SlotTable(n)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=60))
def test_random_allocate_free_keeps_invariants(n, ops):
    t = SlotTable(n)
    owned: dict[int, int] = {}  # request -> slot, the model
    for do_alloc, k in ops:
        if do_alloc and k not in owned and t.can_allocate():
            slot = t.allocate(k)
            expected = min(set(range(n)) - set(owned.values()))
            assert slot == expected
            owned[k] = slot
        elif not do_alloc and owned:
            rid = sorted(owned)[k % len(owned)]
            assert t.free(owned.pop(rid)) == rid
        t.check()
        assert t.num_free + t.num_used == n
        assert t.num_used == len(owned)
        assert len(set(owned.values())) == len(owned)
        assert all(t.slot_of(r) == s and t.owner(s) == r for r, s in owned.items())
