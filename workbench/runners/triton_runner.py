"""TritonRunner: the whole forward on the device, with the Triton kernels of `workbench.kernels`.

Same interface as `runner.TorchRunner` (the engine picks it with EngineConfig(backend="triton"),
passing `EngineConfig.triton`, a `TritonOptions`). This file ties the parts together:

* construction: the options resolved against the model (the head's form, the products'
  precision), the weights on the device (`device_weights.py`: packed planes, one product kernel
  per weight for its lifetime, chosen by format and role, never by the row count);
* the `RunnerInfo` answers the scheduler asks (bytes per prefill row, cache bytes, batch verdict,
  the state layout its pages follow);
* the KV pages (`triton_kv.DevicePages`: one pool per KV group, allocated once by
  `init_kv_pool`; every segment names its pages by block table, the kernels read through them,
  kernels/kv_pages.py), so the runner keeps no per-slot state;
* `run`: a graphed decode step (`triton_graphs.StepGraphs`: CUDA graphs per row bucket,
  device-fed greedy tokens, run-ahead), a graphed short prefill chunk or mixed step, or an
  eager forward (any rows), all through the layer loop (`triton_layers.LayerLoop`: every launch of a forward).

Every kernel computes a row from that row alone, with shapes, tiles and split-K fixed by the
weight shapes, never by the number of rows: a slot's logits are bitwise the same whatever else
shares the step. Llama's adjacent-pair rope becomes the kernels' NEOX rope by a row permutation
of W_q and W_k (device_weights). `TritonOptions(products="cublas_bf16")` swaps the quantized
products for cuBLAS bf16 products: the fastest NON-batch-invariant variant, for measuring what
invariance costs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton

from .. import device_weights as _dw
from ..errors import WorkbenchError
from ..model import Model
from ..planner import SlotView
from ..runner import Launched
from ..scheduler import Segment, check_paged_forward
from ..state import StateLayout, cache_key
from .triton_kv import DevicePages, HostPages, forward_tables
from .triton_options import TritonOptions

MAX_EMBD = 8192  # the fused norms hold a whole row in one tile


class TritonRunner:
    supports_fused_step = True
    paged = True
    asynchronous = True  # `launch` leaves its forward running on the device (the engine's pipeline)

    def __init__(self, model: Model, slot_capacity: int, options: TritonOptions = TritonOptions(), *,
                 device: str | torch.device | None = None, weights: "_dw.DeviceWeights | None" = None,
                 qsa=None):
        """`weights`: device weights already loaded for `model` in this runner's layout (a
        self-draft's: the target runner's first layers, `DeviceWeights.first_layers`), instead
        of loading them again. `qsa`: a QSAConfig (workbench/qsa.py): the pages carry its
        indexer's summaries and rows past its boundary attend sparsely (kernels/qsa.py)."""
        if not isinstance(options, TritonOptions):
            raise WorkbenchError(f"options={options!r} is not allowed: allowed a TritonOptions")
        self.options = options
        self.model = model
        c = self.cfg = model.config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise WorkbenchError("backend='triton' without a CUDA device needs TRITON_INTERPRET=1 "
                                 "set before triton is first imported")
        if c.head_dim % 2 or c.n_embd > MAX_EMBD:
            raise WorkbenchError(f"backend='triton' needs an even head_dim and n_embd <= {MAX_EMBD}")
        # (the kernels are imported once TRITON_INTERPRET is known to be right: triton.jit reads it)
        from ..kernels import pdl
        from .triton_graphs import StepGraphs
        from .triton_layers import LayerLoop

        self._pdl = pdl

        self.slot_capacity = slot_capacity
        self.products = options.products
        self.head_matmul = _head_form(model, options)
        self.layer_forms = options.forms
        bf16 = model.dtype == torch.bfloat16
        self.use_dot = self.device.type == "cuda"  # tl.dot on a GPU; the interpreter's tl.sum form
        # the tensor-core products' operand precision follows the engine's dtype; so do the
        # attention products' (single bf16 MMAs for a bfloat16 engine, session 5 run 23: 0.769 /
        # 0.868 -> 0.693 / 0.791 ms at 1 / 16 slots; None: the kernels' tf32x3)
        self.mma_prec = "bf16" if bf16 else "tf32x3"
        self.attn_prec = "bf16" if bf16 else None
        # the output norm writes the dense head's input at its operand precision (bf16, on a GPU,
        # where the store rounds to nearest as the products do): the same logits, half the bytes
        # of x read by every head program (session 9, run 45: the head alone 87.6 -> 85.1 us)
        self.head_x_dtype = torch.bfloat16 if self.head_matmul == "dense" and bf16 and self.use_dot else None
        if weights is None:
            weights = _dw.load_device_weights(model, self.device, layer_forms=self.layer_forms,
                                              head_form=self.head_matmul, dense=self.products)
        elif len(weights.layers) != c.n_layers:
            raise WorkbenchError(f"weights has {len(weights.layers)} layers: allowed the model's {c.n_layers}")
        self.weights = weights
        self.layers, self.embed, self.head = weights.layers, weights.embed, weights.head
        self.fixed_bytes = weights.nbytes
        self.step_weight_bytes = weights.step_bytes  # read by every decode step (the floor's bytes)
        self.vocab = self.head.N
        self.attn_segment = options.attn_segment
        kv_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(options.kv_dtype, model.dtype)
        self.kv_dtype = kv_dtype
        elem = torch.empty(0, dtype=kv_dtype).element_size()
        self._kv_per_token = c.kv_bytes_per_token(elem)
        # pages of TritonOptions.page_size positions (it says why 256 by default)
        self.state_layout = StateLayout.from_model_config(c, kv_bytes_per_elem=elem, page_size=options.page_size,
                                                          key_blocks=(self.attn_segment,))
        self.qsa, self.qsa_layers = qsa, ()
        if qsa is not None:  # the indexer's summaries: a payload of every page of their group
            from dataclasses import replace

            from ..sparse_attention import STAT_KEYS, payload_specs

            self.qsa_layers = qsa.resolve_layers(c)
            self.state_layout = replace(self.state_layout, page_payloads=payload_specs(
                qsa, self.qsa_layers, self.state_layout, c))
            self._qsa_stats = dict.fromkeys(STAT_KEYS, 0)
        self.page_size = self.state_layout.page_size
        self.table_width = -(-slot_capacity // self.page_size)  # block-table entries of a full slot
        # the prefix cache's hashes start from the weights' identity and the KV dtype (this runner's
        # kernels fix every bit of a page's KV given the tokens: batch-invariant products)
        self.kv_cache_key = cache_key(model.source.index.sha256, f"triton-{options.products}-{kv_dtype}")
        self.kv: DevicePages | None = None
        self.host: HostPages | None = None  # host backing's store (init_host_store)
        self.bytes_per_prefill_row = self._bytes_per_prefill_row()
        self.loop = LayerLoop(weights, c, self.device, mma_prec=self.mma_prec, attn_prec=self.attn_prec,
                              use_dot=self.use_dot, head_x_dtype=self.head_x_dtype, segment=self.attn_segment,
                              products=self.products, fuse_combine=options.fuse_combine, fuse_glu=options.fuse_glu,
                              pair_launch=options.pair_launch, rope_in_attention=options.rope_in_attention,
                              argmax_in_head=options.argmax_in_head, qsa=qsa, qsa_layers=self.qsa_layers,
                              attention_runs=options.attention_runs)
        emulate = options.graphs == "emulate"
        use_graphs = emulate or (options.graphs is True and self.device.type == "cuda")
        self._use_graphs, self._emulate = use_graphs, emulate
        self.graphs: StepGraphs | None = None  # (made with the pages: they are captured on them)
        self.launches = 0  # kernel launches of the last forward

    @property
    def rope_in_attention(self) -> bool:
        return self.loop.rope_in_attention

    def _bytes_per_prefill_row(self) -> int:
        """Activation bytes of one row at the widest point (float32 residual, normed input, qkv
        partials, q, attention output, gate|up partials, GLU output, down partials) plus the
        attention workspace of a row at full slot capacity."""
        c = self.cfg
        group = c.n_heads // c.n_kv_heads
        qrows = max(16, triton.next_power_of_2(group)) if self.use_dot else triton.next_power_of_2(group)
        nseg_cap = -(-self.slot_capacity // self.attn_segment)
        ws = c.n_kv_heads * nseg_cap * qrows * (max(16, triton.next_power_of_2(c.head_dim)) + 2)
        sp = self.layers[0]
        per_row = (2 * c.n_embd + sp.qkv.splits * sp.qkv.N + 2 * c.q_dim + sp.gate_up.splits * sp.gate_up.N
                   + c.n_ff + max(sp.down.splits, sp.wo.splits) * c.n_embd + ws)
        return int(4 * per_row)

    # -- RunnerInfo ----------------------------------------------------------------------------
    def cache_bytes(self, num_tokens: int) -> int:
        return self._kv_per_token * (-(-num_tokens // self.page_size) * self.page_size)

    def memory_available(self) -> int | None:
        """Free device memory (CUDA), where the engine's budget comes from; None on the CPU."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        if self.products != "quant":
            return False, "dense products are not batch-invariant"
        return True, None

    # -- state -------------------------------------------------------------------------------
    def init_kv_pool(self, num_pages: dict[str, int]) -> None:
        """Allocate the pages: `num_pages` per KV group (the scheduler's `kv_pool_pages`), plus
        each group's scratch page."""
        from .triton_graphs import StepGraphs

        c = self.cfg
        self.kv = None  # (the old pool's memory first)
        self.kv = DevicePages(self.state_layout, num_pages, c.n_kv_heads, c.head_dim, self.kv_dtype, self.device,
                              qsa=self.qsa, qsa_layers=self.qsa_layers)
        self.graphs = StepGraphs(self.loop, self.kv, self.device, emulate=self._emulate,
                                 share_pool=self.products == "quant", segment=self.attn_segment,
                                 history=self.options.graph_history, width=self.table_width,
                                 chunk_rows=self.options.chunk_graph_rows,
                                 verify_family=self.options.verify_graph_family) if self._use_graphs else None

    def track_page_mass(self) -> None:
        """eviction="scored": measure the attention mass each KV page receives (in the graphs
        too: the pool's graphs are captured after this)."""
        if self.graphs is not None and (self.graphs.keys or self.graphs.chunk_keys):
            raise RuntimeError("track_page_mass after graphs were captured: call it right after init_kv_pool")
        self.kv.track_mass()

    def take_page_mass(self, group: str, pages) -> list[float]:
        """The attention mass `pages` of `group` received since their last read (zeroed by it):
        the allocator's `mass_reader` (state/pages.py). A host copy, so it waits for the device."""
        return self.kv.take_mass(group, pages)

    def init_host_store(self, num_pages: dict[str, int]) -> None:
        """Allocate the host store (`kv_host_pages`): pinned host memory on CUDA (triton_kv.HostPages)."""
        self.host = HostPages(self.kv, num_pages)

    def move_pages(self, moves) -> None:
        """A step's page-outs and page-ins, before its forwards (HostPages.move says how they
        are ordered against the steps on the device: a forward waits for them only when it
        touches a page they move). A step launched ahead is finished first: it was launched
        with block tables that these moves change."""
        self.drain()
        self.host.move(moves)

    def read_transfer_s(self) -> float:
        return self.host.read_transfer_s() if self.host is not None else 0.0

    def read_qsa_stats(self) -> dict[str, int] | None:
        """QSA's counters since the previous read (sparse_attention.STAT_KEYS), None when off.
        Counted on the host from the rows' positions, which are what decides a row's path in
        the kernels (a row at p >= the boundary is sparse in every QSA layer), so no device
        counter has to be read back."""
        if self.qsa is None:
            return None
        from ..sparse_attention import STAT_KEYS

        out, self._qsa_stats = self._qsa_stats, dict.fromkeys(STAT_KEYS, 0)
        return out

    def _count_qsa(self, forward) -> None:
        cfg, n = self.qsa, len(self.qsa_layers)
        hkv = self.cfg.n_kv_heads
        st = self._qsa_stats
        for s in forward:
            for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
                if p < cfg.dense_positions:
                    st["dense_rows"] += n
                else:
                    st["sparse_rows"] += n
                    st["blocks_kept"] += n * hkv * cfg.kept_blocks
                    st["blocks_scored"] += n * hkv * (p // cfg.block + 1 - cfg.sink_blocks - cfg.local_blocks)

    def reset(self, slot: int) -> None:
        """Nothing per slot to drop (a finished sequence's pages go back to the allocator); a
        step launched ahead for this slot will not be used."""
        if self.graphs is not None:
            self.graphs.ahead = None

    @property
    def graphed_verify_rows(self) -> int | None:
        """The most rows a decode-and-verify step may have and still run as a chunk graph
        (its rows are all scored: SCORED_ROWS, and the chunk graphs' width); None without
        chunk graphs. The speculator keeps a step's drafts within it: past it the verify runs
        eagerly, several times slower (H200 run 80: C16 x 9 rows, 0.79x of plain decoding)."""
        from .triton_graphs import SCORED_ROWS

        if self.graphs is None or not self.graphs.chunk_rows:
            return None
        return min(SCORED_ROWS, self.graphs.chunk_rows)

    def expect_steps(self, max_rows: int, verify: bool) -> None:
        """The engine's steps (decode rows up to `max_rows`, speculative verifies when `verify`):
        with graphs on, each segment bucket's graphs for them are captured together
        (StepGraphs.expect)."""
        if self.graphs is not None:
            self.graphs.expect(max_rows, verify)

    @property
    def num_ahead_used(self) -> int:
        """Steps so far that found their graph already launched (run-ahead)."""
        return 0 if self.graphs is None else self.graphs.ahead_used

    @property
    def num_captures(self) -> int:
        """CUDA graphs captured so far (the engine leaves a step that captured one out of the
        speculation guard's cost model: its time is the capture's, not the rows')."""
        return 0 if self.graphs is None else self.graphs.captured

    @property
    def ahead_in_flight(self) -> bool:
        """Whether a step launched ahead may still be running (it may write pages that were
        released after it was launched: the engine keeps their fence until the next step)."""
        return self.graphs is not None and self.graphs.ahead is not None

    def drain(self) -> None:
        """Wait for a step launched ahead (and drop it): afterwards nothing is in flight."""
        if self.ahead_in_flight:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.graphs.ahead = None

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0

    # -- run ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, forward: Sequence[Segment], max_context: dict[int, int],
            argmax: frozenset[int] = frozenset(), ahead: bool = False) -> dict[int, torch.Tensor | int]:
        """One forward; slot id -> float32 logits [vocab] of its last row (where sampled), or,
        for slots in ``argmax``, the greedy token (an int: argmax on the device, the same
        tie/NaN rule as torch.argmax, and only the tokens cross to the host).

        ``ahead`` (a hint: the next call will be these rows one position on): when every row is
        a graphed greedy decode row, the next step's graph is launched before this call waits
        for its tokens (the graph already feeds its argmax back as the next inputs), so the
        host's bookkeeping overlaps the device's next step. The next call uses that launch only
        if its segments are exactly the ones launched (slot, position, input token); otherwise
        it runs as usual, and the stream order makes it overwrite whatever the early launch
        wrote (a finished slot's extra KV row is beyond anything its next owner reads before
        writing). Either way each row's result is the same function of the same inputs, so
        the outputs are bitwise those of running without the hint."""
        if not forward:
            return {}
        check_paged_forward(forward, self.kv is not None)
        with self._pdl.enabled(self.options.pdl):
            launched = self._prologue(forward)
            if self.graphs is not None and self.graphs.takes(forward):
                return self._run_graphed(forward, max_context, argmax, ahead, launched)
            if self.graphs is not None and self.graphs.takes_chunk(forward):
                return self._run_chunk_graph(forward, argmax)
            return self._run_eager(forward, argmax)

    @torch.inference_mode()
    def launch(self, forward: Sequence[Segment], max_context: dict[int, int],
               argmax: frozenset[int] = frozenset()) -> Launched:
        """`run`'s first half: the forward enqueued and its sampled rows copied to pinned host
        memory behind it in the stream (so a later launch may replay the same graph over its
        buffers), the host not waiting; `result()` waits for that copy alone and is `run`'s
        answer. A forward that replays a chunk graph (a verify, a prefill chunk or mixed step)
        is left running; any other form (a graphed decode step, an eager forward, or while a
        step launched ahead is pending) runs to its end here as `run` does, its answer held. Launches complete in their order (one stream), so the host may
        launch the next before asking for this one's result: while the device runs one, the
        host prepares the next (a step of another cohort of slots)."""
        g = self.graphs
        if (not forward or g is None or g.ahead is not None or g.takes(forward)
                or not g.takes_chunk(forward)):
            return Launched(self.run(forward, max_context, argmax))
        check_paged_forward(forward, self.kv is not None)
        with self._pdl.enabled(self.options.pdl):
            self._prologue(forward)
            n = self._launch_chunk_graph(forward)
            if not n:
                return Launched({})
            # its answer copied to the host behind it in the stream, so asking for it waits for
            # this forward alone, not for a launch enqueued after it (greedy rows need only
            # their tokens: no copy of [rows, vocab] logits for them)
            cuda = self.device.type == "cuda"
            rows = any(s.num_scored and s.slot_id not in argmax for s in forward)
            logits = _host_copy(g.logits[:n], cuda) if rows else None
            tokens = _host_copy(g.tokens[:n], cuda)
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record()

        def answer():
            if done is not None:
                done.synchronize()
            return self._rows_out(forward, logits, tokens, argmax)
        return Launched(answer)

    def _prologue(self, forward: Sequence[Segment]):
        """Before any forward: a step launched ahead taken off the graphs (returned), the host
        store's moves ordered first, copy-on-write copies run, QSA's rows counted."""
        launched = None
        if self.graphs is not None:
            launched, self.graphs.ahead = self.graphs.ahead, None
        if self.host is not None:
            self.host.order_before(forward)
        copies = [c for s in forward for c in s.copies]
        if copies:
            self.kv.copy(copies)
        if self.qsa is not None:
            self._count_qsa(forward)
        return launched

    def _run_graphed(self, forward, max_context, argmax, ahead, launched) -> dict[int, torch.Tensor | int]:
        n = len(forward)
        toks = self.graphs.step(forward, max_context, argmax, ahead, launched)
        self.launches = self.graphs.launches
        if toks is not None:
            return {s.slot_id: t for s, t in zip(forward, toks)}
        # the graph computed every row's argmax into its tokens already
        return self._rows_out(forward, self.graphs.logits[:n], self.graphs.tokens[:n], argmax)

    def _run_chunk_graph(self, forward, argmax) -> dict[int, torch.Tensor | int]:
        n = self._launch_chunk_graph(forward)
        if not n:
            return {}
        return self._rows_out(forward, self.graphs.logits[:n], self.graphs.tokens[:n], argmax)

    def _launch_chunk_graph(self, forward) -> int:
        n = self.graphs.chunk(forward)
        self.launches = self.graphs.launches
        return n

    def _run_eager(self, forward: Sequence[Segment], argmax: frozenset[int] = frozenset()) -> dict[int, torch.Tensor | int]:
        groups = self.kv.groups
        host, sel, R, W = forward_tables(forward, groups)
        max_pos = max(s.start_pos + len(s.token_ids) - 1 for s in forward)
        dev = host.to(self.device)  # (one copy: the row tables, then each group's block tables)
        rows = dev[: 3 * R].view(3, R)
        tables = list(dev[3 * R :].view(len(groups), len(forward), W))
        self.loop.launches = 0
        if not sel:  # no row is sampled: run the layers (the KV writes); the head on one row is
            # cheap next to a prefill chunk, and its result is dropped
            self.loop.forward(rows[0], rows[1], rows[2], R, max_pos, self.kv, tables,
                              sel=torch.zeros(1, dtype=torch.int64, device=self.device))
            self.launches = self.loop.launches
            return {}
        sel_t = None if len(sel) == R else torch.tensor(sel, dtype=torch.int64).to(self.device)
        logits = self.loop.forward(rows[0], rows[1], rows[2], R, max_pos, self.kv, tables, sel=sel_t)
        self.launches = self.loop.launches
        return self._rows_out(forward, logits, None, argmax)

    def _rows_out(self, forward: Sequence[Segment], logits: torch.Tensor, tokens: torch.Tensor | None,
                  argmax: frozenset[int]) -> dict[int, torch.Tensor | int | tuple[int, ...]]:
        """The answer for the sampled rows of ``forward`` (``logits`` holds them in order, each
        segment's `num_scored`): tokens where allowed, else logits as a host copy (the engine
        samples there, with CPU generators: torch.multinomial cannot take a CPU generator for
        CUDA probabilities). A segment of several scored rows gets a tuple of tokens or logits
        [rows, vocab]."""
        spans, r = [], 0
        for s in forward:
            if s.num_scored:
                spans.append((s.slot_id, r, s.num_scored))
                r += s.num_scored
        want_tok = [sp for sp in spans if sp[0] in argmax]
        want_row = [sp for sp in spans if sp[0] not in argmax]
        out: dict[int, torch.Tensor | int | tuple[int, ...]] = {}
        if want_tok:
            if tokens is None:
                from ..kernels.sampling import argmax as argmax_rows

                tokens = argmax_rows(logits)
            toks = tokens.tolist()  # the one sync of the step when nothing else is copied
            out.update((sl, int(toks[i]) if n == 1 else tuple(toks[i : i + n])) for sl, i, n in want_tok)
        if want_row:
            idx = [i for _, r0, n in want_row for i in range(r0, r0 + n)]
            sub = logits if len(idx) == r else logits[torch.tensor(idx, device=logits.device)]
            rows = _to_host(sub)
            j = 0
            for sl, _, n in want_row:
                out[sl] = rows[j] if n == 1 else rows[j : j + n]
                j += n
        return out

    # -- benchmark fast path ----------------------------------------------------------------------
    @torch.inference_mode()
    def decode_loop(self, forward: Sequence[Segment], steps: int) -> torch.Tensor:
        """Greedy decode `steps` tokens for the decode rows `forward` (each slot already
        prefilled: a segment of its next input token at its next position, whose block tables
        already cover `steps` positions from there, e.g. from `runners.direct_pages.DirectPages`) by
        chained graph replays, the tokens fed back on the device. Returns int64 [steps,
        len(forward)] on the device. CUDA graphs only."""
        if self.graphs is None:
            raise WorkbenchError("decode_loop needs CUDA graphs")
        P = self.page_size
        for s in forward:
            if any(len(t) * P < s.start_pos + steps for t in s.block_tables.values()):
                raise WorkbenchError(f"slot {s.slot_id}: its block tables do not cover {steps} steps from "
                                     f"position {s.start_pos}")
        if any(s.copies for s in forward):
            self.kv.copy([c for s in forward for c in s.copies])
        self.graphs.ahead = None
        with self._pdl.enabled(self.options.pdl):
            out = self.graphs.decode_loop(forward, steps)
        self.launches = self.graphs.launches
        return out


def _head_form(model: Model, options: TritonOptions) -> str:
    """The head's product form: the option, or by default the int8 form for a bfloat16 engine's
    Q8_0 head with the quantized products (a float32 engine keeps its float32 products; the
    cuBLAS variant reads the dense copy), else the dense copy."""
    qtype = _dw.head_qtype(model)
    form = options.head_matmul
    if form is None:
        q8i8 = qtype == "Q8_0" and model.dtype == torch.bfloat16 and options.products == "quant"
        return "q8i8" if q8i8 else "dense"
    if form == "q8i8" and qtype != "Q8_0":
        raise WorkbenchError(f"head_matmul='q8i8' reads a Q8_0 head; this head is {qtype}: allowed dense")
    return form


def _host_copy(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host copy of `t` enqueued on the stream (pinned memory: the host does not wait), or a
    plain copy of a host tensor."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
    h.copy_(t, non_blocking=pinned)
    return h


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device logits through pinned memory (torch's caching host allocator): a
    fresh pageable tensor page-faults during the copy (measured on an H200 VM: 10 ms for 16 rows
    of 262144 floats, 1.6 GB/s)."""
    if t.device.type != "cuda":
        return t
    h = _host_copy(t, pinned=True)
    torch.cuda.current_stream().synchronize()
    return h
