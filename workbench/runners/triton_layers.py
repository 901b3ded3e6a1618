"""The layer loop: every kernel launch of one Triton forward, in order.

    embedding + first norm (one launch) -> per layer: q|k|v product -> QK-norm + rope + KV write
    (in a graphed decode step the attention programs' prologue) -> attention (combine folded in)
    -> wo product -> add + norm -> gate|up product (GLU folded in) -> down product -> add + norm
    -> head (the argmax's first stage in its programs in a decode graph)

Each weight takes the product kernel it was given at load (`device_weights.QWeight.form`), so a
row is the same function of its own inputs whatever else is in the batch. Products write fixed
split-K partials that their consumer adds in slice order. `LayerLoop.launches` counts the
launches of the last forward as they are issued (130 per graphed decode step for Gemma 3 270M
with the int8 head, 129 with the dense head).
"""

from __future__ import annotations

import torch

from ..kernels import attention as _attn
from ..kernels import dense_mma as _dense
from ..kernels import embedding as _embedding
from ..kernels import qmatmul as _qm
from ..kernels import qmma as _qmma
from ..kernels import qsa as _qsa
from ..kernels import step_fused as _fused
from ..kernels.norm import rmsnorm
from ..kernels.rope import rope_inv_freq

# Rows of a forward the fused attention combine covers (more: the two-launch form), and column
# groups x row tiles a GLU fold may count (more: the separate GLU kernel).
ATTN_COUNTER_ROWS = 8192
EPILOGUE_COUNTERS = 1 << 16
# Warps of the attention partial kernel, one value per runner (prefill and decode alike; the
# separate QK-norm/rope kernel takes them too where the rope runs in attention's prologue, so
# the two forms agree bitwise). H200: 8 with the rope prologue (session 10, run 56: 0.636 ->
# 0.628 ms at 16 slots, 0.805 -> 0.798 at 32 against 4).
ATTN_WARPS = 8
# The head forms whose streaming programs keep a decode graph's argmax (TritonOptions.
# argmax_in_head), each up to a bucket of this many rows; above, the argmax runs after the head
# (the same tokens). "q8i8" up to 16: its 32-row tiles with the running best are slower than the
# argmax after them (session 12, run 65: 0.802 -> 0.821 ms at 32 slots; 0.606 -> 0.601 at 16).
ARGMAX_IN_HEAD_FORMS = {"dense": 64, "q8i8": 16}
SMALL_ROWS = 64  # forwards of up to this many rows (every graph bucket) take slices of fixed row buffers


class LayerLoop:
    """The forward's launches over the device weights, for one runner's fixed choices."""

    def __init__(self, weights, cfg, device: torch.device, *, mma_prec: str, attn_prec: str | None, use_dot: bool,
                 head_x_dtype: torch.dtype | None, segment: int, products: str, fuse_combine: bool, fuse_glu: bool,
                 pair_launch: bool, rope_in_attention: bool, argmax_in_head: bool, qsa=None,
                 qsa_layers: tuple[int, ...] = (), attention_runs: bool = False):
        self.cfg, self.device = cfg, device
        self.attention_runs = attention_runs  # a slot's consecutive rows a run at a time (TritonOptions)
        self.layers, self.embed, self.head, self.output_norm = weights.layers, weights.embed, weights.head, \
            weights.output_norm
        self.vocab = self.head.N
        self.mma_prec, self.attn_prec, self.use_dot = mma_prec, attn_prec, use_dot
        self.head_x_dtype = head_x_dtype  # (None: the layers' h, float32)
        self.segment = segment
        self.products = products
        quant = products == "quant"
        self.fuse_glu = fuse_glu and quant
        self.pair_launch = pair_launch and quant
        self.rope_in_attention = rope_in_attention and fuse_combine
        self.argmax_in_head = argmax_in_head
        self._inv_freq = {b: rope_inv_freq(cfg.head_dim, b, device)
                          for b in {cfg.layer_rope_base(i) for i in range(cfg.n_layers)}}
        # one buffer per fold for every forward (graphs keep its address); each launch leaves it zero
        self._attn_counters = torch.zeros(ATTN_COUNTER_ROWS * cfg.n_kv_heads, dtype=torch.int32,
                                          device=device) if fuse_combine else None
        self._glu_counters = torch.zeros(EPILOGUE_COUNTERS, dtype=torch.int32, device=device) if self.fuse_glu else None
        self._zeros = torch.zeros(SMALL_ROWS, dtype=torch.int32, device=device)
        self._wins = torch.full((SMALL_ROWS,), max(cfg.sliding_window, 0), dtype=torch.int32, device=device)
        self.launches = 0  # kernel launches of the last forward (counted where they are issued)
        # QSA (workbench/qsa.py, kernels/qsa.py): its config and the layers that go sparse
        self.qsa, self.qsa_layers = qsa, frozenset(qsa_layers)

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, ids, pos, seq, R: int, max_pos: int, kv, tables, sel=None, logits_out=None,
                decode_graph: bool = False, head_best=None) -> torch.Tensor:
        """Logits [len(sel) or R, vocab] of the rows (ids, pos, seq: int32 [R] on the device; seq
        a row's block-table row), their K/V written into the pages of ``kv`` (triton_kv.
        DevicePages) through ``tables`` (per KV group, in the layout's order: int32 [rows, W] on
        the device). ``decode_graph``: a graphed decode step's rows (one per slot), which take the
        rope prologue; ``head_best``: the head's running-argmax buffers (``head_best_partials``)."""
        c = self.cfg
        dev = self.device
        E = c.n_embd
        hdt = torch.bfloat16 if self.products != "quant" else torch.float32
        x = torch.empty((R, E), dtype=torch.float32, device=dev)
        h = torch.empty((R, E), dtype=hdt, device=dev)
        if hdt == torch.float32 and E <= _embedding.EMBEDDING_NORM_MAX:  # (one launch: session 11, run 62, ~1 us)
            _embedding.embedding_rmsnorm(ids, self.embed.raw, E, c.embed_scale, self.embed.fmt.name,
                                         self.layers[0].attn_norm, c.rms_eps, x, h)
            self.launches += 1
        else:
            _embedding.embedding(ids, self.embed.raw, E, c.embed_scale, self.embed.fmt.name, out=x)
            rmsnorm(x, self.layers[0].attn_norm, c.rms_eps, out=h) if hdt == torch.float32 else \
                h.copy_(rmsnorm(x, self.layers[0].attn_norm, c.rms_eps))
            self.launches += 2 + (hdt != torch.float32)
        if R <= SMALL_ROWS:
            zeros, wins = self._zeros[:R], self._wins[:R]
        else:
            zeros = torch.zeros(R, dtype=torch.int32, device=dev)
            wins = torch.full((R,), max(c.sliding_window, 0), dtype=torch.int32, device=dev)
        # the head's input: h, or a buffer at the head's operand precision (the same logits)
        hx = h if self.head_x_dtype is None else torch.empty((R, E), dtype=self.head_x_dtype, device=dev)
        # QSA layers: a row past the boundary reads one key in the dense kernel (a window of 1:
        # its output is then overwritten by the sparse kernel's), a row below it all (window 0:
        # the dense kernel's own bits); a device op on the positions, so graphs replay it
        qsa_wins = (pos >= self.qsa.dense_positions).to(torch.int32) if self.qsa is not None else None
        self._layers(x, h, pos, seq, R, max_pos, zeros, wins, hx, kv, tables, decode_graph, qsa_wins)
        hs = hx if sel is None else hx.index_select(0, sel)
        if logits_out is None:
            logits_out = torch.empty((hs.shape[0], self.vocab), dtype=torch.float32, device=dev)
        self._project(hs, self.head, out=logits_out, best=head_best)
        return logits_out

    def _layers(self, x, h, pos, seq, R: int, max_pos: int, zeros, wins, hx, kv, tables,
                decode_graph: bool, qsa_wins=None) -> None:
        """Every layer: x (float32 [R, E], the residual) and h (the next input, normed) in place."""
        c = self.cfg
        dev = self.device
        Hq, D = c.n_heads, c.head_dim
        act = "gelu_tanh" if c.activation == "gelu_tanh" else "silu"
        for li, L in enumerate(self.layers):
            q = torch.empty((R, Hq, D), dtype=torch.float32, device=dev)
            gi, kp, vp = kv.layer(li)
            bt = tables[gi]
            inv = self._inv_freq[c.layer_rope_base(li)]
            rope = None
            sparse = li in self.qsa_layers  # (its KV is written before the summaries: no rope prologue)
            if self.rope_in_attention and decode_graph and R <= ATTN_COUNTER_ROWS and not sparse:
                rope = _attn.RopePrologue(self._project(h, L.qkv), L.q_norm, L.k_norm, inv, c.rms_eps)
            else:
                part = self._project(h, L.qkv)
                _fused.qk_rope_kv(part, q, kp, vp, seq, pos, L.q_norm, L.k_norm, inv, c.rms_eps,
                                  num_warps=ATTN_WARPS if self.rope_in_attention else None, block_table=bt)
                self.launches += 1
            counters = self._attn_counters if R <= ATTN_COUNTER_ROWS else None
            if sparse:
                summ = kv.summaries(li)
                _qsa.qsa_summaries(kp, bt, seq, pos, self.qsa.block, self.qsa.summary, summ)
                self.launches += 1
            # the most keys a row sees: its window, below QSA's boundary (a sparse row reads one
            # here), or the context (the grid spans only the segments such a range touches)
            span = self.qsa.dense_positions if sparse else c.layer_window(li) or None
            attn = _attn.attention_rows(q, kp, vp, seq, pos, qsa_wins if sparse else wins if c.layer_window(li)
                                        else zeros, c.attn_scale, max_pos=max_pos, use_dot=self.use_dot,
                                        counters=counters, precision=self.attn_prec, num_warps=ATTN_WARPS, rope=rope,
                                        segment=self.segment, block_table=bt, span=span, runs=self.attention_runs,
                                        mass=None if sparse or kv.mass is None else kv.mass[gi])
            self.launches += 1 if counters is not None else 2
            if sparse:
                self._sparse_attention(q, kp, vp, bt, seq, pos, summ, attn, counters)
            self._project_add_norm(attn.view(R, Hq * D), L.wo, x, L.post_attn_norm, L.ffn_norm, h)
            last = li + 1 == len(self.layers)
            nxt = self.output_norm if last else self.layers[li + 1].attn_norm
            g = torch.empty((R, c.n_ff), dtype=h.dtype, device=dev)
            if self._glu_fold(L.gate_up, R):
                self._project(h, L.gate_up, glu=_qm.GluEpilogue(g, self._glu_counters, act))
            else:
                part = self._project(h, L.gate_up)
                _fused.glu_from_parts(part, g, act)
                self.launches += 1
            self._project_add_norm(g, L.down, x, L.post_ffw_norm, nxt, hx if last else h)

    def _sparse_attention(self, q, kp, vp, bt, seq, pos, summ, attn, counters) -> None:
        """QSA past the boundary: each sparse row's kept blocks (scores, then the top_k by exact
        integer selection), then its attention over them into ``attn`` (rows below the boundary
        are left as the dense kernel wrote them)."""
        cfg = self.qsa
        R, Hkv = q.shape[0], kp.shape[2]
        sel = torch.empty((R, Hkv, cfg.kept_blocks), dtype=torch.int32, device=self.device)
        _qsa.qsa_select(q, summ, bt, seq, pos, cfg.block, cfg.top_k, cfg.sink_blocks, cfg.local_blocks, cfg.summary,
                        sel)
        _qsa.qsa_attention(q, kp, vp, bt, seq, pos, sel, cfg.block, self.cfg.attn_scale, attn,
                           use_dot=self.use_dot, precision=self.attn_prec,
                           counters=counters if counters is not None and counters.numel() >= R * Hkv else None)
        self.launches += 2 + (2 if counters is None or counters.numel() < R * Hkv else 1)

    # -- products -------------------------------------------------------------------------------
    def _project(self, x: torch.Tensor, p, out: torch.Tensor | None = None, glu=None, best=None) -> torch.Tensor:
        """Partials [splits, M, N] of x @ W^T (float32; bf16 [1, M, N] for the cuBLAS variant).
        ``out`` (float32 [M, N], an unsplit product: the head): written in place and returned.
        ``glu`` (a kernels GluEpilogue, where ``_glu_fold``): also act(gate) * up into glu.out.
        ``best``: the head's running-argmax buffers (its streaming forms)."""
        M = x.shape[0]
        if p.dense is not None:
            self.launches += 2
            y = x.to(torch.bfloat16) @ p.dense.T
            if out is None:
                return y.unsqueeze(0)
            self.launches += 1
            return out.copy_(y)
        if out is not None and p.splits != 1:
            raise ValueError("out= takes an unsplit product")
        part = torch.empty((p.splits, M, p.N), dtype=torch.float32, device=self.device) if out is None \
            else out.unsqueeze(0)
        if self._pair(p) and glu is None and out is None:
            (oa, wa), (ob, wb) = p.parts
            _qmma.launch_mma_gemv_pair(x, wa.packed, part[:, :, oa:], wb.packed, part[:, :, ob:], p.splits,
                                       part.stride(0), self.mma_prec, use_dot=self.use_dot)
            self.launches += 1
            return part
        for off, w in p.parts:
            if w.form == "dense":  # (the head) the dequantized weight on tensor cores
                _dense.dense_mma(x, w.dense, self.mma_prec, out=part[0, :, off:], use_dot=self.use_dot, best=best)
                self.launches += 1
            elif w.form == "q8i8":  # (a Q8_0 head) x as Q8_0 blocks, one integer MMA per block
                xq, xd = _dense.quantize_rows_q8(x)
                _dense.q8i8_mma(xq, xd, w.packed, out=part[0, :, off:], use_dot=self.use_dot, best=best)
                self.launches += 2
            elif w.form == "mma":
                _qmma.launch_qmma(x, w.packed, part[:, :, off:], w.splits, part.stride(0), self.mma_prec,
                                  use_dot=self.use_dot, glu=glu)
                self.launches += 1
            else:
                _qm.launch_qgemv(x, w.packed, part[:, :, off:], w.splits, part.stride(0), glu=glu)
                self.launches += 1
        return part if out is None else out

    def _project_add_norm(self, a, p, x, w_post, w_next, h) -> None:
        """x += post_norm(a @ W^T); h = rmsnorm(x) * w_next: the product, then ``add_rmsnorm``."""
        part = self._project(a, p)
        _fused.add_rmsnorm(x, part, w_post, w_next, h, self.cfg.rms_eps)
        self.launches += 1

    def _glu_fold(self, p, M: int) -> bool:
        """Whether the GLU can ride on this [gate | up] product's launch (kernels' GluEpilogue)."""
        if not self.fuse_glu or p.dense is not None or len(p.parts) != 1:
            return False
        w = p.parts[0][1]
        if w.form == "mma":
            cfg = _qmma.mma_config(w.fmt.name, w.N, w.K, self.device, w.k_split)
            need = _qm.glu_counters(M, w.N, cfg.block_n, cfg.block_m)
        else:
            cfg = _qm.gemv_config(w.fmt.name, w.N, w.K, self.device, w.k_split)
            need = _qm.glu_counters(M, w.N, cfg.block_n, cfg.m_tile)
        return need is not None and need <= self._glu_counters.numel()

    def _pair(self, p) -> bool:
        """Whether this product's two members (tensor-core, then GEMV) go as one launch."""
        if not self.pair_launch or p.dense is not None or len(p.parts) != 2:
            return False
        (_, a), (_, b) = p.parts  # (one K and one K slice: members of one product, device_weights)
        return a.form == "mma" and b.form == "gemv"

    def head_best_partials(self, rows: int):
        """The head's running-argmax buffers for a decode graph of ``rows`` rows, or None
        (argmax_in_head off, the cuBLAS variant, a head form not in ARGMAX_IN_HEAD_FORMS or a
        bucket above its limit, or two row tiles)."""
        w = self.head.parts[0][1]
        if not self.argmax_in_head or self.products != "quant" or rows > ARGMAX_IN_HEAD_FORMS.get(w.form, 0):
            return None
        return _dense.best_partials(rows, self.vocab, self.device, _dense.head_config(w.form, self.device, rows))
