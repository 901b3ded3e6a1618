"""TorchRunner: the one object that owns the device tensors (model weights, per-slot KV).

It answers the scheduler's questions (bytes per slot and per row, which slots batch exactly)
and runs a step's forwards. Slot state is allocated at admission for exactly the context the
request reserved, and dropped when the slot is reset.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from .attention import round_up_capacity
from .model import Model, Segment as ModelSegment
from .planner import SlotView
from .scheduler import Segment


class TorchRunner:
    supports_fused_step = True

    def __init__(self, model: Model, slot_capacity: int):
        self.model = model
        self.slot_capacity = slot_capacity
        c = model.config
        elem = torch.finfo(model.dtype).bits // 8
        weights = sum(t.numel() * t.element_size() for layer in model.layers for t in vars(layer).values() if t is not None)
        head = model.head.numel() * model.head.element_size()
        self.fixed_bytes = int(weights + head + model.embed_raw.numel())
        # what one decode step reads (the bandwidth floor's bytes): every layer weight and the
        # head; of the embedding table only the gathered rows
        self.step_weight_bytes = int(weights + head)
        # Activation bytes one prefill row holds at the widest point of a layer (float32
        # residual, qkv, attention output, gate/up and their product), plus the bf16 copies.
        per_row = 4 * (3 * c.n_embd + c.q_dim + 2 * c.kv_dim + c.q_dim + 3 * c.n_ff) + elem * (c.n_embd + 2 * c.n_ff)
        self.bytes_per_prefill_row = int(per_row)
        self._kv_per_token = c.kv_bytes_per_token(4)
        self._states: dict[int, tuple[Hashable, object]] = {}

    # -- RunnerInfo ----------------------------------------------------------------------
    def cache_bytes(self, num_tokens: int) -> int:
        return self._kv_per_token * round_up_capacity(num_tokens)

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        # Every op of the torch path is row-invariant (linear.py, attention.py), so every
        # slot batches exactly. Later state kinds (sparse indexer past its dense boundary,
        # paged-out KV) answer False here with their reason.
        return True, None

    # -- state -----------------------------------------------------------------------------
    def state(self, slot: int, request_id: Hashable, max_context: int):
        cur = self._states.get(slot)
        if cur is None or cur[0] != request_id:
            cur = (request_id, self.model.new_state(max_context))
            self._states[slot] = cur
        return cur[1]

    def reset(self, slot: int) -> None:
        self._states.pop(slot, None)

    @property
    def kv_bytes(self) -> int:
        return sum(s.k.numel() * 8 for _, s in self._states.values())

    # -- run -------------------------------------------------------------------------------
    def run(self, forward: Sequence[Segment], max_context: dict[int, int],
            argmax: frozenset[int] = frozenset(), ahead: bool = False) -> dict[int, torch.Tensor | int]:
        """One forward call; returns slot id -> float32 logits of its last row (where sampled).
        ``argmax``: slots for which the runner MAY return the greedy token (an int) instead;
        on the CPU the logits are already where the engine samples, so this runner never does.
        ``ahead``: a hint that the next call will be these rows one position on (runners with
        an asynchronous device may start it early; this one runs synchronously and ignores it)."""
        segs = []
        for s in forward:
            st = self.state(s.slot_id, s.request_id, max_context[s.slot_id])
            if st.length != s.start_pos:
                raise RuntimeError(f"slot {s.slot_id}: KV holds {st.length} tokens, plan starts at {s.start_pos}")
            segs.append(ModelSegment(st, s.token_ids, "last" if s.samples else "none"))
        logits = self.model.forward(segs)
        return {s.slot_id: lg[0] for s, lg in zip(forward, logits) if lg is not None}
