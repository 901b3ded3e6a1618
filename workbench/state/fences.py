"""Quarantine: things handed back while a launched step may still touch them (seed 002's
pending-write protection).

A run-ahead step is launched before the host has committed the previous one, so a sequence may
finish, be preempted or roll back while a step that writes its pages is still on the device.
What it hands back under a fence (the id of the newest step that may still touch it) is held
here, out of every free list, until the engine retires that step; then it is released.

Step ids are integers the engine issues in increasing order and retires in order: retiring
step s retires every fence <= s. Holding under a fence that is already retired releases at
once. Plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..errors import WorkbenchError


class Quarantine:
    def __init__(self) -> None:
        self._held: dict[int, list[Hashable]] = {}  # fence -> items, in the order held
        self._retired = -1  # every fence <= this one is retired
        self._count = 0

    @property
    def num_held(self) -> int:
        return self._count

    @property
    def retired(self) -> int:
        return self._retired

    def is_pending(self, fence: int | None) -> bool:
        """Whether a step with this fence may still be on the device."""
        return fence is not None and fence > self._retired

    def hold(self, fence: int, item: Hashable) -> None:
        _check_fence(fence)
        if fence <= self._retired:
            raise WorkbenchError(f"fence={fence} is already retired: allowed > {self._retired}")
        self._held.setdefault(fence, []).append(item)
        self._count += 1

    def retire(self, step_id: int) -> list[Hashable]:
        """Retire every fence <= step_id; returns the items they held, oldest fence first."""
        _check_fence(step_id)
        if step_id < self._retired:
            raise WorkbenchError(f"step {step_id} is older than the retired step {self._retired}: allowed >= {self._retired}")
        self._retired = step_id
        out: list[Hashable] = []
        for fence in sorted(f for f in self._held if f <= step_id):
            out += self._held.pop(fence)
        self._count -= len(out)
        return out

    def items(self) -> list[Hashable]:
        return [x for f in sorted(self._held) for x in self._held[f]]


def _check_fence(fence: object) -> None:
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        raise WorkbenchError(f"fence={fence!r} is not a step id: allowed an integer >= 0")
