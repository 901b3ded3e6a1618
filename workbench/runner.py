"""TorchRunner: the one object that owns the device tensors (model weights, the KV pages).

It answers the scheduler's questions (bytes per row, which slots batch exactly, the state
layout its pages follow) and runs a step's forwards. It is paged: the KV of every sequence lives
in one `KVPages` pool per KV group, allocated once (`init_kv_pool`, sized by the scheduler), and
each segment names its pages by block table; which page holds what is the scheduler's
`PageAllocator`'s business. So the runner keeps no per-slot state.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from .attention import round_up_capacity
from .model import KVState, Model, Segment as ModelSegment
from .planner import SlotView
from .scheduler import Segment, check_paged_forward
from .state import cache_key


class Launched:
    """A forward a runner's `launch` enqueued: `result()` is what `run` returns for it (the first
    call waits for the device and brings the answer to the host; later calls give the same)."""

    def __init__(self, answer):
        self._answer = answer  # the answer, or a function that waits for it

    def result(self) -> dict:
        if callable(self._answer):
            self._answer = self._answer()
        return self._answer


class TorchRunner:
    supports_fused_step = True
    paged = True
    asynchronous = False  # `launch` runs the forward before it returns

    def __init__(self, model: Model, slot_capacity: int, qsa=None):
        """qsa: a QSAConfig (workbench/qsa.py): the pages carry its indexer and rows past its
        boundary attend sparsely; None: dense."""
        self.model = model
        self.qsa = qsa
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
        self.state_layout = model.state_layout  # float32 KV, 256-position pages
        if qsa is not None:  # the indexer's summaries are a payload of every page of their group
            from dataclasses import replace

            from .sparse_attention import payload_specs

            self.qsa_layers = qsa.resolve_layers(c)
            self.state_layout = replace(self.state_layout,
                                        page_payloads=payload_specs(qsa, self.qsa_layers, self.state_layout, c))
        # the prefix cache's hashes start from the weights' identity and the KV dtype
        self.kv_cache_key = cache_key(model.source.index.sha256, "float32")
        self.pages = None
        self.host = None  # host backing: a KVPages of host pages (the same layout)
        self._transfer_s = 0.0

    # -- RunnerInfo ----------------------------------------------------------------------
    def cache_bytes(self, num_tokens: int) -> int:
        return self._kv_per_token * round_up_capacity(num_tokens)

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        # Every op of the torch path is row-invariant (linear.py, attention.py), so every
        # slot batches exactly. Later state kinds (sparse indexer past its dense boundary,
        # paged-out KV) answer False here with their reason.
        return True, None

    # -- state -----------------------------------------------------------------------------
    def init_kv_pool(self, num_pages: dict[str, int]) -> None:
        """Allocate the pages: `num_pages` per KV group (the scheduler's `kv_pool_pages`)."""
        self.pages = self.model.new_pages(num_pages, self.qsa)

    def track_page_mass(self) -> None:
        """eviction="scored": measure the attention mass each KV page receives (attention.py)."""
        self.pages.track_mass()

    def take_page_mass(self, group: str, pages) -> list[float]:
        """The attention mass `pages` of `group` received since their last read (zeroed by it):
        the allocator's `mass_reader` (state/pages.py)."""
        return self.pages.take_mass(group, pages)

    def init_host_store(self, num_pages: dict[str, int]) -> None:
        """Allocate the host store (`kv_host_pages`); on the CPU it is a second pool in memory."""
        self.host = self.model.new_pages(num_pages, self.qsa)

    def move_pages(self, moves) -> None:
        """Run a step's `PageMove`s in order: whole pages (every layer, K and V), bit copies."""
        t0 = time.perf_counter()
        for m in moves:
            src, dst = (self.pages, self.host) if m.to_host else (self.host, self.pages)
            i, j = (m.device, m.host) if m.to_host else (m.host, m.device)
            dst.k[m.group][j] = src.k[m.group][i]
            dst.v[m.group][j] = src.v[m.group][i]
            if src.index is not None:  # the page's indexer summaries travel with it
                src.index.move(dst.index, m.group, i, j)
        self._transfer_s += time.perf_counter() - t0

    def read_transfer_s(self) -> float:
        """Seconds spent moving pages since the previous read."""
        out, self._transfer_s = self._transfer_s, 0.0
        return out

    def read_qsa_stats(self) -> dict[str, int] | None:
        """QSA's counters since the previous read (sparse_attention.STAT_KEYS); None when off."""
        return None if self.pages is None or self.pages.index is None else self.pages.index.read_stats()

    def reset(self, slot: int) -> None:
        """Nothing per slot to drop: a finished sequence's pages go back to the allocator."""

    @property
    def kv_bytes(self) -> int:
        return self.pages.nbytes if self.pages is not None else 0

    # -- run -------------------------------------------------------------------------------
    def launch(self, forward: Sequence[Segment], max_context: dict[int, int],
               argmax: frozenset[int] = frozenset()) -> Launched:
        """`run` as a launch (the runners' common form; TritonRunner.launch leaves a forward
        running): on the CPU the forward runs here and its answer is held."""
        return Launched(self.run(forward, max_context, argmax))

    def run(self, forward: Sequence[Segment], max_context: dict[int, int],
            argmax: frozenset[int] = frozenset(), ahead: bool = False) -> dict[int, torch.Tensor | int]:
        """One forward call; returns slot id -> float32 logits of its last row (where sampled),
        or [scored, vocab] for a segment of more than one scored row (a speculative verify).
        ``argmax``: slots for which the runner MAY return the greedy token (an int) instead;
        on the CPU the logits are already where the engine samples, so this runner never does.
        ``ahead``: a hint that the next call will be these rows one position on (runners with
        an asynchronous device may start it early; this one runs synchronously and ignores it)."""
        check_paged_forward(forward, self.pages is not None)
        segs = []
        for s in forward:
            self.pages.copy(s.copies)
            tables = {g: torch.tensor(ids, dtype=torch.int64) for g, ids in s.block_tables.items()}
            n = s.num_scored
            segs.append(ModelSegment(KVState(self.pages, tables, s.start_pos), s.token_ids,
                                     "none" if n == 0 else "last" if n == 1 else "all"))
        logits = self.model.forward(segs)
        return {s.slot_id: lg[0] if s.num_scored == 1 else lg[-s.num_scored :]
                for s, lg in zip(forward, logits) if lg is not None}
