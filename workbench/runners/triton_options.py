"""TritonOptions: the Triton backend's choices as one frozen, validated object.

`EngineConfig(backend="triton", triton=TritonOptions(...))` carries it to `TritonRunner`, which
passes what each kernel needs as arguments; nothing is read from or patched into module globals.
Every field is a choice measured on an H200 (docs/GPU_NOTES.md; each field's comment gives the
runs), the defaults are the winners, and the variants that lost and that no ablation sweeps were
deleted (GPU_NOTES, "Options as data (session 13)"). Launch configurations (tiles, warps, row
buckets, K slices) are data at the top of the kernel and runner files, not options.

The forms kept below the line "same bits" are each a fold that won and whose unfolded form the
runner takes anyway where the fold does not fit: off forces that form everywhere (the bitwise
tests compare the two; an A/B run measures what the fold buys).

This module imports neither torch nor triton.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from ..errors import ConfigError, name_values, refuse_unknown_keys

HEAD_MATMULS = ("dense", "q8i8")
PRODUCTS = ("quant", "cublas_bf16")
KV_DTYPES = ("float32", "bfloat16")
ATTN_SEGMENTS = (32, 64, 128, 256)
LAYER_FORMS = ("mma", "gemv")
# The GGUF formats the kernels read (kernels.quant_tiles.FORMATS' names; a test keeps the two in
# step): spelled out here so that the options need no triton.
FORMATS = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")
# rows per captured chunk graph (runners/triton_graphs.py): steps of 1.5x / 2x
CHUNK_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class TritonOptions:
    # Decode-only forwards replay a CUDA graph per (row bucket, attention-segment bucket): True
    # where CUDA is (eager elsewhere), False eager, "emulate" the graph path replayed eagerly
    # (buckets, padding, scratch slot, device-fed tokens: what the CPU tests cover). Session 1,
    # H200 machine A: 8.4 ms per step eager with a host round trip, 2.33 ms graphed (3.6x).
    graphs: bool | str = True
    # The output head's product form, a choice of numerics. None: "q8i8" for a bfloat16 engine's
    # Q8_0 head with the quantized products, "dense" otherwise. "q8i8": the Q8_0 planes against
    # x quantized per 32 values to Q8_0 blocks (llama.cpp's numerics for its quantized products),
    # one exact integer MMA per block; 178 MB read, 157 MB less device memory. "dense": the
    # dequantized bf16 copy (bf16(d * q)) on tensor cores, 335 MB at copy bandwidth. Session 12,
    # run 67, one lease: q8i8 0.550 / 0.562 / 0.597 / 0.799 ms per step at 1 / 4 / 16 / 32 slots,
    # dense 0.569 / 0.582 / 0.620 / 0.777. Batched == solo either way.
    head_matmul: str | None = None
    # "quant": the batch-invariant quantized products; "cublas_bf16": cuBLAS bf16 products on
    # dequantized weights, the fastest NON-invariant variant, kept to measure what invariance
    # costs (its batch_verdict refuses batching for exactness). Session 10, run 57: 0.759 /
    # 0.761 / 0.795 / 0.830 ms against the invariant 0.574 / 0.591 / 0.628 / 0.791.
    products: str = "quant"
    # Per-format product form of the layer weights ("mma": packed planes on tensor cores,
    # kernels/qmma.py; "gemv": packed planes on float32 FMAs, kernels/qmatmul.py); a format not
    # named takes "mma". Fixed per weight at load, never by row count. Q8_0 on the GEMV: faster
    # in three leases (session 5: 0.794 -> 0.767 ms at 1 slot, 1.221 -> 1.186 at 32; session 10,
    # run 50: Q8_0 on tensor cores 0.649 / 0.693 ms at 1 / 16 against 0.605 / 0.659); the rest on
    # tensor cores (session 4, run 16: 0.983 ms at 16 slots against 1.039 with the K-quants on
    # the GEMV). Given as a mapping or (format, form) pairs; kept as sorted pairs.
    layer_forms: Any = (("Q8_0", "gemv"),)
    # Keys per attention partial program, one value per runner (prefill and decode alike, so rows
    # stay invariant). Session 3: 256 -> 32 took the 1-slot step from 1.74 to 1.11 ms; session 9,
    # run 48: 64-key segments in one 64-key block 0.609 / 0.668 ms at 1 / 16 slots against 32-key
    # segments' 0.615 / 0.692.
    attn_segment: int = 64
    # Positions per KV page (workbench/state/layout.py): a multiple of attn_segment, so a page
    # holds whole segments and a row's reduction visits the same blocks in the same order
    # wherever its pages lie. 256 by default: the layout's default, the torch path's page (its
    # attention block), so both runners' page counts and prefix-cache pages agree; it divides
    # Gemma 3's 512-token window. Smaller pages (64, 128) waste less of a sequence's last page
    # and make runner tests cross pages in short prompts.
    page_size: int = 256
    # The KV pool's dtype (None: the engine's). A bfloat16 pool costs ~0.4% logit error against
    # a float32 one (session 1: 4e-3 relative vs 2e-6 against the torch reference).
    kv_dtype: str | None = None
    # Programmatic dependent launch on sm_90+ (kernels/pdl.py): each kernel's launch overlaps its
    # predecessor's work; ordering, hence every bit, unchanged. Session 4, run 16: 0.866 / 0.983
    # ms per step at 1 / 16 slots against 1.060 / 1.158 without. Off: for A/B runs.
    pdl: bool = True
    # -- same bits: folds that won, each off for its bitwise test or an A/B run ----------------
    # The attention combine folded into the partial kernel (its last program per row merges);
    # the runner takes two launches anyway above ATTN_COUNTER_ROWS rows. Session 3, run 9: 0.994
    # -> 0.983 ms at 1 slot, 1.182 -> 1.169 at 16.
    fuse_combine: bool = True
    # The GLU folded into the gate|up product (its last program per column pair); the separate
    # kernel where the fold's counters do not fit. Session 4, run 14: -19 / -15 / -8 / -10 us at
    # 1 / 4 / 16 / 32 slots; session 9, run 46: the same step time as the separate kernel.
    fuse_glu: bool = True
    # A q|k|v whose members take two forms (Q5_0 q|k on tensor cores, Q8_0 V on the GEMV) as one
    # launch. Session 7, run 36: 0.693 / 0.791 -> 0.675 / 0.772 ms at 1 / 16 slots, exact.
    pair_launch: bool = True
    # QK-norm + rope + the KV write as the attention programs' prologue in graphed decode steps
    # (prefill and mixed steps keep the separate kernel, which must and does give the same bits);
    # needs fuse_combine. Session 10, runs 54-56: 0.588 / 0.644 / 0.821 -> 0.574 / 0.628 / 0.798
    # ms at 1 / 16 / 32 slots (at attention's 8 warps); exact vs solo.
    rope_in_attention: bool = True
    # A decode graph's greedy argmax kept by the head's streaming programs (up to a bucket of
    # triton_layers.ARGMAX_IN_HEAD_FORMS rows per head form), finished by one small launch; the
    # same tokens. Session 10, run 50: 0.668 -> 0.659 ms at 16 slots, 0.843 -> 0.829 at 32.
    argmax_in_head: bool = True
    # decode_loop's in-graph token record per row (positions modulo this many), so replays run
    # back to back and the tokens are gathered once per this many steps. Session 11, run 61
    # against a copy after each replay (removed): 0.567 / 0.582 / 0.619 / 0.777 vs 0.568 / 0.584
    # / 0.625 / 0.782 ms per step.
    graph_history: int = 1024
    # With graphs on, prefill chunks and mixed steps of up to this many rows (in at most 64
    # segments) replay a CUDA graph too, rows padded to a bucket of CHUNK_BUCKETS (0: eager).
    # Such a forward is bound by its ~150 launches (session 14, run 73: a 64-row chunk 11-18 ms
    # eager against 1.07 ms of device time). Session 15, run 74, with a 2,048-token prefix
    # cached: TTFT 3 / 9-10 ms at 1 / 4 requests against 20-22 / 11-19 ms eager (cold 48 ms);
    # above 512 rows the device time covers the launches.
    chunk_graph_rows: int = 512
    # The first speculative verify (every row scored) at an attention-segment bucket captures
    # the chunk graphs of every verify row count at that bucket at once (triton_graphs: "verify
    # families"), not one by one as an adaptive draft length meets them. Predicted from H200
    # run 84 (essays, 16 slots: 1-6 captures of ~40 ms inside each timed pass, 0.85-0.92x plain
    # decoding at a draft yield of 4.4-6.9); to be measured on and off (docs/GPU_NOTES.md).
    verify_graph_family: bool = True
    # Attention rows that run together (a speculative verify's rows of one slot, a prefill
    # chunk's) computed a run at a time: each K/V block read once per 4 rows (Gemma 3's 4 query
    # heads a kv head fill the products' 16-row tile that one row's heads pad) instead of once a
    # row. The same bits either way (kernels/attention.attention_run_item). Decode steps (one
    # row a slot, the rope prologue's form) are unchanged. Off: H100 runs 101 / 104 (session 29,
    # 16 slots at 512 / 2048 positions) 2.307 -> 2.157 / 2.623 -> 2.355 ms at 8 verify rows a
    # slot, but 2-5% slower at 2-5 rows a slot, where the guard's verifies mostly are.
    attention_runs: bool = False

    def __post_init__(self):
        if not (isinstance(self.graphs, bool) or self.graphs == "emulate"):
            _fail(f"graphs={self.graphs!r} is not allowed: allowed True, False, 'emulate'")
        if self.head_matmul is not None:
            _choice("head_matmul", self.head_matmul, HEAD_MATMULS, none=True)
        _choice("products", self.products, PRODUCTS)
        if self.kv_dtype is not None:
            _choice("kv_dtype", self.kv_dtype, KV_DTYPES, none=True)
        seg = self.attn_segment
        if isinstance(seg, bool) or not isinstance(seg, int) or seg not in ATTN_SEGMENTS:
            _fail(f"attn_segment={self.attn_segment!r} is not allowed: allowed {', '.join(map(str, ATTN_SEGMENTS))}")
        P = self.page_size
        if isinstance(P, bool) or not isinstance(P, int) or not 1 <= P <= 4096 or P % seg:
            _fail(f"page_size={P!r} is not allowed: allowed multiples of attn_segment={seg} up to 4096")
        for name in ("pdl", "fuse_combine", "fuse_glu", "pair_launch", "rope_in_attention", "argmax_in_head",
                     "verify_graph_family", "attention_runs"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name}={getattr(self, name)!r} is not allowed: allowed True, False")
        r = self.chunk_graph_rows
        if isinstance(r, bool) or r not in (0,) + CHUNK_BUCKETS:
            _fail(f"chunk_graph_rows={r!r} is not allowed: allowed 0 (off) or one of {', '.join(map(str, CHUNK_BUCKETS))}")
        h = self.graph_history
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= 1 << 16:
            _fail(f"graph_history={h!r} is out of range: allowed 1..65536")
        object.__setattr__(self, "layer_forms", _forms(self.layer_forms))

    @property
    def forms(self) -> dict[str, str]:
        """``layer_forms`` as a dict (format -> form; formats not named take "mma")."""
        return dict(self.layer_forms)

    def changed(self) -> list[str]:
        """The names of the fields that differ from the defaults."""
        base = TritonOptions()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_forms"] = self.forms
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TritonOptions":
        refuse_unknown_keys(cls, d, "triton", noun="option")
        return cls(**dict(d))

    @classmethod
    def parse(cls, text: str) -> "TritonOptions":
        """Options from ``"name=value,name=value"`` (scripts/gpu_run.sh's WB_OPTIONS, a command
        line): booleans true/false (1/0, yes/no, on/off), integers, ``none``, graphs ``emulate``,
        layer_forms as ``Q8_0:gemv+Q4_K:mma`` (empty: every format on tensor cores). Each value
        is checked by the constructor. (Written here: a dozen typed fields in one shell word,
        which argparse does not parse.)"""
        kinds = {f.name: f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for name, raw in name_values(text, "triton option", "head_matmul=dense,pdl=false"):
            if name not in kinds:
                _fail(f"unknown triton option {name!r}; valid options: {', '.join(kinds)}")
            out[name] = _parse_value(name, raw)
        return cls(**out)


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _parse_value(name: str, raw: str) -> Any:
    low = raw.lower()
    if name == "layer_forms":
        pairs = [p.split(":", 1) for p in filter(None, raw.split("+"))]
        if any(len(p) != 2 for p in pairs):
            _fail(f"layer_forms={raw!r} is not FORMAT:FORM pairs joined by '+': e.g. 'Q8_0:gemv+Q4_K:mma'")
        return tuple((k.strip(), v.strip()) for k, v in pairs)
    if name == "graphs":
        return raw if low == "emulate" else _BOOLS.get(low, raw)
    if name in ("head_matmul", "kv_dtype"):
        return None if low in ("none", "") else raw
    if name in ("attn_segment", "graph_history", "page_size", "chunk_graph_rows"):
        try:
            return int(raw)
        except ValueError:
            return raw  # (the constructor names the allowed values)
    if name == "products":
        return raw
    return _BOOLS.get(low, raw)


def _forms(value: Any) -> tuple[tuple[str, str], ...]:
    """layer_forms as sorted (format, form) pairs, checked."""
    try:
        items = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        items = None
    if items is None or any(len(p) != 2 for p in items):
        _fail(f"layer_forms={value!r} is not a mapping of format -> form: e.g. {{'Q8_0': 'gemv'}}")
    for fmt, form in items:
        if fmt not in FORMATS:
            _fail(f"layer_forms: format {fmt!r} is not allowed: allowed {', '.join(FORMATS)}")
        if form not in LAYER_FORMS:
            _fail(f"layer_forms[{fmt!r}]={form!r} is not allowed: allowed {', '.join(LAYER_FORMS)}")
    if len({fmt for fmt, _ in items}) != len(items):
        _fail(f"layer_forms={value!r} names a format twice")
    return tuple(sorted((str(f), str(v)) for f, v in items))


def _choice(name: str, value: Any, allowed: tuple, none: bool = False) -> None:
    if value not in allowed:
        _fail(f"{name}={value!r} is not allowed: allowed {', '.join(allowed)}" + (" or None" if none else ""))


def _fail(message: str):
    raise ConfigError(message)
