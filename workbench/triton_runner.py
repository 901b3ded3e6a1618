"""TritonRunner: the whole forward on the device, with the Triton kernels of `workbench.kernels`.

Same interface as `runner.TorchRunner` (the engine picks it with EngineConfig(backend="triton")).

* Weights (`device_weights.py`): the GGUF blocks go to the device ("cuda" if available, else
  "cpu" under TRITON_INTERPRET=1), regrouped once into packed planes (same bits); each weight
  takes one product kernel for its lifetime, chosen by format and role (MATMUL, LAYER_FORMS,
  HEAD_MATMUL: the FMA GEMV, the tensor-core `kernels.qmma`, or for the head `kernels.dense_mma`
  on its dequantized copy or its Q8_0 planes), never by the row count.
  Same-format projections of one input are fused (q|k|v, gate|up). The tied embedding keeps its
  raw bytes for the gather. Llama's adjacent-pair rope becomes the kernels' NEOX rope by a row
  permutation of W_q and W_k.
* KV: one pool per layer [S, L_max, Hkv, D] (slot id = pool index, the last index a scratch
  slot that padded rows write into); it grows (copying) when a slot id or a reservation needs it.
* Each step: embedding + first norm (one launch, EMBED_NORM) -> per layer [qkv product -> fused QK-norm + rope + KV write (in a
  graphed decode step the attention programs' prologue, ROPE_IN_ATTENTION) ->
  attention_rows (combine folded in) -> wo product -> fused (post-norm, residual add, next
  pre-norm) -> gate|up product with the GeGLU/SwiGLU folded in (its last program per column
  pair) -> down product -> fused add+norm] -> head (a bfloat16 engine's Q8_0 head: x quantized
  to Q8_0 blocks, then int8 MMAs, HEAD_MATMUL), whose programs keep each row's running argmax
  (ARGMAX_IN_HEAD) -> one launch finishing the argmax and writing the next step's inputs: 130
  launches per graphed decode step for Gemma 3 270M (the q|k|v of mixed formats as one launch,
  PAIR_LAUNCH; 129 with the dense head, which needs no quantizing launch). The products
  write their fixed split-K partials and the consumer adds them in slice order, so no separate
  sum launch. On sm_90+ every kernel is chained to the previous one by programmatic dependent
  launch (kernels/pdl.py), and a product decodes its first weights before waiting for x. Every kernel computes a row from that row alone, with
  shapes, tiles and split-K fixed by the weight shapes, never by the number of rows: a slot's
  logits are bitwise the same whatever else shares the step.
* Decode-only forwards on CUDA replay a CUDA graph captured per (row bucket, attention segment
  bucket): rows are padded to 1, 2, 4, ..., 64; padded rows read token 0 at position 0 and write
  their KV into the scratch slot. Prefill and mixed forwards run eagerly (any row count).
  The graph also takes each row's argmax and writes it, with position + 1, as the next step's
  inputs: greedy rows are answered with that token (no logits copy), and in a greedy steady
  state the next step is launched before this one's tokens are returned (`run`'s `ahead`).

`dense="cublas_bf16"` swaps the quantized products for cuBLAS bf16 products on dequantized
weights: the fastest NON-batch-invariant variant, for measuring what invariance costs.
`persistent=True` runs a graphed step's layer loop as one persistent launch of the same programs
(kernels/persistent.py): bitwise the chain, slower on an H200, off by default.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch
import triton

from .device_weights import Proj, f16_head_refusal, head_qtype, load_device_weights
from .errors import WorkbenchError
from .model import Model
from .planner import SlotView
from .scheduler import Segment

GRAPHS: bool | str = True  # the default of TritonRunner(graphs=None); tests set "emulate"
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows per captured graph
# run() returns the logits rows on the host: the engine samples there, with CPU generators
# (torch.multinomial cannot take a CPU generator for CUDA probabilities). One copy per forward.
LOGITS_TO_HOST = True
POOL_BLOCK = 256  # KV pool lengths are powers of two >= this (the attention segment)
MAX_EMBD = 8192  # the fused norms hold a whole row in one tile
# The quantized product's form, one per runner (rows stay bitwise invariant because every call
# of a weight takes the same form): "mma" packed planes on tensor cores (kernels/qmma.py; bf16
# operands for a bfloat16 engine, tf32x3 for a float32 one), "gemv" packed planes with float32
# FMAs (kernels/qmatmul.py's decode-shaped kernel), "raw" the GGUF bytes with tf32x3 tl.dot
# (the first version). docs/GPU_NOTES.md compares them. Every layer weight on tensor cores:
# with PDL a product decodes its first K step before waiting for x, which hid most of the
# tensor-core form's costlier Q4_K/Q6_K decode (session 4, H200: 16 slots 1.035 -> 0.987 ms, 1 slot
# 0.816 -> 0.874 against FMA GEMVs for Q4_K/Q6_K/Q8_0).
MATMUL = "mma"
MATMUL_FORMS = ("mma", "gemv", "raw")
# The head's form: None = the layers' form, or "dense": its dequantized copy (bf16(d * q), the
# values the packed decode makes) on tensor cores (kernels/dense_mma.py): the Q8_0 head decoded
# in registers ran at ~1 TB/s, bound by the decode's instructions (docs/GPU_NOTES.md, session 5).
# A per-weight choice (fixed at load, by the weight, never by the row count), so rows stay
# invariant whichever form each weight takes. Since session 12 the default is "q8i8" (below) for a
# bfloat16 engine's Q8_0 head, "dense" for any other head and for a float32 engine (which keeps
# its float32 products) or the cuBLAS variant: on the H200 the int8 head with its argmax in it is
# 66 us at 16 rows against the copy's 86; one lease, run 67: the step 0.569 -> 0.550 ms at one
# slot, 0.620 -> 0.597 at 16, 0.777 -> 0.799 at 32; and 157 MB less device memory. It
# quantizes the head's input per 32 values as llama.cpp does for its quantized products: a
# choice of numerics, stated (greedy tokens follow it; batched == solo either way, checked on
# the H200 at 4 / 16 / 32 slots); EngineConfig(head_matmul=...) / `bench --head-matmul` pick another.
HEAD_MATMUL: str | None = "q8i8"
# The head's forms on tensor cores beside the layers' (kernels/dense_mma.py): "dense" (above),
# "q8dense" (the same products from the Q8_0 planes, d * q formed per K step) and "q8f16": the
# Q8_0 planes with float16 operands (float16(d * q) formed in float16 arithmetic from the bits
# of q, x rounded to float16, exact float32 products and sums): no conversion instruction per
# weight, 178 MB read instead of 335, closer to the exact product than bfloat16 operands, and
# 157 MB less device memory. Neither Q8_0 form is faster than the dense copy on an H200: they
# stay near 2 TB/s, latency-bound (session 9: the head alone 91 us at 16 rows for q8f16, 85 for
# the dense copy at its copy bandwidth). "q8f16" is taken only by a bfloat16 engine whose head
# provably fits float16 (device_weights.f16_head_refusal); asked for explicitly otherwise it is
# refused; were it the default, it would fall back to "dense" there. "q8i8": the Q8_0 planes
# against x quantized per row to Q8_0 blocks (int8 quants, a float32 scale per 32 values, as
# llama.cpp quantizes activations for its quantized products), one exact integer MMA per block
# scaled by d_w * d_x (kernels/dense_mma.q8i8_mma): no decode of W at all, 178 MB read; x's
# int8 steps are its one extra rounding (the weights' products are exact, where the other forms
# round d * q to the operand type). Row by row, so batch-invariant like every form.
HEAD_DENSE_FORMS = ("dense", "q8dense", "q8f16", "q8i8")
# The output norm writes the head's input already rounded to the head's operand precision
# (float16 for "q8f16"; bfloat16 for a bfloat16 "dense"/"q8dense" head, on a GPU only, where the
# store rounds to nearest as the products' own rounding does; the CPU interpreter truncates): the
# same logits, bitwise, and the head's programs read half the bytes of x from L2 (every output
# tile reads all of x: 4,096 tiles x 80 KB at 32 rows in float32, as much as the weights).
HEAD_X_HALF = True
# A decode graph's greedy argmax kept by the head's streaming programs (each its running best per
# row over its tiles, kernels/dense_mma.py best=), finished by one small launch: the argmax's
# first launch (a read of every logit) goes. Bucket rows up to the head's row tile (32); the
# same tokens (the same tie and NaN rules, exact comparisons). H200 (session 10, run 50): 0.668 ->
# 0.659 ms at 16 slots, 0.843 -> 0.829 at 32, 148 launches; the same tokens as the two-launch
# argmax over 16 slots x 32 graphed steps.
ARGMAX_IN_HEAD = True
# The head forms whose programs keep it, each up to a bucket of this many rows (and the form's row
# tile); above, the argmax runs after the head (the same tokens either way). "q8i8" up to 16: with
# its running best born in the tile store's layout (dense_mma.I8_BEST_IN_STORE_LAYOUT) the int8
# head alone keeps its 66 us at 16 rows (H200 session 12, run 65: 0.606 -> 0.601 ms per step at
# 16 slots), but its 32-row tiles with the running best are slower than the argmax after them
# (0.802 -> 0.821 ms at 32 slots).
ARGMAX_IN_HEAD_FORMS = {"dense": 64, "q8dense": 64, "q8f16": 64, "q8i8": 16}
# A step's embedding and the first layer's norm as one launch (kernels/embedding.embedding_rmsnorm)
# for a float32 h, instead of two. H200, session 11 (run 62): ~1 us per step.
EMBED_NORM = True
# A run-ahead greedy step's tokens written by its graph's argmax into pinned host memory (by
# position parity) instead of a device-to-host copy between that graph and the next: on the
# H200 the Engine ran ~30 us per step behind the runner loop at 16 slots (session 11, run 63),
# the stream's copy between graphs the suspect. Written after session 11's last device call,
# tested under the interpreter, not measured: off.
TOKENS_IN_GRAPH = False
# decode_loop's in-graph token record per row (positions modulo this), kept by the graph's argmax,
# so replays run back to back without a copy between them (0: a copy after each replay). H200,
# session 11 (run 61): -1 to -6 us per step in the loop.
GRAPH_HISTORY = 1024
# Per-format overrides of the layers' form: again fixed per weight. Q8_0 layer weights (Gemma 3
# 270M's V projections and some others) on the FMA GEMV: faster at every slot count in three
# leases (session 5, H200: 0.794 -> 0.767 ms at 1 slot, 1.221 -> 1.186 at 32).
LAYER_FORMS: dict[str, str] = {"Q8_0": "gemv"}
# Keys per attention partial program, one value per runner (prefill and decode alike). Small
# segments give a decode row at a short context several programs instead of one: on an H200
# 32 vs 256 took the 1-slot step from 1.74 to 1.18 ms (docs/GPU_NOTES.md). 64 since session 9,
# with 64-key blocks at D = 256 for bf16 K/V (kernels/attention.ATTENTION_BLOCK_N_16BIT): one block per segment.
ATTN_SEGMENT = 64
# The attention combine folded into the partial kernel (the last program of a row merges it):
# one launch per layer instead of two, bitwise the same result.
FUSE_ATTENTION_COMBINE = True
ATTN_COUNTER_ROWS = 8192  # rows of a forward the fused form covers (more: the two-launch form)
# The GLU folded into the [gate | up] product (the last program of each gate/up column pair
# writes act(gate) * up: kernels/step_fused.glu_pair_epilogue): one launch less per layer,
# bitwise the same result as the separate kernel.
FUSE_GLU = True
# The GLU formed by the FFN down product itself (kernels/qmma.launch_qmma(glu_x=...)): each down
# program forms act(gate) * up for its own K slice from gate|up's split-K partials as it gathers
# its x, so neither a GLU launch nor the fold's serial last-program tail remains (the fold costs
# what a launch costs: session 9, run 46). The same sums in slice order and the same arithmetic as
# the fold, but one form per runner all the same: on a GPU the compiler may contract the two
# kernels' GLU into FMAs differently (a float32 engine's logits differed in the last bits, run 53;
# a bfloat16 engine's 16 slots x 8 graphed steps were bitwise the fold's). Tensor-core down
# products only (the others keep the fold). Off: H200 (session 10, run 53) 0.641 -> 0.652 ms at 16
# slots, 0.818 -> 0.800 at 32, 1 and 4 slots unchanged; exact vs solo (prompts 3..700).
GLU_IN_DOWN = False
# column groups x row tiles a folded launch may count (GLU pairs, q|k|v heads, add+norm tiles; more:
# the separate kernel)
EPILOGUE_COUNTERS = 1 << 16
# QK-norm + rope + the KV write folded into the q|k|v product (its last program per head:
# kernels/step_fused.heads_epilogue), tensor-core form only: one launch less per layer. Off:
# slower on an H200 (session 5: 0.984 -> 1.071 ms at 16 slots, docs/GPU_NOTES.md). Unlike
# the folds above its results are not bitwise the separate kernel's (same expressions, another
# layout for the norm's sum), so it is one choice per runner, like a product's form.
FUSE_QK_ROPE = False
# The residual add + next norm (add_rmsnorm) folded into the attention-output and FFN-down
# products (kernels/step_fused.add_norm_epilogue: the last program per column tile sums its
# partials, the last of those per row tile does the rows' add + norms), tensor-core form only:
# two launches less per layer. Off: slower on an H200 (session 5: 0.984 -> 1.302 ms at 16 slots;
# a serial tail in one program costs more than a separate kernel). Like FUSE_QK_ROPE not bitwise the
# separate kernel (the norms' sums run over [4, E] tiles), so one choice per runner.
FUSE_ADD_NORM = False
# A bfloat16 engine's attention products as single bf16 MMAs (q and the softmax weights rounded
# to bfloat16, float32 accumulation) instead of tf32x3 (three MMAs per product): the precision
# the engine's dtype already implies for K and V. One choice per runner; float32 engines keep
# tf32x3.
ATTN_BF16 = True
# Programmatic dependent launch (kernels/pdl.py) where the GPU has it (sm_90+): each kernel's
# launch and ramp-up overlap its predecessor's work. Ordering, hence every bit, is unchanged.
PDL = True
# A fused q|k|v whose members take two forms (Gemma 3 270M: Q5_0 q|k on tensor cores, its Q8_0 V
# on the FMA GEMV, 9 of 18 layers) as ONE launch (kernels/qmma.launch_mma_gemv_pair: each
# program runs its own kernel's body; the GEMV at the tensor-core config's warps): one kernel
# boundary fewer per such layer. One choice per runner (every path takes it), so rows stay
# invariant; the GEMV's bits are those of its 4-warp form. H200 (session 7, run 36): 0.693 /
# 0.791 ms -> 0.675 / 0.772 at 1 / 16 slots, exact.
PAIR_LAUNCH = True
# QK-norm + rope + the KV write inside the attention launch (every program's prologue runs the
# separate kernel's body, kernels/attention._attention_rope_kernel) in graphed decode steps, where
# each row's slot has one row: one launch fewer per layer. Prefill and mixed steps keep the
# separate kernel (a chunk's rows read each other's keys), so the two forms must give the same
# bits: same function, same warps (the separate kernel then takes attention's). Session 8 (run 38)
# measured it slower (0.639 / 0.737 -> 0.681 / 0.761 ms at 1 / 16 slots: every program of a row
# redoes the row's norm and rope before its own loads, and a row then had 4-8 programs of 32-key
# segments). With one 64-key block per segment (session 9) a row has 2-4, and it pays: H200
# (session 10, runs 54-56) 0.588 / 0.644 / 0.821 -> 0.575 / 0.636 / 0.805 ms at 1 / 16 / 32 slots
# at attention's 4 warps, 0.574 / 0.628 / 0.798 at 8 (ATTN_WARPS); exact vs solo (prompts 3..700).
ROPE_IN_ATTENTION = True
# Warps of the attention partial kernel, one value per runner (prefill and decode alike; the
# separate QK-norm/rope kernel takes them too where ROPE_IN_ATTENTION). H200: 4 instead of the
# kernel's tile-size default (8 for Gemma's 16-row x 256 tiles) took 0.693 / 0.791 ms to 0.679 /
# 0.780 at 1 / 16 slots (session 7, run 36); with the rope prologue 8 is faster again (session 10,
# run 56: 0.636 -> 0.628 ms at 16 slots, 0.805 -> 0.798 at 32).
ATTN_WARPS = 8
# The graphed decode step's layer loop as ONE persistent launch (kernels/persistent.py): the
# launches are recorded, not run, and their programs become work items that wait on counters
# instead of kernel boundaries; every item runs its kernel's body with the same constexprs, so
# the results are bitwise the chain's. Needs one num_warps for every kernel of the loop: where it
# is on, the runner's attention and FMA-GEMV launches take PERSISTENT_WARPS everywhere (prefill
# and mixed steps too, so every path keeps the same arithmetic). Falls back to the chain where a
# launch has no persistent item (the folds, the raw form, the cuBLAS variant). Off: bitwise the
# chain on an H200 but slower (session 6: 0.942 vs 0.689 ms at 1 slot, 1.094 vs 0.791 at 16;
# docs/GPU_NOTES.md says why and what would change it).
PERSISTENT = False
PERSISTENT_WARPS = 4
PERSISTENT_COUNTERS = 4096  # stages one launch may hold (Gemma 3 270M: ~160)


@dataclass
class _Graph:
    graph: object
    bucket: int
    nseg: int
    launches: int
    plan: object = None  # the persistent step's tables and the buffers they name (kept alive)


class _Eager:
    """Stands in for a CUDA graph: replay() runs the captured body eagerly."""

    def __init__(self, body):
        self.replay = body


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


class TritonRunner:
    supports_fused_step = True

    def __init__(self, model: Model, slot_capacity: int, *, device: str | torch.device | None = None,
                 graphs: bool | str | None = None, dense: str = "quant", kv_dtype: torch.dtype | None = None,
                 attn_segment: int | None = None, matmul: str | None = None,
                 head_matmul: str | None = None, layer_forms: dict[str, str] | None = None,
                 fuse_combine: bool | None = None, pdl: bool | None = None, fuse_glu: bool | None = None,
                 fuse_qk_rope: bool | None = None, attn_dot: bool | None = None,
                 fuse_add_norm: bool | None = None, attn_bf16: bool | None = None,
                 persistent: bool | None = None, pair_launch: bool | None = None,
                 rope_in_attention: bool | None = None, glu_in_down: bool | None = None):
        from .kernels import pdl as _pdl
        from .kernels import qmatmul as qm

        self._qm, self._pdl = qm, _pdl
        self.pdl = PDL if pdl is None else bool(pdl)
        self.model = model
        c = self.cfg = model.config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                raise WorkbenchError("backend='triton' without a CUDA device needs TRITON_INTERPRET=1 "
                                     "set before triton is first imported")
        if dense not in ("quant", "cublas_bf16"):
            raise WorkbenchError(f"dense={dense!r} is not allowed: allowed quant, cublas_bf16")
        self.dense = dense
        # the module defaults (MATMUL, HEAD_MATMUL, LAYER_FORMS) go together; an explicit matmul
        # means every weight in that form unless head_matmul / layer_forms say otherwise
        defaults = matmul is None
        self.matmul = MATMUL if defaults else matmul
        if self.matmul not in MATMUL_FORMS:
            raise WorkbenchError(f"matmul={matmul!r} is not allowed: allowed {', '.join(MATMUL_FORMS)}")
        self.head_matmul = head_matmul or (HEAD_MATMUL if defaults else None) or self.matmul
        self.layer_forms = dict(layer_forms if layer_forms is not None else LAYER_FORMS if defaults else {})
        # raw GGUF bytes or packed planes is one choice for all weights; the packed forms mix
        allowed = ("raw",) if self.matmul == "raw" else ("mma", "gemv")
        # the head may also take a dequantized copy on tensor cores (kernels.dense_mma)
        head_allowed = allowed if self.matmul == "raw" else (*allowed, *HEAD_DENSE_FORMS)
        if self.head_matmul == "q8f16" and (why := f16_head_refusal(model)) is not None:
            if head_matmul == "q8f16":
                raise WorkbenchError(f"head_matmul='q8f16' (float16 operands) is refused: {why}; allowed "
                                     f"{', '.join(f for f in head_allowed if f != 'q8f16')}")
            self.head_matmul = "dense"  # the default where float16 cannot be proved safe
        if self.head_matmul == "q8i8" and head_matmul is None and (
                head_qtype(model) != "Q8_0" or model.dtype != torch.bfloat16 or dense != "quant"):
            # the default's int8 head: a bfloat16 engine's Q8_0 head (a float32 engine keeps its
            # float32 products; the cuBLAS variant reads the dense copy)
            self.head_matmul = "dense"
        for what, form, ok in [("head_matmul", self.head_matmul, head_allowed),
                               *(("layer_forms", f, allowed) for f in self.layer_forms.values())]:
            if form not in ok:
                raise WorkbenchError(f"{what}: form {form!r} is not allowed with matmul={self.matmul!r}: "
                                     f"allowed {', '.join(ok)}")
        from .kernels import attention as _attn
        from .kernels import dense_mma as _dense
        from .kernels import embedding as _embedding
        from .kernels import qmma as _qmma
        from .kernels import step_fused as _fused

        self._attn, self._qmma, self._fused, self._dense = _attn, _qmma, _fused, _dense
        self._embedding = _embedding
        # keys per attention partial program (ATTN_SEGMENT by default): one
        # value per runner, used by prefill and decode alike, so rows stay bitwise invariant
        self.attn_segment = int(attn_segment or ATTN_SEGMENT)
        if self.attn_segment not in (32, 64, 128, 256):
            raise WorkbenchError(f"attn_segment={attn_segment!r} is not allowed: allowed 32, 64, 128, 256")
        self.use_dot = self.device.type == "cuda"
        # attention's two products: tl.dot (tf32x3 on tensor cores) or float32 multiply + tl.sum
        # (the interpreter's form; exact float32, run on the GPU too when attn_dot=False): one
        # form per runner. The FMA form measured slower on an H200 (session 5).
        self.attn_dot = self.use_dot if attn_dot is None else bool(attn_dot) and self.use_dot
        bf16 = ATTN_BF16 if attn_bf16 is None else bool(attn_bf16)
        self.attn_prec = "bf16" if bf16 and model.dtype == torch.bfloat16 else None  # None: the kernels' default
        # graphs="emulate": the graph path (buckets, padding, scratch slot, device-fed tokens)
        # replayed eagerly, so that the CPU tests cover it; True: CUDA graphs where CUDA is.
        graphs = GRAPHS if graphs is None else graphs
        self._emulate = graphs == "emulate"
        self.use_graphs = self._emulate or (bool(graphs) and self.device.type == "cuda")
        self.slot_capacity = slot_capacity
        if c.head_dim % 2 or c.n_embd > MAX_EMBD:
            raise WorkbenchError(f"backend='triton' needs an even head_dim and n_embd <= {MAX_EMBD}")
        self.kv_dtype = kv_dtype or model.dtype
        # the tensor-core form's operand precision follows the engine's dtype
        self.mma_prec = "bf16" if model.dtype == torch.bfloat16 else "tf32x3"
        self.head_x_dtype = None  # (None: the layers' h, float32)
        if HEAD_X_HALF and self.head_matmul == "q8f16":
            self.head_x_dtype = torch.float16
        elif HEAD_X_HALF and self.head_matmul in ("dense", "q8dense") and self.mma_prec == "bf16" and self.use_dot:
            self.head_x_dtype = torch.bfloat16
        weights = load_device_weights(model, self.device, matmul=self.matmul, layer_forms=self.layer_forms,
                                      head_form=self.head_matmul, dense=dense)
        self.layers, self.embed, self.head = weights.layers, weights.embed, weights.head
        self.output_norm = weights.output_norm
        self.fixed_bytes = weights.nbytes
        self.step_weight_bytes = weights.step_bytes  # read by every decode step (the floor's bytes)
        self.vocab = self.head.N
        d = c.head_dim
        from .kernels.rope import rope_inv_freq

        self._inv_freq = {b: rope_inv_freq(d, b, self.device)
                          for b in {c.layer_rope_base(i) for i in range(c.n_layers)}}
        # Activation bytes of one row at the widest point (float32 residual, normed input, qkv
        # partials, q, attention output, gate|up partials, GLU output, down partials) plus the
        # attention workspace of a row at full slot capacity.
        qrows = max(16, triton.next_power_of_2(c.n_heads // c.n_kv_heads)) if self.attn_dot else \
            triton.next_power_of_2(c.n_heads // c.n_kv_heads)
        nseg_cap = -(-slot_capacity // self.attn_segment)
        ws = c.n_kv_heads * nseg_cap * qrows * (max(16, triton.next_power_of_2(d)) + 2)
        sp = self.layers[0]
        per_row = (2 * c.n_embd + sp.qkv.splits * sp.qkv.N + 2 * c.q_dim + sp.gate_up.splits * sp.gate_up.N
                   + c.n_ff + max(sp.down.splits, sp.wo.splits) * c.n_embd + ws)
        self.bytes_per_prefill_row = int(4 * per_row)
        self._elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        self._kv_per_token = c.kv_bytes_per_token(self._elem)
        # KV pool and per-slot bookkeeping
        self._pool_slots = 0  # real slots in the pool (scratch is index _pool_slots)
        self._pool_len = 0
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None
        self._owner: dict[int, Hashable] = {}
        self._len: dict[int, int] = {}
        # graph state
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._gpool = None
        self._g_in: torch.Tensor | None = None
        self._g_tok: torch.Tensor | None = None
        self._g_logits: torch.Tensor | None = None
        fuse = FUSE_ATTENTION_COMBINE if fuse_combine is None else fuse_combine
        # one buffer for every forward (graphs keep its address); each launch leaves it zero
        self._attn_counters = torch.zeros(ATTN_COUNTER_ROWS * c.n_kv_heads, dtype=torch.int32,
                                          device=self.device) if fuse else None
        self.fuse_glu = (FUSE_GLU if fuse_glu is None else bool(fuse_glu)) and dense == "quant"
        self.glu_in_down = (GLU_IN_DOWN if glu_in_down is None else bool(glu_in_down)) and dense == "quant"
        self.pair_launch = (PAIR_LAUNCH if pair_launch is None else bool(pair_launch)) and dense == "quant"
        self._glu_counters = torch.zeros(EPILOGUE_COUNTERS, dtype=torch.int32, device=self.device) if self.fuse_glu else None
        self.fuse_qk_rope = (FUSE_QK_ROPE if fuse_qk_rope is None else bool(fuse_qk_rope)) and dense == "quant"
        self._heads_counters = torch.zeros(EPILOGUE_COUNTERS, dtype=torch.int32, device=self.device) \
            if self.fuse_qk_rope else None
        self.fuse_add_norm = (FUSE_ADD_NORM if fuse_add_norm is None else bool(fuse_add_norm)) and dense == "quant"
        self._norm_counters = torch.zeros(EPILOGUE_COUNTERS, dtype=torch.int32, device=self.device) \
            if self.fuse_add_norm else None
        # the persistent step (graph path only; items need the packed forms and no heads/norm fold)
        want = ROPE_IN_ATTENTION if rope_in_attention is None else bool(rope_in_attention)
        self.rope_in_attention = want and fuse and not self.fuse_qk_rope
        want = PERSISTENT if persistent is None else bool(persistent)
        self.persistent = False
        self.persistent_off: str | None = None  # why a recorded loop fell back to the chain
        self.uniform_warps: int | None = None
        if want and self.use_graphs and dense == "quant" and self.matmul != "raw" and not self.fuse_qk_rope \
                and not self.fuse_add_norm:
            self._persistent_on()
        self._decode_graph = False  # set while a graph body (decode rows, one per slot) runs
        self._pctr: torch.Tensor | None = None
        self._plan = None  # the persistent plan of the last graphed forward
        self._persist_now = False  # set while a graph body runs
        self._zeros = torch.zeros(BUCKETS[-1], dtype=torch.int32, device=self.device)
        self._wins = torch.full((BUCKETS[-1],), max(c.sliding_window, 0), dtype=torch.int32, device=self.device)
        self.launches = 0  # kernel launches of the last forward (counted where they are issued)
        self._head_best = None  # the head's running-argmax buffers while a decode graph is built
        self._ahead: tuple | None = None  # (segments key,) of a decode step launched early
        self._tok_host: torch.Tensor | None = None

    def _persistent_on(self) -> None:
        """The graphed layer loop as one persistent launch: one num_warps for every launch of the
        runner (every path, so rows keep one arithmetic), and none of the forms that have no
        persistent item (the pair launch, the rope prologue)."""
        self.persistent, self.uniform_warps = True, PERSISTENT_WARPS
        self.pair_launch = self.rope_in_attention = False

    # -- RunnerInfo ----------------------------------------------------------------------------
    def cache_bytes(self, num_tokens: int) -> int:
        return self._kv_per_token * (-(-num_tokens // POOL_BLOCK) * POOL_BLOCK)

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        if self.dense != "quant":
            return False, "dense products are not batch-invariant"
        return True, None

    def reset(self, slot: int) -> None:
        self._ahead = None
        self._owner.pop(slot, None)
        self._len.pop(slot, None)

    @property
    def kv_bytes(self) -> int:
        if self.k_pool is None:
            return 0
        return 2 * self.k_pool.numel() * self.k_pool.element_size()

    # -- KV pool ------------------------------------------------------------------------------
    def _ensure_pool(self, slots: int, length: int) -> None:
        cap = -(-self.slot_capacity // POOL_BLOCK) * POOL_BLOCK
        if length > cap:
            raise WorkbenchError(f"a slot needs {length} tokens but the slot capacity is {self.slot_capacity}")
        if slots <= self._pool_slots and length <= self._pool_len:
            return
        new_s = max(self._pool_slots, _pow2_at_least(slots, 1))
        new_l = min(cap, max(self._pool_len, _pow2_at_least(length, POOL_BLOCK)))
        c = self.cfg
        shape = (c.n_layers, new_s + 1, new_l, c.n_kv_heads, c.head_dim)
        k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if self.k_pool is not None:
            s0, l0 = self._pool_slots, self._pool_len
            k[:, :s0, :l0] = self.k_pool[:, :s0]
            v[:, :s0, :l0] = self.v_pool[:, :s0]
        self.k_pool, self.v_pool = k, v
        self._pool_slots, self._pool_len = new_s, new_l
        self._graphs.clear()  # they point at the old pool

    # -- the forward ----------------------------------------------------------------------------
    def _glu_fold(self, p: Proj, M: int) -> bool:
        """Whether the GLU can ride on this [gate | up] product's launch (kernels' GluEpilogue)."""
        if not self.fuse_glu or p.dense is not None or len(p.parts) != 1 or p.parts[0][1].packed is None:
            return False
        w = p.parts[0][1]
        if w.form == "mma":
            cfg = self._qmma.mma_config(w.fmt.name, w.N, w.K, self.device, w.k_split)
            need = self._qm.glu_counters(M, w.N, cfg.block_n, cfg.block_m)
        else:
            cfg = self._qm.gemv_config(w.fmt.name, w.N, w.K, self.device, w.k_split)
            need = self._qm.glu_counters(M, w.N, cfg.block_n, cfg.m_tile)
        return need is not None and need <= self._glu_counters.numel()

    def _glu_in_down(self, gate_up: Proj, down: Proj) -> bool:
        """Whether the down product forms the GLU from gate|up's partials (``GLU_IN_DOWN``)."""
        # (not with the persistent step, which has no such item, nor with the add+norm fold, which
        # takes the product where its counters suffice: one form for every path of a runner, at any M)
        if not self.glu_in_down or self.persistent or self.fuse_add_norm or gate_up.dense is not None \
                or down.dense is not None or len(down.parts) != 1:
            return False
        w = down.parts[0][1]
        return w.packed is not None and w.form == "mma"

    def _heads_fold(self, p: Proj, M: int) -> bool:
        """Whether QK-norm + rope + the KV write can ride on this q|k|v product's launches."""
        if not self.fuse_qk_rope or p.dense is not None:
            return False
        for off, w in p.parts:
            if w.packed is None or w.form != "mma":
                return False
            cfg = self._qmma.mma_config(w.fmt.name, w.N, w.K, self.device, w.k_split)
            need = self._qm.heads_counters(M, w.N, off, self.cfg.head_dim, cfg.block_n, cfg.block_m)
            if need is None or need > self._heads_counters.numel():
                return False
        return True

    def _norm_fold(self, p: Proj, M: int) -> bool:
        """Whether the residual add + next norm can ride on this product's launch."""
        if not self.fuse_add_norm or p.dense is not None or len(p.parts) != 1:
            return False
        w = p.parts[0][1]
        if w.packed is None or w.form != "mma":
            return False
        cfg = self._qmma.mma_config(w.fmt.name, w.N, w.K, self.device, w.k_split)
        need = self._qm.norm_counters(M, w.N, cfg.block_n, cfg.block_m)
        return need is not None and need <= self._norm_counters.numel()

    def _pair(self, p: Proj) -> bool:
        """Whether this product's two members (tensor-core, then GEMV) go as one launch."""
        if not self.pair_launch or p.dense is not None or len(p.parts) != 2:
            return False
        (_, a), (_, b) = p.parts  # (one K and one K slice: members of one product, device_weights)
        return a.form == "mma" and b.form == "gemv" and a.packed is not None and b.packed is not None

    def _project(self, x: torch.Tensor, p: Proj, out: torch.Tensor | None = None, glu=None,
                 heads=None, norm=None, glu_x: str | None = None) -> torch.Tensor:
        """Partials [splits, M, N] of x @ W^T (float32; bf16 [1, M, N] for the dense variant).
        ``out`` (float32 [M, N], an unsplit product: the head): written in place and returned.
        ``glu`` (a kernels GluEpilogue, where ``_glu_fold``): also act(gate) * up into glu.out;
        ``heads`` (a kernels HeadsEpilogue, where ``_heads_fold``): also q, k, v as qk_rope_kv;
        ``norm`` (a kernels NormEpilogue, where ``_norm_fold``): also add_rmsnorm's x and h.
        ``glu_x`` (where ``_glu_in_down``): x is gate|up's partials [splits, M, 2K], the product's
        input act(gate) * up of them."""
        M = x.shape[0] if glu_x is None else x.shape[1]
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
        qm = self._qm
        if self._pair(p) and glu is None and heads is None and norm is None and out is None:
            (oa, wa), (ob, wb) = p.parts
            self._qmma.launch_mma_gemv_pair(x, wa.packed, part[:, :, oa:], wb.packed, part[:, :, ob:], p.splits,
                                            part.stride(0), self.mma_prec, use_dot=self.use_dot)
            self.launches += 1
            return part
        for off, w in p.parts:
            if w.form == "dense":  # (the head) the dequantized weight on tensor cores
                self._dense.dense_mma(x, w.dense, self.mma_prec, out=part[0, :, off:], use_dot=self.use_dot,
                                      best=self._head_best)
                self.launches += 1
                continue
            if w.form == "q8i8":  # (a Q8_0 head) x as Q8_0 blocks, one integer MMA per block
                xq, xd = self._dense.quantize_rows_q8(x)
                self._dense.q8i8_mma(xq, xd, w.packed, out=part[0, :, off:], use_dot=self.use_dot,
                                     best=self._head_best)
                self.launches += 2
                continue
            if w.form in ("q8dense", "q8f16"):  # (a Q8_0 head) dense_mma's products from the packed planes
                prec = "f16" if w.form == "q8f16" else self.mma_prec
                self._dense.q8_dense_mma(x, w.packed, prec, out=part[0, :, off:], use_dot=self.use_dot,
                                         best=self._head_best)
                self.launches += 1
                continue
            if w.packed is not None:
                self._launch_packed(x, w.packed, part[:, :, off:], w.splits, part.stride(0), w.form, glu, heads, off,
                                    norm, glu_x)
                continue
            cfg = qm.QMATMUL_CONFIGS[w.fmt.name]
            grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(w.N, cfg.block_n), w.splits)
            qm._qmatmul_kernel[grid](
                x, w.raw, part[:, :, off:], M, w.N, w.K, w.k_split if w.splits > 1 else w.K,
                x.stride(0), part.stride(1), part.stride(0), w.raw.stride(0),
                QTYPE=w.fmt.code, SUB=w.fmt.sub, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, INPUT_PRECISION=qm.QMATMUL_INPUT_PRECISION, USE_DOT=self.use_dot,
                num_warps=cfg.num_warps, **qm.launch_kw(x),
            )
            self.launches += 1
        return part if out is None else out

    def _launch_packed(self, x, pw, y, splits: int, stride_ys: int, form: str, glu=None, heads=None,
                       col0: int = 0, norm=None, glu_x: str | None = None) -> None:
        if form == "mma":
            self._qmma.launch_qmma(x, pw, y, splits, stride_ys, self.mma_prec, use_dot=self.use_dot, glu=glu,
                                   heads=heads, col0=col0, norm=norm, glu_x=glu_x)
        else:
            cfg = self._qm.gemv_config(pw.fmt.name, pw.N, pw.K, self.device, pw.slice_k)
            if self.uniform_warps:
                cfg = replace(cfg, num_warps=self.uniform_warps)
            self._qm.launch_qgemv(x, pw, y, splits, stride_ys, config=cfg, glu=glu)
        self.launches += 1

    def _project_add_norm(self, a, p: Proj, x, w_post, w_next, h, glu_x: str | None = None) -> None:
        """x += post_norm(a @ W^T); h = rmsnorm(x) * w_next: folded into the product's launch
        where ``_norm_fold``, else the product then ``add_rmsnorm``. ``glu_x``: a is gate|up's
        partials and the product forms its input act(gate) * up (``_glu_in_down``)."""
        if glu_x is None and self._norm_fold(p, a.shape[0]):
            self._project(a, p, norm=self._qm.NormEpilogue(x, h, w_post, w_next, self.cfg.rms_eps,
                                                           self._norm_counters))
            return
        part = self._project(a, p, glu_x=glu_x)
        self._fused.add_rmsnorm(x, part, w_post, w_next, h, self.cfg.rms_eps, num_warps=self.uniform_warps)
        self.launches += 1

    def _forward(self, ids, pos, seq, R: int, max_pos: int, sel=None, logits_out=None):
        """Logits [len(sel) or R, vocab] of the rows (ids, pos, seq: int32 [R] on the device)."""
        with self._pdl.enabled(self.pdl):
            return self._forward_body(ids, pos, seq, R, max_pos, sel, logits_out)

    def _forward_body(self, ids, pos, seq, R: int, max_pos: int, sel, logits_out):
        from .kernels.embedding import embedding
        from .kernels.norm import rmsnorm

        c = self.cfg
        dev = self.device
        E = c.n_embd
        hdt = torch.bfloat16 if self.dense != "quant" else torch.float32
        x = torch.empty((R, E), dtype=torch.float32, device=dev)
        h = torch.empty((R, E), dtype=hdt, device=dev)
        if EMBED_NORM and hdt == torch.float32 and E <= self._embedding.EMBEDDING_NORM_MAX:  # (one launch)
            self._embedding.embedding_rmsnorm(ids, self.embed.raw, E, c.embed_scale, self.embed.fmt.name,
                                              self.layers[0].attn_norm, c.rms_eps, x, h)
            self.launches += 1
        else:
            embedding(ids, self.embed.raw, E, c.embed_scale, self.embed.fmt.name, out=x)
            rmsnorm(x, self.layers[0].attn_norm, c.rms_eps, out=h) if hdt == torch.float32 else \
                h.copy_(rmsnorm(x, self.layers[0].attn_norm, c.rms_eps))
            self.launches += 2 + (hdt != torch.float32)
        if R <= self._zeros.shape[0]:
            zeros, wins = self._zeros[:R], self._wins[:R]
        else:
            zeros = torch.zeros(R, dtype=torch.int32, device=dev)
            wins = torch.full((R,), max(c.sliding_window, 0), dtype=torch.int32, device=dev)
        # the head's input: h, or a buffer at the head's operand precision (HEAD_X_HALF)
        hx = h if self.head_x_dtype is None else torch.empty((R, E), dtype=self.head_x_dtype, device=dev)
        if self._persist_now:
            self._layers_persistent(x, h, pos, seq, R, max_pos, zeros, wins, hx)
        else:
            self._layers(x, h, pos, seq, R, max_pos, zeros, wins, hx)
        hs = hx if sel is None else hx.index_select(0, sel)
        if logits_out is None:
            logits_out = torch.empty((hs.shape[0], self.vocab), dtype=torch.float32, device=dev)
        self._project(hs, self.head, out=logits_out)
        return logits_out

    def _layers_persistent(self, x, h, pos, seq, R: int, max_pos: int, zeros, wins, hx) -> None:
        """The layer loop recorded and run as one persistent launch (kernels/persistent.py); the
        chain where a launch has no persistent item (remembered in ``persistent_off``)."""
        from .kernels import persistent as ps

        before = self.launches
        try:
            with ps.record() as rec:
                self._layers(x, h, pos, seq, R, max_pos, zeros, wins, hx)
            plan = rec.plan(self.device)
        except ps.Unsupported as e:
            self.persistent, self.persistent_off = False, str(e)
            self.launches = before
            self._layers(x, h, pos, seq, R, max_pos, zeros, wins, hx)
            return
        if self._pctr is None or self._pctr.numel() < plan.stages + 1:
            if plan.stages + 1 > PERSISTENT_COUNTERS:
                raise WorkbenchError(f"the persistent step holds {PERSISTENT_COUNTERS} stages, needs {plan.stages + 1}")
            self._pctr = ps.counters(PERSISTENT_COUNTERS, self.device)
        if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            plan.upload()  # (a capture uploads after it ends: _graph_for)
        ps.launch(plan, self._pctr)
        self._plan = plan
        self.launches = before + 1

    def _layers(self, x, h, pos, seq, R: int, max_pos: int, zeros, wins, hx) -> None:
        """Every layer: x (float32 [R, E], the residual) and h (the next input, normed) in place."""
        from .kernels.attention import attention_rows

        c = self.cfg
        dev = self.device
        Hq, D = c.n_heads, c.head_dim
        hdt = h.dtype
        act = "gelu_tanh" if c.activation == "gelu_tanh" else "silu"
        attn_warps = self.uniform_warps or ATTN_WARPS
        for li, L in enumerate(self.layers):
            q = torch.empty((R, Hq, D), dtype=torch.float32, device=dev)
            kp, vp = self.k_pool[li], self.v_pool[li]
            inv = self._inv_freq[c.layer_rope_base(li)]
            rope = None
            if self._heads_fold(L.qkv, R):
                self._project(h, L.qkv, heads=self._qm.HeadsEpilogue(q, kp, vp, seq, pos, L.q_norm, L.k_norm, inv,
                                                                     c.rms_eps, self._heads_counters))
            elif self.rope_in_attention and self._decode_graph and R <= ATTN_COUNTER_ROWS:
                rope = self._attn.RopePrologue(self._project(h, L.qkv), L.q_norm, L.k_norm, inv, c.rms_eps)
            else:
                part = self._project(h, L.qkv)
                self._fused.qk_rope_kv(part, q, kp, vp, seq, pos, L.q_norm, L.k_norm, inv, c.rms_eps,
                                       num_warps=attn_warps if self.rope_in_attention else self.uniform_warps)
                self.launches += 1
            seg_saved, self._attn.ATTENTION_SEGMENT = self._attn.ATTENTION_SEGMENT, self.attn_segment
            try:  # the module constant is read at launch; put it back for other callers
                counters = self._attn_counters if R <= ATTN_COUNTER_ROWS else None
                attn = attention_rows(q, kp, vp, seq, pos, wins if c.layer_window(li) else zeros,
                                      c.attn_scale, max_pos=max_pos, use_dot=self.attn_dot, counters=counters,
                                      precision=self.attn_prec, num_warps=attn_warps, rope=rope)
            finally:
                self._attn.ATTENTION_SEGMENT = seg_saved
            self.launches += 1 if counters is not None else 2
            a = attn.view(R, Hq * D)
            self._project_add_norm(a, L.wo, x, L.post_attn_norm, L.ffn_norm, h)
            last = li + 1 == len(self.layers)
            nxt = self.output_norm if last else self.layers[li + 1].attn_norm
            if self._glu_in_down(L.gate_up, L.down):  # down forms act(gate) * up from the partials
                part = self._project(h, L.gate_up)
                self._project_add_norm(part, L.down, x, L.post_ffw_norm, nxt, hx if last else h, glu_x=act)
                continue
            g = torch.empty((R, c.n_ff), dtype=hdt, device=dev)
            if self._glu_fold(L.gate_up, R):
                self._project(h, L.gate_up, glu=self._qm.GluEpilogue(g, self._glu_counters, act))
            else:
                part = self._project(h, L.gate_up)
                self._fused.glu_from_parts(part, g, act)
                self.launches += 1
            self._project_add_norm(g, L.down, x, L.post_ffw_norm, nxt, hx if last else h)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _begin(self, forward: Sequence[Segment], max_context: dict[int, int]) -> None:
        for s in forward:
            if self._owner.get(s.slot_id) != s.request_id:
                self._owner[s.slot_id] = s.request_id
                self._len[s.slot_id] = 0
            if self._len[s.slot_id] != s.start_pos:
                raise RuntimeError(f"slot {s.slot_id}: KV holds {self._len[s.slot_id]} tokens, plan starts at {s.start_pos}")
        need_len = max(list(max_context.values()) + [s.start_pos + len(s.token_ids) for s in forward])
        # size the pool for every admitted slot (max_context has them all), not only this forward's
        self._ensure_pool(max([s.slot_id for s in forward] + list(max_context)) + 1, need_len)

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
        launched, self._ahead = self._ahead, None
        self._begin(forward, max_context)
        decode = all(len(s.token_ids) == 1 and s.samples for s in forward)
        if decode and self.use_graphs and len(forward) <= BUCKETS[-1]:
            n = len(forward)
            max_pos = max(s.start_pos for s in forward)
            key = tuple((s.slot_id, s.start_pos, s.token_ids[0]) for s in forward)
            if launched is None or launched[0] != key:
                g = self._graph_for(n, max_pos)
                self._fill_inputs(forward, g.bucket)
                g.graph.replay()
                self.launches = g.launches or self.launches
            if ahead and all(s.slot_id in argmax and s.start_pos + 2 <= max_context[s.slot_id] for s in forward) \
                    and max_pos + 1 < self._pool_len:
                toks = self._tokens_then_next(n, max_pos + 1, [s.start_pos for s in forward])
                self._ahead = (tuple((sl, p + 1, t) for (sl, p, _), t in zip(key, toks)),)
                out = {s.slot_id: t for s, t in zip(forward, toks)}
            else:
                # the graph computed every row's argmax into _g_tok already
                out = self._rows_out([s.slot_id for s in forward], self._g_logits[:n], self._g_tok[:n], argmax)
        else:
            out = self._run_eager(forward, argmax)
        for s in forward:
            self._len[s.slot_id] = s.start_pos + len(s.token_ids)
        return out

    def _tokens_then_next(self, n: int, next_max_pos: int, positions: list[int]) -> list[int]:
        """This step's n greedy tokens, copied to the host before the next step's graph (whose
        inputs the graph has written) is launched; returns them once the copy is done. With
        TOKENS_IN_GRAPH the graph has written them into host memory itself (by each row's
        position parity, which the next graph does not write): no copy between the two graphs."""
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if self._g_host is None:
            if self._tok_host is None:
                self._tok_host = torch.empty(BUCKETS[-1], dtype=torch.int64, pin_memory=done is not None)
            self._tok_host[:n].copy_(self._g_tok[:n], non_blocking=True)
        if done is not None:
            done.record()
        g = self._graph_for(n, next_max_pos)  # (a first capture synchronizes; _g_in is kept)
        g.graph.replay()
        if done is not None:
            done.synchronize()
        if self._g_host is not None:
            rows = self._g_host[:n].tolist()
            return [rows[r][p % 2] for r, p in enumerate(positions)]
        return self._tok_host[:n].tolist()

    def _rows_out(self, slots: list[int], logits: torch.Tensor, tokens: torch.Tensor | None,
                  argmax: frozenset[int]) -> dict[int, torch.Tensor | int]:
        """The answer for sampled rows ``slots`` (in ``logits`` order): tokens where allowed,
        else logits (a host copy, or a device copy: later forwards reuse the graph buffers)."""
        want_tok = [i for i, sl in enumerate(slots) if sl in argmax]
        want_row = [i for i, sl in enumerate(slots) if sl not in argmax]
        out: dict[int, torch.Tensor | int] = {}
        if want_tok:
            if tokens is None:
                from .kernels.sampling import argmax as argmax_rows

                tokens = argmax_rows(logits)
            toks = tokens.tolist()  # the one sync of the step when nothing else is copied
            out.update((slots[i], int(toks[i])) for i in want_tok)
        if want_row:
            sub = logits if len(want_row) == len(slots) else logits[torch.tensor(want_row, device=logits.device)]
            rows = self._to_host(sub) if LOGITS_TO_HOST else sub.clone()
            out.update((slots[i], rows[j]) for j, i in enumerate(want_row))
        return out

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of device logits through pinned memory (torch's caching host allocator):
        a fresh pageable tensor page-faults during the copy (measured on an H200 VM: 10 ms for
        16 rows of 262144 floats, 1.6 GB/s)."""
        if t.device.type != "cuda":
            return t
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return h

    def _run_eager(self, forward: Sequence[Segment], argmax: frozenset[int] = frozenset()) -> dict[int, torch.Tensor | int]:
        ids, pos, seq, sel = [], [], [], []
        for s in forward:
            n = len(s.token_ids)
            ids += list(s.token_ids)
            pos += range(s.start_pos, s.start_pos + n)
            seq += [s.slot_id] * n
            if s.samples:
                sel.append(len(ids) - 1)
        R = len(ids)
        host = torch.tensor([ids, pos, seq], dtype=torch.int32)
        dev = host.to(self.device)
        self.launches = 0
        sel_t = None if len(sel) == R else torch.tensor(sel, dtype=torch.int64).to(self.device)
        if not sel:
            # no row is sampled: run the layers (the KV writes) and skip the head
            self._forward_no_head(dev[0], dev[1], dev[2], R, max(pos))
            return {}
        logits = self._forward(dev[0], dev[1], dev[2], R, max(pos), sel=sel_t)
        return self._rows_out([s.slot_id for s in forward if s.samples], logits, None, argmax)

    def _forward_no_head(self, ids, pos, seq, R, max_pos):
        # the head on one row is cheap next to a prefill chunk; its result is dropped
        sel = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._forward(ids, pos, seq, R, max_pos, sel=sel)

    # -- CUDA graphs ------------------------------------------------------------------------------
    def _graph_inputs(self) -> None:
        if self._g_in is None:
            B = BUCKETS[-1]
            self._g_in = torch.zeros((3, B), dtype=torch.int32, device=self.device)
            self._g_tok = torch.zeros(B, dtype=torch.int64, device=self.device)
            # each graph row's greedy tokens by position modulo GRAPH_HISTORY (decode_loop's record)
            self._g_hist = torch.zeros((B, GRAPH_HISTORY), dtype=torch.int64, device=self.device) \
                if GRAPH_HISTORY > 0 else None
            # each graph row's greedy token written by the graph into host memory (TOKENS_IN_GRAPH)
            self._g_host = torch.zeros((B, 2), dtype=torch.int64, pin_memory=self.device.type == "cuda") \
                if TOKENS_IN_GRAPH else None
            self._g_logits = torch.zeros((B, self.vocab), dtype=torch.float32, device=self.device)
            self._gpool = None if self._emulate else torch.cuda.graph_pool_handle()

    def _pad_inputs(self, bucket: int) -> None:
        self._g_in[:, :bucket] = 0
        self._g_in[2, :bucket] = self._pool_slots  # the scratch slot

    def _graph_body(self, bucket: int, max_pos: int) -> None:
        from .kernels.sampling import argmax, argmax_from_partials

        self.launches = 0
        ids, pos, seq = self._g_in[0, :bucket], self._g_in[1, :bucket], self._g_in[2, :bucket]
        best = self._argmax_partials(bucket)
        self._persist_now, self._plan, self._decode_graph, self._head_best = self.persistent, None, True, best
        try:
            self._forward(ids, pos, seq, bucket, max_pos, logits_out=self._g_logits[:bucket])
        finally:
            self._persist_now = self._decode_graph = False
            self._head_best = None
        # greedy fast path: the next step's inputs (token, position + 1) written on the device by
        # the argmax's second launch (the engine overwrites them where it feeds other inputs)
        with self._pdl.enabled(self.pdl):
            hist = None if self._g_hist is None else self._g_hist[:bucket]
            host = None if self._g_host is None else self._g_host[:bucket]
            if best is not None:  # (ARGMAX_IN_HEAD: the head's programs kept the first stage)
                argmax_from_partials(*best, out=self._g_tok[:bucket], feed=(ids, pos), hist=hist, host=host)
            else:
                argmax(self._g_logits[:bucket], out=self._g_tok[:bucket], feed=(ids, pos), hist=hist, host=host)
        self.launches += 1 if best is not None else 2

    def _argmax_partials(self, bucket: int):
        """The head's running-argmax buffers for a decode graph of ``bucket`` rows, or None
        (ARGMAX_IN_HEAD off, a head form not in ARGMAX_IN_HEAD_FORMS or a bucket above its limit,
        a head form without the streaming kernel, or two row tiles)."""
        w = self.head.parts[0][1]
        if not ARGMAX_IN_HEAD or self.dense != "quant" or bucket > ARGMAX_IN_HEAD_FORMS.get(w.form, 0):
            return None
        kernel = {"dense": "dense", "q8i8": "q8i8"}.get(w.form, "q8")  # (q8dense, q8f16: q8_dense_mma)
        return self._dense.best_partials(bucket, self.vocab, self.device,
                                         self._dense.head_config(kernel, self.device, bucket))

    def _graph_for(self, rows: int, max_pos: int) -> _Graph:
        bucket = next(b for b in BUCKETS if b >= rows)
        seg = self.attn_segment
        nseg = min(_pow2_at_least(-(-(max_pos + 1) // seg), 1), self._pool_len // seg)
        key = (bucket, nseg)
        g = self._graphs.get(key)
        if g is not None:
            return g
        self._graph_inputs()
        if self._emulate:
            g = self._graphs[key] = _Graph(_Eager(lambda: self._graph_body(bucket, nseg * seg - 1)),
                                           bucket, nseg, 0)
            return g
        torch.cuda.synchronize()
        saved = self._g_in.clone()
        self._pad_inputs(bucket)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            self._graph_body(bucket, nseg * seg - 1)
        torch.cuda.current_stream().wait_stream(side)
        self._pad_inputs(bucket)
        graph = torch.cuda.CUDAGraph()
        # cuBLAS (the dense variant) tripped the caching allocator with a shared pool
        with torch.cuda.graph(graph, pool=self._gpool if self.dense == "quant" else None):
            self._graph_body(bucket, nseg * seg - 1)
        torch.cuda.synchronize()
        if self._plan is not None:  # the captured launch reads its tables when replayed
            self._plan.upload()
            torch.cuda.synchronize()
        self._g_in.copy_(saved)
        g = self._graphs[key] = _Graph(graph, bucket, nseg, self.launches, self._plan)
        return g

    def _fill_inputs(self, forward: Sequence[Segment], bucket: int) -> None:
        host = torch.zeros((3, bucket), dtype=torch.int32)
        host[2, :] = self._pool_slots
        for i, s in enumerate(forward):
            host[0, i] = s.token_ids[0]
            host[1, i] = s.start_pos
            host[2, i] = s.slot_id
        self._g_in[:, :bucket].copy_(host)

    # -- benchmark fast path ----------------------------------------------------------------------
    @torch.inference_mode()
    def decode_loop(self, slots: Sequence[int], tokens: Sequence[int], steps: int,
                    max_context: dict[int, int] | None = None) -> torch.Tensor:
        """Greedy decode `steps` tokens for `slots` (each already prefilled; `tokens` are their
        next input tokens) by chained graph replays, the tokens fed back on the device.
        Returns int64 [steps, len(slots)] on the device. CUDA graphs only."""
        if not self.use_graphs:
            raise WorkbenchError("decode_loop needs CUDA graphs")
        segs = [Segment(s, self._owner[s], (int(t),), self._len[s], True) for s, t in zip(slots, tokens)]
        last = max(s.start_pos for s in segs) + steps - 1
        self._ensure_pool(max(slots) + 1, last + 1)
        g = self._graph_for(len(segs), last)
        self._fill_inputs(segs, g.bucket)
        # the graph's argmax keeps each row's token at _g_hist[row, pos % H]: replays back to back,
        # no copy between them, in chunks of at most H steps (GRAPH_HISTORY 0: a copy after each)
        n = len(segs)
        hist = torch.empty((steps, n), dtype=torch.int64, device=self.device)
        H = 1 if self._g_hist is None else self._g_hist.shape[1]
        start = torch.tensor([s.start_pos for s in segs], dtype=torch.int64, device=self.device)
        for t0 in range(0, steps, H):
            k = min(H, steps - t0)
            for _ in range(k):
                g.graph.replay()
                if self._g_hist is None:
                    hist[t0].copy_(self._g_tok[:n])
            if self._g_hist is not None:
                at = (start[:, None] + t0 + torch.arange(k, device=self.device)[None, :]) % H
                hist[t0 : t0 + k] = torch.gather(self._g_hist[:n], 1, at).T
        for s in segs:
            self._len[s.slot_id] = s.start_pos + steps
        self.launches = g.launches or self.launches
        return hist
