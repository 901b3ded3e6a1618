"""workbench/runners/simulated.py: a runner's forwards timed by a device model on one stream of
a virtual clock. The schedule is the Triton runner's: a plain step launched ahead runs while the
host prepares the next, a synchronous step waits for its own forward, launches queue behind
each other; the host's time before each call overlaps whatever the device still runs."""

import pytest

from workbench.errors import WorkbenchError
from workbench.runners.simulated import DeviceModel, SimulatedDevice, VirtualClock
from workbench.scheduler import Segment


class _Inner:
    def run(self, forward, max_context, argmax=frozenset()):
        return {s.slot_id: len(s.token_ids) for s in forward}


def _fwd(rows_per_slot, slots=2):
    return [Segment(slot_id=i, request_id=f"r-{i}", token_ids=(1,) * rows_per_slot, start_pos=10,
                    samples=True, scored=rows_per_slot) for i in range(slots)]


def _device(host=(0.5, 0.0)):
    clock = VirtualClock()
    # plain: 1 ms + 0.5 a row; other: 2 ms + 0.25 a row
    return SimulatedDevice(_Inner(), DeviceModel((1.0, 0.5), (2.0, 0.25)), clock, host_ms=host), clock


def test_plain_steps_run_ahead_take_the_longer_of_host_and_device():
    dev, clock = _device()
    assert dev.run(_fwd(1), {}, ahead=True) == {0: 1, 1: 1}  # (the wrapped runner's answer)
    assert clock.t == pytest.approx(0.5e-3 + 2e-3)  # host, then its own forward (2 rows: 2 ms)
    assert dev.ahead_in_flight
    for _ in range(3):
        t0 = clock.t
        dev.run(_fwd(1), {}, ahead=True)
        assert clock.t - t0 == pytest.approx(2e-3)  # (the host's 0.5 ms hidden under the device's 2)
    assert dev.num_ahead_used == 3


def test_a_verify_waits_for_its_forward_and_launches_queue_behind_each_other():
    dev, clock = _device()
    dev.run(_fwd(5), {})  # a verify of 10 rows: 2 + 2.5 ms, after 0.5 of host
    assert clock.t == pytest.approx(5e-3) and not dev.ahead_in_flight
    a = dev.launch(_fwd(3), {})  # 6 rows: 3.5 ms
    b = dev.launch(_fwd(3), {})
    assert clock.t == pytest.approx(6e-3)  # (two hosts; nothing waited)
    assert a.result() == {0: 3, 1: 3} and clock.t == pytest.approx(5.5e-3 + 3.5e-3)
    b.result()
    assert clock.t == pytest.approx(9e-3 + 3.5e-3)  # (b ran after a on the one stream)


def test_the_host_may_grow_with_rows_and_a_bad_model_is_one_line():
    dev, clock = _device(host=(0.5, 0.1))
    dev.run(_fwd(5), {})
    assert clock.t == pytest.approx((0.5 + 1.0 + 4.5) * 1e-3)
    with pytest.raises(WorkbenchError, match="is not PA,PB,VA,VB"):
        DeviceModel.parse("1,2")
    with pytest.raises(WorkbenchError, match="negative"):
        DeviceModel.parse("1,-2,3,4")
    assert DeviceModel.parse("0.56,0.006,0.52,0.0165").ms(_fwd(1, slots=16)) == pytest.approx(0.56 + 0.096)
