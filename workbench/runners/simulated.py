"""A simulated device: a runner whose forwards also take a modelled device's time on one stream.

Why: the engine's scheduling decisions (the yield guard's, the step rule's, whether the
pipeline starts and stays) depend on what steps cost on a GPU, and a GPU is not always at hand.
`SimulatedDevice` wraps a runner and keeps its answers (or a replay's, `answer=`), and gives each
forward the time a `DeviceModel` says, queued on one stream as the Triton runner's are: a plain
step that the engine lets run ahead is launched behind the one before it, the pipeline's halves
(`launch`) queue behind each other and are answered when their time is over, and a step run
synchronously waits for its own. The time is a clock's: `WallClock` (real time: the engine's
own host work runs beside the device, as on a GPU; `scripts/host_overhead.py --device-ms`) or
`VirtualClock` (deterministic, for tests: the host's work before each runner call takes
`host_ms` = a + b x rows of the forward, and nothing else takes time). Either way the host's
work before a call overlaps what the device still runs (a plain step launched ahead, the other
half's forward), as on a GPU.

A plain step (every segment one row, the decode graph) costs `plain[0] + plain[1] * rows` ms,
any other forward (a verify's or a prefill's chunk graph) `other[0] + other[1] * rows`. H100
figures (docs/GPU_NOTES.md, runs 104 and 107, 16 slots at 2048 positions): plain 0.56 + 0.006,
other 0.52 + 0.0165.
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import WorkbenchError
from ..runner import Launched

__all__ = ["DeviceModel", "SimulatedDevice", "VirtualClock", "WallClock"]


class DeviceModel:
    """A forward's device time in ms: plain steps and other forwards, each a + b x rows."""

    def __init__(self, plain: tuple[float, float], other: tuple[float, float]):
        if min(*plain, *other) < 0:
            raise WorkbenchError(f"device model plain={plain} other={other} has a negative time: allowed numbers >= 0")
        self.plain, self.other = tuple(plain), tuple(other)

    @classmethod
    def parse(cls, spec: str) -> DeviceModel:
        """From "PA,PB,VA,VB" (scripts' --device-ms)."""
        try:
            pa, pb, va, vb = (float(x) for x in spec.split(","))
        except ValueError:
            raise WorkbenchError(f"device model {spec!r} is not PA,PB,VA,VB: four numbers, ms and ms a row") from None
        return cls((pa, pb), (va, vb))

    def ms(self, forward) -> float:
        rows = sum(len(s.token_ids) for s in forward)
        a, b = self.plain if all(len(s.token_ids) == 1 for s in forward) else self.other
        return a + b * rows


class WallClock:
    """Real time (time.perf_counter)."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def wait(until: float) -> None:
        """A sleep short of `until`, then a spin: a sleep alone overshoots by tens of us, and a
        step's host time is hundreds."""
        left = until - time.perf_counter()
        if left > 3e-4:
            time.sleep(left - 3e-4)
        while time.perf_counter() < until:
            pass

    def spend(self, ms: float) -> None:
        """(The host's own time passes by itself.)"""


class VirtualClock:
    """Seconds that pass only when told: `wait` jumps to a time, `spend` adds a host's work.
    `perf_counter` is `now`, so a module's `time` can be this clock (tests)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    perf_counter = now

    def wait(self, until: float) -> None:
        self.t = max(self.t, until)

    def spend(self, ms: float) -> None:
        self.t += ms / 1e3


class SimulatedDevice:
    """Stands in for the engine's runner (module docstring): `run` and `launch` answer as the
    wrapped runner does (or as `answer(forward)` says), after the modelled device time; all else
    (its page pool, resets, page moves) is the wrapped runner's. `host_ms`: (a, b), the host's
    time before each call, a + b x rows of its forward (a VirtualClock's only time passing; a
    WallClock's host is the real one, and spends none).
    `model` None: no device time at all, every forward answered at once (a replay's host alone)."""

    def __init__(self, inner, model: DeviceModel | None, clock=None, answer: Callable | None = None,
                 host_ms: tuple[float, float] = (0.0, 0.0)):
        self.inner, self.model = inner, model
        self.clock = clock if clock is not None else WallClock()
        self._answer = answer
        self.host_ms = host_ms
        self._free_at = 0.0  # when the stream is done with what was queued (the clock's seconds)
        self._ahead: float | None = None  # the end of a plain step launched ahead (None: none)
        self._ahead_used = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def asynchronous(self) -> bool:
        """A modelled device's forwards run on its stream while the host goes on."""
        return self.model is not None

    @property
    def ahead_in_flight(self) -> bool:
        return self._ahead is not None

    @property
    def num_ahead_used(self) -> int:
        return self._ahead_used

    def drain(self) -> None:
        self._ahead = None  # (its time stays queued on the stream)

    def _answer_of(self, forward, max_context, argmax):
        if self._answer is not None:
            return self._answer(forward)
        return self.inner.run(forward, max_context, argmax)

    def _host(self, forward) -> None:
        """The host's work before this call (planning, drafting, the last step's bookkeeping)."""
        a, b = self.host_ms
        self.clock.spend(a + b * sum(len(s.token_ids) for s in forward))

    def _queue(self, forward) -> float:
        """Queue the forward on the stream: when it ends."""
        start = max(self.clock.now(), self._free_at)
        self._free_at = start + self.model.ms(forward) / 1e3
        return self._free_at

    def launch(self, forward, max_context, argmax=frozenset()) -> Launched:
        """The pipeline's launch: answered when its forward's time is over."""
        answer = self._answer_of(forward, max_context, argmax)
        if self.model is None:
            return Launched(answer)
        self._host(forward)
        end = self._queue(forward)
        return Launched(lambda: (self.clock.wait(end), answer)[1])

    def run(self, forward, max_context, argmax=frozenset(), ahead=False):
        answer = self._answer_of(forward, max_context, argmax)
        if self.model is None:
            return answer
        self._host(forward)
        if self._ahead is not None:  # (the previous step launched this one: the same rows)
            end, self._ahead = self._ahead, None
            self._ahead_used += 1
        else:
            end = self._queue(forward)
        self.clock.wait(end)
        if ahead:
            self._ahead = self._queue(forward)
        return answer
