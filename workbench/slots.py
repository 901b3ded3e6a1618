"""SlotTable: a fixed set of slots, each owned by at most one request.

A slot is a row of device state (its KV cache and whatever else the model keeps per sequence).
Slot ids are 0..n-1 and never change; the lowest free id is handed out first, so a run is
deterministic. Plain Python: no torch.
"""

from __future__ import annotations

from typing import Hashable

from .errors import WorkbenchError


class SlotTable:
    def __init__(self, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise WorkbenchError(f"num_slots={num_slots!r} is out of range: allowed >= 1")
        self._num_slots = num_slots
        self._owner: list[Hashable | None] = [None] * num_slots
        self._slot_of: dict[Hashable, int] = {}

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return self._num_slots - len(self._slot_of)

    def can_allocate(self) -> bool:
        return self.num_free > 0

    def allocate(self, request_id: Hashable) -> int:
        if request_id in self._slot_of:
            raise WorkbenchError(
                f"request {request_id!r} already owns slot {self._slot_of[request_id]}"
            )
        for slot_id, owner in enumerate(self._owner):
            if owner is None:
                self._owner[slot_id] = request_id
                self._slot_of[request_id] = slot_id
                return slot_id
        raise WorkbenchError(f"no free slot: all {self._num_slots} slots are in use")

    def free(self, slot_id: int) -> Hashable:
        """Free a slot; returns the request that owned it."""
        if not (isinstance(slot_id, int) and 0 <= slot_id < self._num_slots):
            raise WorkbenchError(
                f"slot {slot_id!r} does not exist: allowed 0..{self._num_slots - 1}"
            )
        owner = self._owner[slot_id]
        if owner is None:
            raise WorkbenchError(f"slot {slot_id} is not in use")
        self._owner[slot_id] = None
        del self._slot_of[owner]
        return owner

    def slot_of(self, request_id: Hashable) -> int | None:
        return self._slot_of.get(request_id)

    def owner(self, slot_id: int) -> Hashable | None:
        return self._owner[slot_id]

    def used_slots(self) -> list[int]:
        """Slot ids in use, ascending."""
        return [s for s, owner in enumerate(self._owner) if owner is not None]

    def check(self) -> None:
        """Assert the table's invariants (tests call this every step)."""
        owned = [(s, o) for s, o in enumerate(self._owner) if o is not None]
        assert len(owned) == len(self._slot_of), "slot and request maps disagree"
        assert all(self._slot_of[o] == s for s, o in owned), "a request owns two slots"
        assert self.num_free + self.num_used == self._num_slots
