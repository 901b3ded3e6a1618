"""TritonRunner: the whole forward on the device, with the Triton kernels of `workbench.kernels`.

Same interface as `runner.TorchRunner` (the engine picks it with EngineConfig(backend="triton"),
passing `EngineConfig.triton`, a `TritonOptions`). This file ties the parts together:

* construction: the options resolved against the model (the head's form, the products'
  precision), the weights on the device (`device_weights.py`: packed planes, one product kernel
  per weight for its lifetime, chosen by format and role, never by the row count);
* the `RunnerInfo` answers the scheduler asks (bytes per prefill row, cache bytes, batch verdict);
* `KVPool`: the KV cache and the per-row (token, position, slot) tables of a forward;
* `run`: a graphed decode step (`triton_graphs.DecodeGraphs`: CUDA graphs per row bucket,
  device-fed greedy tokens, run-ahead) or an eager forward (any rows: prefill chunks, mixed
  steps), both through the layer loop (`triton_layers.LayerLoop`: every launch of a forward).

Every kernel computes a row from that row alone, with shapes, tiles and split-K fixed by the
weight shapes, never by the number of rows: a slot's logits are bitwise the same whatever else
shares the step. Llama's adjacent-pair rope becomes the kernels' NEOX rope by a row permutation
of W_q and W_k (device_weights). `TritonOptions(products="cublas_bf16")` swaps the quantized
products for cuBLAS bf16 products: the fastest NON-batch-invariant variant, for measuring what
invariance costs.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import torch
import triton

from .. import device_weights as _dw
from ..errors import WorkbenchError
from ..model import Model
from ..planner import SlotView
from ..scheduler import Segment
from .triton_options import TritonOptions

POOL_BLOCK = 256  # KV pool lengths are powers of two >= this (the attention segment)
MAX_EMBD = 8192  # the fused norms hold a whole row in one tile


class KVPool:
    """The KV cache: one pool per layer [n_layers, S + 1, L, Hkv, D] (slot id = pool row, the last
    row a scratch slot that padded graph rows write into), grown by powers of two (copying), and
    per slot the request that owns it and how many tokens it holds.

    The seam for paging: the pools and the per-row (token, position, slot) tables a forward's
    kernels read are made here and nowhere else (``row_tables``, ``decode_tables``); a page table
    replaces the slot rows, and the kernels' (slot, position) addressing becomes (page, offset)."""

    def __init__(self, cfg, slot_capacity: int, dtype: torch.dtype, device: torch.device):
        self.cfg, self.slot_capacity, self.dtype, self.device = cfg, slot_capacity, dtype, device
        self.slots = 0  # real slots in the pool (the scratch slot is index `slots`)
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.owner: dict[int, Hashable] = {}
        self.tokens: dict[int, int] = {}  # tokens each slot holds

    @property
    def scratch_slot(self) -> int:
        return self.slots

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def ensure(self, slots: int, length: int) -> bool:
        """Room for ``slots`` slots of ``length`` tokens; True where the pool grew (graphs that
        point at the old one must go)."""
        cap = -(-self.slot_capacity // POOL_BLOCK) * POOL_BLOCK
        if length > cap:
            raise WorkbenchError(f"a slot needs {length} tokens but the slot capacity is {self.slot_capacity}")
        if slots <= self.slots and length <= self.length:
            return False
        new_s = max(self.slots, triton.next_power_of_2(max(1, slots)))
        new_l = min(cap, max(self.length, POOL_BLOCK, triton.next_power_of_2(max(1, length))))
        c = self.cfg
        shape = (c.n_layers, new_s + 1, new_l, c.n_kv_heads, c.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None:
            s0, l0 = self.slots, self.length
            k[:, :s0, :l0] = self.k[:, :s0]
            v[:, :s0, :l0] = self.v[:, :s0]
        self.k, self.v = k, v
        self.slots, self.length = new_s, new_l
        return True

    def begin(self, forward: Sequence[Segment], max_context: dict[int, int]) -> bool:
        """Check that each segment continues its slot's KV (a new request starts it empty) and
        size the pool for every admitted slot (``max_context`` has them all); True where it grew."""
        for s in forward:
            if self.owner.get(s.slot_id) != s.request_id:
                self.owner[s.slot_id] = s.request_id
                self.tokens[s.slot_id] = 0
            if self.tokens[s.slot_id] != s.start_pos:
                raise RuntimeError(f"slot {s.slot_id}: KV holds {self.tokens[s.slot_id]} tokens, plan starts at {s.start_pos}")
        need = max(list(max_context.values()) + [s.start_pos + len(s.token_ids) for s in forward])
        return self.ensure(max([s.slot_id for s in forward] + list(max_context)) + 1, need)

    def commit(self, forward: Sequence[Segment]) -> None:
        for s in forward:
            self.tokens[s.slot_id] = s.start_pos + len(s.token_ids)

    def reset(self, slot: int) -> None:
        self.owner.pop(slot, None)
        self.tokens.pop(slot, None)

    @staticmethod
    def row_tables(forward: Sequence[Segment]) -> tuple[torch.Tensor, list[int]]:
        """An eager forward's rows: int32 [3, R] (token, position, slot) on the host, and the
        indices of the rows whose logits are sampled (each sampled segment's last row)."""
        ids, pos, seq, sel = [], [], [], []
        for s in forward:
            n = len(s.token_ids)
            ids += list(s.token_ids)
            pos += range(s.start_pos, s.start_pos + n)
            seq += [s.slot_id] * n
            if s.samples:
                sel.append(len(ids) - 1)
        return torch.tensor([ids, pos, seq], dtype=torch.int32), sel

    def decode_tables(self, forward: Sequence[Segment], bucket: int) -> torch.Tensor:
        """A graphed decode step's rows, int32 [3, bucket] on the host: one row per segment, the
        padding rows reading token 0 at position 0 into the scratch slot."""
        host = torch.zeros((3, bucket), dtype=torch.int32)
        host[2, :] = self.scratch_slot
        for i, s in enumerate(forward):
            host[0, i] = s.token_ids[0]
            host[1, i] = s.start_pos
            host[2, i] = s.slot_id
        return host


class TritonRunner:
    supports_fused_step = True

    def __init__(self, model: Model, slot_capacity: int, options: TritonOptions = TritonOptions(), *,
                 device: str | torch.device | None = None):
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
        from .triton_graphs import DecodeGraphs
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
        weights = _dw.load_device_weights(model, self.device, layer_forms=self.layer_forms,
                                          head_form=self.head_matmul, dense=self.products)
        self.layers, self.embed, self.head = weights.layers, weights.embed, weights.head
        self.fixed_bytes = weights.nbytes
        self.step_weight_bytes = weights.step_bytes  # read by every decode step (the floor's bytes)
        self.vocab = self.head.N
        self.attn_segment = options.attn_segment
        kv_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(options.kv_dtype, model.dtype)
        self.kv = KVPool(c, slot_capacity, kv_dtype, self.device)
        self._kv_per_token = c.kv_bytes_per_token(torch.empty(0, dtype=kv_dtype).element_size())
        self.bytes_per_prefill_row = self._bytes_per_prefill_row()
        self.loop = LayerLoop(weights, c, self.device, mma_prec=self.mma_prec, attn_prec=self.attn_prec,
                              use_dot=self.use_dot, head_x_dtype=self.head_x_dtype, segment=self.attn_segment,
                              products=self.products, fuse_combine=options.fuse_combine, fuse_glu=options.fuse_glu,
                              pair_launch=options.pair_launch, rope_in_attention=options.rope_in_attention,
                              argmax_in_head=options.argmax_in_head)
        emulate = options.graphs == "emulate"
        use_graphs = emulate or (options.graphs is True and self.device.type == "cuda")
        self.graphs = DecodeGraphs(self.loop, self.kv, self.device, emulate=emulate,
                                   share_pool=self.products == "quant", segment=self.attn_segment,
                                   history=options.graph_history) if use_graphs else None
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
        return self._kv_per_token * (-(-num_tokens // POOL_BLOCK) * POOL_BLOCK)

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        if self.products != "quant":
            return False, "dense products are not batch-invariant"
        return True, None

    def reset(self, slot: int) -> None:
        if self.graphs is not None:
            self.graphs.ahead = None
        self.kv.reset(slot)

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes

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
        with self._pdl.enabled(self.options.pdl):
            launched = None
            if self.graphs is not None:
                launched, self.graphs.ahead = self.graphs.ahead, None
            if self.kv.begin(forward, max_context) and self.graphs is not None:
                self.graphs.clear()  # (they point at the old pool)
            if self.graphs is not None and self.graphs.takes(forward):
                out = self._run_graphed(forward, max_context, argmax, ahead, launched)
            else:
                out = self._run_eager(forward, argmax)
        self.kv.commit(forward)
        return out

    def _run_graphed(self, forward, max_context, argmax, ahead, launched) -> dict[int, torch.Tensor | int]:
        n = len(forward)
        toks = self.graphs.step(forward, max_context, argmax, ahead, launched)
        self.launches = self.graphs.launches
        if toks is not None:
            return {s.slot_id: t for s, t in zip(forward, toks)}
        # the graph computed every row's argmax into its tokens already
        return self._rows_out([s.slot_id for s in forward], self.graphs.logits[:n], self.graphs.tokens[:n], argmax)

    def _run_eager(self, forward: Sequence[Segment], argmax: frozenset[int] = frozenset()) -> dict[int, torch.Tensor | int]:
        host, sel = self.kv.row_tables(forward)
        R = host.shape[1]
        max_pos = int(host[1].max())
        dev = host.to(self.device)
        self.loop.launches = 0
        if not sel:  # no row is sampled: run the layers (the KV writes); the head on one row is
            # cheap next to a prefill chunk, and its result is dropped
            self.loop.forward(dev[0], dev[1], dev[2], R, max_pos, self.kv.k, self.kv.v,
                              sel=torch.zeros(1, dtype=torch.int64, device=self.device))
            self.launches = self.loop.launches
            return {}
        sel_t = None if len(sel) == R else torch.tensor(sel, dtype=torch.int64).to(self.device)
        logits = self.loop.forward(dev[0], dev[1], dev[2], R, max_pos, self.kv.k, self.kv.v, sel=sel_t)
        self.launches = self.loop.launches
        return self._rows_out([s.slot_id for s in forward if s.samples], logits, None, argmax)

    def _rows_out(self, slots: list[int], logits: torch.Tensor, tokens: torch.Tensor | None,
                  argmax: frozenset[int]) -> dict[int, torch.Tensor | int]:
        """The answer for sampled rows ``slots`` (in ``logits`` order): tokens where allowed,
        else logits as a host copy (the engine samples there, with CPU generators: torch.
        multinomial cannot take a CPU generator for CUDA probabilities)."""
        want_tok = [i for i, sl in enumerate(slots) if sl in argmax]
        want_row = [i for i, sl in enumerate(slots) if sl not in argmax]
        out: dict[int, torch.Tensor | int] = {}
        if want_tok:
            if tokens is None:
                from ..kernels.sampling import argmax as argmax_rows

                tokens = argmax_rows(logits)
            toks = tokens.tolist()  # the one sync of the step when nothing else is copied
            out.update((slots[i], int(toks[i])) for i in want_tok)
        if want_row:
            sub = logits if len(want_row) == len(slots) else logits[torch.tensor(want_row, device=logits.device)]
            rows = _to_host(sub)
            out.update((slots[i], rows[j]) for j, i in enumerate(want_row))
        return out

    # -- benchmark fast path ----------------------------------------------------------------------
    @torch.inference_mode()
    def decode_loop(self, slots: Sequence[int], tokens: Sequence[int], steps: int,
                    max_context: dict[int, int] | None = None) -> torch.Tensor:
        """Greedy decode `steps` tokens for `slots` (each already prefilled; `tokens` are their
        next input tokens) by chained graph replays, the tokens fed back on the device.
        Returns int64 [steps, len(slots)] on the device. CUDA graphs only."""
        if self.graphs is None:
            raise WorkbenchError("decode_loop needs CUDA graphs")
        segs = [Segment(s, self.kv.owner[s], (int(t),), self.kv.tokens[s], True) for s, t in zip(slots, tokens)]
        last = max(s.start_pos for s in segs) + steps - 1
        if self.kv.ensure(max(slots) + 1, last + 1):
            self.graphs.clear()
        with self._pdl.enabled(self.options.pdl):
            out = self.graphs.decode_loop(segs, steps)
        for s in segs:
            self.kv.tokens[s.slot_id] = s.start_pos + steps
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


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device logits through pinned memory (torch's caching host allocator): a
    fresh pageable tensor page-faults during the copy (measured on an H200 VM: 10 ms for 16 rows
    of 262144 floats, 1.6 GB/s)."""
    if t.device.type != "cuda":
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return h
