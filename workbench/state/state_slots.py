"""StateSlots: fixed-size per-sequence state outside the pages (a hybrid model's recurrent and
conv state, `StateLayout.seq_state`).

A sequence owns a run of `num_versions` consecutive slots (index * num_versions + v), so the
runner's state tensor is [num_seqs * num_versions, ...]. With speculation of k draft tokens,
num_versions = k + 1 (as vLLM does): version 0 is the state now, version i is where the
verification writes the state after the i-th draft token, and accepting i tokens is
`accept(seq, i)`: version i becomes version 0, with no copy. Rollback is an index.

Invariants: a sequence owns at most one run; free + used + quarantined == num_seqs; the
lowest free run is handed out first (deterministic). Runs handed back under a pending fence
are quarantined (fences.py) until the step retires. Plain Python: no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass

from ..errors import WorkbenchError
from .fences import Quarantine


@dataclass(frozen=True)
class SlotCopy:
    """An instruction to the runner: copy state slot `src` into slot `dst` (every spec)."""

    src: int
    dst: int


class StateSlots:
    def __init__(self, num_seqs: int, num_versions: int = 1):
        for name, v, lo in (("num_state_slots", num_seqs, 0), ("num_versions", num_versions, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise WorkbenchError(f"{name}={v!r} is out of range: allowed an integer >= {lo}")
        self.num_seqs = num_seqs
        self.num_versions = num_versions
        self._free = list(range(num_seqs))  # run indices, a heap
        self._run: dict[Hashable, int] = {}
        self._current: dict[Hashable, int] = {}  # the version that is the state now
        self.quarantine = Quarantine()

    @property
    def num_used(self) -> int:
        return len(self._run)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return self.quarantine.num_held

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, seq_id: Hashable) -> tuple[int, ...]:
        if seq_id in self._run:
            raise WorkbenchError(f"sequence {seq_id!r} already owns state slots")
        if not self._free:
            raise WorkbenchError(f"no free state slot: all {self.num_seqs} are in use or quarantined")
        self._run[seq_id] = heapq.heappop(self._free)
        self._current[seq_id] = 0
        return self.slots(seq_id)

    def slots(self, seq_id: Hashable) -> tuple[int, ...]:
        """The sequence's slot ids by version: [0] is the state now, [i] the state after i
        more tokens of a verification."""
        run, cur, v = self._need(seq_id), self._current[seq_id], self.num_versions
        return tuple(run * v + (cur + i) % v for i in range(v))

    def accept(self, seq_id: Hashable, num_accepted: int) -> int:
        """Make version `num_accepted` the state now; returns its slot id."""
        self._need(seq_id)
        if isinstance(num_accepted, bool) or not isinstance(num_accepted, int) or not 0 <= num_accepted < self.num_versions:
            raise WorkbenchError(f"num_accepted={num_accepted!r} is out of range: allowed 0..{self.num_versions - 1}")
        self._current[seq_id] = (self._current[seq_id] + num_accepted) % self.num_versions
        return self.slots(seq_id)[0]

    def free(self, seq_id: Hashable, fence: int | None = None) -> None:
        run = self._need(seq_id)
        del self._run[seq_id], self._current[seq_id]
        if self.quarantine.is_pending(fence):
            self.quarantine.hold(fence, run)
        else:
            heapq.heappush(self._free, run)

    def retire(self, step_id: int) -> None:
        for run in self.quarantine.retire(step_id):
            heapq.heappush(self._free, run)

    def _need(self, seq_id: Hashable) -> int:
        if seq_id not in self._run:
            raise WorkbenchError(f"sequence {seq_id!r} owns no state slots")
        return self._run[seq_id]

    def check(self) -> None:
        runs = list(self._run.values())
        held = self.quarantine.items()
        assert len(set(runs)) == len(runs), "a state run is owned twice"
        assert not (set(runs) & set(self._free) or set(runs) & set(held) or set(held) & set(self._free))
        assert len(runs) + len(self._free) + len(held) == self.num_seqs, "a state run is lost"
