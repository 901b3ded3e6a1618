"""Time the workbench kernels on a CUDA GPU at Gemma 3 270M shapes; report GB/s.

    python scripts/bench_kernels_gpu.py [--peak-gbs 4800] [--json out.jsonl]
    python scripts/bench_kernels_gpu.py --qmatmul-study OUTDIR   # qmatmul paths only (see below)

Each call is timed twice, as a median: with triton.testing.do_bench ("wall": what a Python caller
sees, launch overhead included) and with triton.testing.do_bench_cudagraph ("device": replayed
from a CUDA graph, as an engine step would run). GB/s comes from a bytes formula (what the
kernel must read and write at least) over the device time, and "floor" is that as a fraction of
--peak-gbs.
The head matmul (Q8_0 262144 x 640) is also compared with non-invariant alternatives (cuBLAS on
weights dequantized to bf16 and to f32), each checked for batch invariance: is row 0 of the
M-row product bitwise the 1-row product?
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.testing
from graph_timing import graph_replay_us  # (scripts/, the script's own folder)
from workbench.kernels.attention import decode_attention
from workbench.kernels.embedding import embedding
from workbench.kernels.geglu import geglu
from workbench.kernels.norm import rmsnorm, rmsnorm_heads
from workbench.kernels.qmatmul import pack_weights, qmatmul
from workbench.kernels.quant_tiles import FORMATS, dequant_ref
from workbench.kernels.rope import rope, rope_inv_freq
from workbench.kernels.sampling import argmax

# Gemma 3 270M
HIDDEN, N_HEAD, N_HEAD_KV, HEAD_DIM, FFN, VOCAB, WINDOW = 640, 4, 1, 256, 2048, 262144, 512
BATCHES = (1, 4, 16)
# (name, qtype, N, K): the quantized matmuls of one layer, and the head
MATMULS = (
    ("attn_q", "Q5_0", N_HEAD * HEAD_DIM, HIDDEN),
    ("attn_k", "Q5_0", N_HEAD_KV * HEAD_DIM, HIDDEN),
    ("attn_v", "Q8_0", N_HEAD_KV * HEAD_DIM, HIDDEN),
    ("attn_output", "Q4_K", HIDDEN, N_HEAD * HEAD_DIM),
    ("ffn_gate", "Q5_0", FFN, HIDDEN),
    ("ffn_down", "Q6_K", HIDDEN, FFN),
    ("head", "Q8_0", VOCAB, HIDDEN),
)
_F16_FIELDS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_quant_rows(qtype: str, n: int, k: int, device: str) -> torch.Tensor:
    """Random GGUF rows: random quant bytes, f16 scale fields set to small finite values."""
    fmt = FORMATS[qtype]
    num_blocks = k // fmt.block_size
    raw = torch.randint(0, 256, (n, num_blocks, fmt.type_size), dtype=torch.uint8, device=device)
    for off in _F16_FIELDS[qtype]:
        d = (torch.rand(n, num_blocks, device=device) * 0.015 + 0.005).to(torch.float16)
        raw[:, :, off : off + 2] = d.view(torch.uint8).reshape(n, num_blocks, 2)
    return raw.reshape(n, -1)


def record(rows: list[dict], peak_gbs: float, kernel: str, shape: str, m: int, fn, nbytes: int, **extra) -> None:
    """Time fn both ways, append one tidy record, print one line."""
    fn()  # compile outside the timings
    wall_ms = triton.testing.do_bench(fn, return_mode="median")
    device_ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
    gbs = nbytes / device_ms / 1e6
    rows.append(dict(kernel=kernel, shape=shape, m=m, wall_ms=wall_ms, device_ms=device_ms, bytes=nbytes,
                     gbs=gbs, floor=gbs / peak_gbs, **extra))
    tail = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{kernel:<22} {shape:<24} M={m:<3} wall {wall_ms * 1e3:8.1f} us  device {device_ms * 1e3:8.1f} us "
          f"{gbs:7.0f} GB/s {100 * gbs / peak_gbs:5.1f}% {tail}", flush=True)


def bench_matmuls(rows, peak):
    for name, qtype, n, k in MATMULS:
        raw = random_quant_rows(qtype, n, k, "cuda")
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda")
            out = torch.empty(m, n, device="cuda")
            record(rows, peak, f"qmatmul {qtype}", f"{name} {n}x{k}", m, lambda: qmatmul(x, raw, qtype, n, k, out=out),
                   raw.numel() + x.numel() * 4 + out.numel() * 4)
            pw = pack_weights(raw, qtype, n, k)
            record(rows, peak, f"qmatmul packed {qtype}", f"{name} {n}x{k}", m, lambda: qmatmul(x, pw, out=out),
                   pw.nbytes + x.numel() * 4 + out.numel() * 4)


def bench_head_variants(rows, peak):
    """Batch-invariant qmatmul vs cuBLAS on dequantized weights, for the head."""
    n, k = VOCAB, HIDDEN
    raw = random_quant_rows("Q8_0", n, k, "cuda")
    w32 = dequant_ref(raw.cpu(), "Q8_0", k).cuda()
    w16 = w32.to(torch.bfloat16)
    pw = pack_weights(raw, "Q8_0", n, k)
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda")
        variants = {
            "qmatmul Q8_0 (inv.)": (lambda x=x: qmatmul(x, raw, "Q8_0", n, k), raw.numel()),
            "qmatmul packed Q8_0 (inv.)": (lambda x=x: qmatmul(x, pw), pw.nbytes),
            "cuBLAS bf16 W": (lambda x=x: x.to(torch.bfloat16) @ w16.T, w16.numel() * 2),
            "cuBLAS f32 W": (lambda x=x: x @ w32.T, w32.numel() * 4),
        }
        for label, (fn, wbytes) in variants.items():
            invariant = bool(torch.equal(fn(x)[:1], fn(x[:1].clone())))
            record(rows, peak, label, f"head {n}x{k}", m, fn, wbytes + m * (k + n) * 4, invariant=invariant)


def bench_small_ops(rows, peak):
    table = random_quant_rows("Q8_0", VOCAB, HIDDEN, "cuda")
    for m in BATCHES:
        x = torch.randn(m, HIDDEN, device="cuda")
        w = torch.randn(HIDDEN, device="cuda")
        record(rows, peak, "rmsnorm", f"{m}x{HIDDEN}", m, lambda: rmsnorm(x, w, 1e-6), (2 * x.numel() + w.numel()) * 4)
        qh = torch.randn(m, N_HEAD, HEAD_DIM, device="cuda")
        wh = torch.randn(HEAD_DIM, device="cuda")
        record(rows, peak, "rmsnorm_heads", f"{m}x{N_HEAD}x{HEAD_DIM}", m, lambda: rmsnorm_heads(qh, wh, 1e-6), 2 * qh.numel() * 4)
        pos = torch.randint(0, 32768, (m,), device="cuda")
        inv_freq = rope_inv_freq(HEAD_DIM, 1e6, "cuda")  # once per model, as an engine would
        record(rows, peak, "rope", f"{m}x{N_HEAD}x{HEAD_DIM}", m, lambda: rope(qh, pos, 1e6, inv_freq=inv_freq), 2 * qh.numel() * 4)
        g, u = torch.randn(m, FFN, device="cuda"), torch.randn(m, FFN, device="cuda")
        record(rows, peak, "geglu", f"{m}x{FFN}", m, lambda: geglu(g, u), 3 * g.numel() * 4)
        ids = torch.randint(0, VOCAB, (m,), device="cuda")
        record(rows, peak, "embedding Q8_0", f"{m}x{HIDDEN}", m,
               lambda: embedding(ids, table, HIDDEN, math.sqrt(HIDDEN)), m * table.shape[1] + m * HIDDEN * 4)
        logits = torch.randn(m, VOCAB, device="cuda")
        record(rows, peak, "argmax", f"{m}x{VOCAB}", m, lambda: argmax(logits), logits.numel() * 4)


def bench_attention(rows, peak):
    for context, window in ((WINDOW, WINDOW), (4096, 0), (32768, 0)):
        for m in BATCHES:
            q = torch.randn(m, N_HEAD, HEAD_DIM, device="cuda")
            k = torch.randn(m, context, N_HEAD_KV, HEAD_DIM, device="cuda")
            v = torch.randn_like(k)
            lens = torch.full((m,), context, device="cuda")
            win = torch.full((m,), window, device="cuda")
            keys = min(context, window) if window else context
            nbytes = 2 * m * keys * N_HEAD_KV * HEAD_DIM * 4 + 2 * q.numel() * 4
            record(rows, peak, "decode_attention f32", f"ctx {context} win {window}", m,
                   lambda: decode_attention(q, k, v, lens, win, HEAD_DIM**-0.5), nbytes)


# ---- qmatmul study: raw path (tl.dot tf32x3) vs packed path (FMA) vs cuBLAS bf16 ----------------
#
# Small products take a few microseconds, less than a Python launch, so every time here is a
# CUDA-graph replay (as the runner's decode step runs): a graph of several launches over DISTINCT
# weight copies (no L2 reuse between them), per-launch time = replay time / launches, median of
# replays. GB/s = (weight bytes + x read + outputs written) / time.

STUDY_M = (1, 4, 16)
DEV = "cuda"  # "cpu" (+ TRITON_INTERPRET=1) only for the tiny dry run: STUDY_TINY=1
HEAD_CHECK_ROWS = 8192
COPIES = 6  # distinct weight copies per kernel-table graph
PREFILL_M = 256  # rows of the prefill-chunk measurement
HEAD = ("head", "Q8_0", VOCAB, HIDDEN)
# The runner's quantized launches of one decode step (same-format projections fused), Gemma 3
# 270M Q4_K_M: 9 layers with V Q8_0 + down Q6_K and 9 with V Q5_0 + down Q4_K (68.1 MB of layer
# weights), then the head: 82 launches.
STEP_LAYERS = (
    (9, (("qk", "Q5_0", 1280, 640), ("v", "Q8_0", 256, 640), ("o", "Q4_K", 640, 1024),
         ("gate_up", "Q5_0", 4096, 640), ("down", "Q6_K", 640, 2048))),
    (9, (("qkv", "Q5_0", 1536, 640), ("o", "Q4_K", 640, 1024), ("gate_up", "Q5_0", 4096, 640),
         ("down", "Q4_K", 640, 2048))),
)
# the per-kernel table (unfused projections, as listed in the task)
KERNEL_SHAPES = (
    ("attn_q", "Q5_0", 1024, 640), ("attn_k", "Q5_0", 256, 640), ("attn_v", "Q8_0", 256, 640),
    ("attn_v", "Q5_0", 256, 640), ("attn_output", "Q4_K", 640, 1024), ("ffn_gate|up", "Q5_0", 2048, 640),
    ("ffn_down", "Q6_K", 640, 2048), ("ffn_down", "Q4_K", 640, 2048), HEAD,
)


def _candidates():
    """(narrow, wide) packed-path configs to sweep: block_n, block_k, m_tile, warps, stages, late, branch."""
    from workbench.kernels.qmatmul import GemvConfig as C

    from workbench.kernels.qmatmul import QGEMV_CONFIGS, QGEMV_WIDE_CONFIGS

    if os.environ.get("STUDY_FINAL"):  # only the configurations in the tables (no sweep choice)
        return list(QGEMV_CONFIGS.values()), [QGEMV_WIDE_CONFIGS["Q8_0"]]
    # (run 2 of docs/GPU_NOTES.md also swept a branch-free row form, since removed)
    narrow = [C(16, 128, 8, 4), C(16, 128, 8, 4, 1, True), C(16, 256, 8, 8), C(16, 256, 8, 8, 1, True),
              C(32, 128, 4, 4), C(32, 128, 4, 4, 1, True), C(32, 128, 8, 4, 1, True), C(64, 128, 8, 8, 1, True),
              C(16, 256, 8, 4, 1, True)]
    wide = [C(16, 128, 8, 4, 3), C(16, 128, 8, 4, 3, True), C(64, 128, 8, 8, 3, True), C(32, 128, 8, 4, 3, True),
            C(32, 256, 8, 8, 2, True), C(128, 128, 8, 8, 2, True), C(16, 256, 8, 4, 2, True)]
    return narrow, wide


def _cfg_name(c) -> str:
    return (f"bn{c.block_n}/bk{c.block_k}/mt{c.m_tile}/w{c.num_warps}/s{c.num_stages}"
            f"{'/late' if c.late_reduce else ''}")


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _graph_us(fn, replays: int = 12) -> float:
    """Median microseconds of one replay of a CUDA graph of fn (fn warmed up first)."""
    import time

    if DEV != "cuda":  # dry run: no graphs, one timed call after a warm-up
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    ts = graph_replay_us(fn, replays)
    return ts[len(ts) // 2]


def _tiny_study() -> None:
    """Shrink the study for a CPU dry run under the interpreter (checks the script, times nothing)."""
    global DEV, HEAD, HEAD_CHECK_ROWS, STEP_LAYERS, KERNEL_SHAPES, COPIES, PREFILL_M, _candidates
    from workbench.kernels import qmatmul as qm
    from workbench.kernels.qmatmul import GemvConfig as C

    DEV = "cpu"
    qm.QMATMUL_SPLIT_MAX_N = 256
    HEAD, HEAD_CHECK_ROWS, COPIES, PREFILL_M = ("head", "Q8_0", 320, 64), 64, 2, 9
    STEP_LAYERS = ((1, (("qk", "Q5_0", 40, 640), ("v", "Q8_0", 24, 640), ("o", "Q4_K", 24, 1024))),
                   (1, (("down", "Q6_K", 24, 512), ("down", "Q4_K", 24, 512))))
    KERNEL_SHAPES = (("attn_k", "Q5_0", 24, 640), ("ffn_down", "Q6_K", 24, 512), HEAD)
    _candidates = lambda: ([C(32, 128, 8, 4), C(16, 64, 4, 4, 1, True)],  # noqa: E731
                           [C(32, 128, 8, 4, 2, True), C(16, 64, 8, 4)])


def _raw_launch(x, raw, qtype, n, k, part, splits, k_slice):
    """The raw path's kernel as the runner launches it (partials [splits, M, N] of slices of
    ``k_slice`` weights, no sum)."""
    from workbench.kernels import qmatmul as qm

    fmt = FORMATS[qtype]
    cfg = qm.QMATMUL_CONFIGS[qtype]
    M = x.shape[0]
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    qm._qmatmul_kernel[grid](
        x, raw, part, M, n, k, k_slice if splits > 1 else k, x.stride(0), part.stride(1), part.stride(0),
        raw.stride(0), QTYPE=fmt.code, SUB=fmt.sub, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        INPUT_PRECISION=qm.QMATMUL_INPUT_PRECISION, USE_DOT=DEV == "cuda", num_warps=cfg.num_warps,
        **qm.launch_kw(x))


def _ordered_sum(part):
    y = part[0].clone()
    for sp in range(1, part.shape[0]):
        y += part[sp]
    return y


class _W:
    """One random GGUF weight on the device: raw bytes, packed planes, optionally f32 and bf16."""

    def __init__(self, qtype, n, k, ref=False, dense=False):
        from workbench.kernels import qmatmul as qm

        self.qtype, self.n, self.k = qtype, n, k
        self.raw = random_quant_rows(qtype, n, k, DEV)
        # slices of QMATMUL_SPLIT_K (256), those the swept configs (K steps up to 256) were chosen at
        self.k_slice = qm.QMATMUL_SPLIT_K if n <= qm.QMATMUL_SPLIT_MAX_N else k
        self.pw = pack_weights(self.raw, qtype, n, k, k_split=self.k_slice)
        self.splits = triton.cdiv(k, self.k_slice)
        self.w32 = dequant_ref(self.raw.cpu(), qtype, k).to(DEV) if ref else None
        self.w16 = None
        if dense:  # cuBLAS operand: the dequantized weights in bf16
            self.w16 = (self.w32 if ref else dequant_ref(self.raw.cpu(), qtype, k).to(DEV)).to(torch.bfloat16)

    def part(self, m):
        return torch.full((self.splits, m, self.n), float("nan"), device=DEV)


def _check_packed(w: _W, cfg) -> dict:
    """Accuracy vs float64, all outputs written, and bitwise rows (M=16 vs 1- and 4-row calls)."""
    from workbench.kernels.qmatmul import launch_qgemv

    x = torch.randn(16, w.k, device=DEV)
    p16 = w.part(16)
    launch_qgemv(x, w.pw, p16, w.splits, p16.stride(0), cfg)
    y = _ordered_sum(p16)
    ref = x.double() @ w.w32.double().T
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    bitwise = True
    for r in (0, 5, 8, 15):
        p1 = w.part(1)
        launch_qgemv(x[r : r + 1].clone(), w.pw, p1, w.splits, p1.stride(0), cfg)
        bitwise &= bool(torch.equal(p1[:, 0], p16[:, r]))
    p4 = w.part(4)
    launch_qgemv(x[6:10], w.pw, p4, w.splits, p4.stride(0), cfg)
    bitwise &= bool(torch.equal(p4, p16[:, 6:10]))
    _sync()
    return {"rel_err": rel, "written": bool(torch.isfinite(p16).all()), "bitwise_rows": bitwise}


def _gbs(nbytes, us):
    return nbytes / us / 1e3


def qmatmul_study(out_dir: str, wait_for: str | None = None) -> int:  # noqa: PLR0915 (one linear script)
    import time
    from pathlib import Path

    from workbench.kernels import qmatmul as qm
    from workbench.kernels.qmatmul import launch_qgemv

    if os.environ.get("STUDY_TINY"):
        _tiny_study()
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__,
                 "triton": triton.__version__, "timing": "CUDA-graph replay, median; per launch", "checks": [],
                 "sweep": [], "kernels": [], "step": []}

    def dump():
        res["elapsed_s"] = round(time.time() - t0, 1)
        (out / "qmatmul_h200.json").write_text(json.dumps(res, indent=1, default=str))

    def log(msg):
        print(f"{msg} ({time.time() - t0:.0f} s)", flush=True)

    torch.manual_seed(0)
    narrow, wide = _candidates()
    hv, hk = HEAD[2], HEAD[3]
    # one decode step's weights: distinct per layer
    layers = [[(label, q, n, k, _W(q, n, k)) for label, q, n, k in launches]
              for count, launches in STEP_LAYERS for _ in range(count)]
    head = _W("Q8_0", hv, hk, dense=True)
    refw = {}  # one reference-checked weight per (format, N, K) of the step
    for L in layers:
        for _, q, n, k, _w in L:
            refw.setdefault((q, n, k), _W(q, n, k, ref=True))
    head_part = _W.__new__(_W)
    head_part.__dict__.update(qtype="Q8_0", n=HEAD_CHECK_ROWS, k=hk, raw=head.raw[:HEAD_CHECK_ROWS], splits=1,
                              w32=dequant_ref(head.raw[:HEAD_CHECK_ROWS].cpu(), "Q8_0", hk).to(DEV),
                              pw=pack_weights(head.raw[:HEAD_CHECK_ROWS], "Q8_0", HEAD_CHECK_ROWS, hk))
    log("weights ready")

    # compile and check every candidate: accuracy, all outputs written, bitwise rows
    ok = {}

    def check(w, cfg, key, shape):
        try:
            c = _check_packed(w, cfg)
        except Exception as e:  # noqa: BLE001 (a config that fails to compile is dropped, not fatal)
            c = {"rel_err": float("nan"), "written": False, "bitwise_rows": False, "error": repr(e)[:300]}
        res["checks"].append({"config": _cfg_name(cfg), "shape": shape, **c})
        ok[(_cfg_name(cfg), key)] = c["written"] and c["bitwise_rows"] and c["rel_err"] < 1e-5  # noqa: PLR2004

    for cfg in narrow:
        for key, w in refw.items():
            check(w, cfg, key, f"{key[0]} {key[1]}x{key[2]}")
    for cfg in wide:  # the head's launch is unsplit: checked on its first rows with k_split = K
        check(head_part, cfg, "head", f"head[:{HEAD_CHECK_ROWS}] Q8_0")
    bad = [c for c in res["checks"] if not (c["written"] and c["bitwise_rows"] and c["rel_err"] < 1e-5)]  # noqa: PLR2004
    log(f"compiled and checked {len(res['checks'])} (config, shape) pairs, {len(bad)} failed")
    for c in bad:
        print("  CHECK FAILED", c, flush=True)
    dump()

    if wait_for:  # the native test run shares the GPU: time nothing before it is done
        while not os.path.exists(wait_for):
            time.sleep(0.5)
        log("tests done, timing")

    n1 = 1 << (28 if DEV == "cuda" else 16)  # copy bandwidth: 1 GiB f32 device-to-device, read + write
    src, dst = torch.rand(n1, device=DEV), torch.empty(n1, device=DEV)
    res["copy_gbs"] = _gbs(2 * 4 * n1, _graph_us(lambda: dst.copy_(src), 10))
    if DEV == "cuda":  # (run 1 measured with do_bench: 4225 GB/s; run 2 in a graph: 2689)
        res["copy_gbs_do_bench"] = _gbs(2 * 4 * n1, 1e3 * triton.testing.do_bench(
            lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median"))
        log(f"copy bandwidth (do_bench) {res['copy_gbs_do_bench']:.0f} GB/s")
    src = dst = None
    log(f"copy bandwidth {res['copy_gbs']:.0f} GB/s")

    ks = {k for *_, k in KERNEL_SHAPES} | {k for L in layers for *_, k, _w in L}
    xs = {(m, k): torch.randn(m, k, device=DEV) for m in STUDY_M for k in ks}

    # sweep: per format, all of the step's launches of that format in one graph
    by_fmt: dict = {}
    for L in layers:
        for _, q, n, k, w in L:
            by_fmt.setdefault(q, []).append(w)
    chosen, best = {}, {}
    for q, ws in by_fmt.items():
        for cfg in narrow:
            if not all(v for (cn, key), v in ok.items() if cn == _cfg_name(cfg) and key != "head" and key[0] == q):
                continue
            total = 0.0
            for m in STUDY_M:
                parts = [w.part(m) for w in ws]

                def fn(ws=ws, parts=parts, m=m, cfg=cfg):
                    for w, p in zip(ws, parts, strict=True):
                        launch_qgemv(xs[(m, w.k)], w.pw, p, w.splits, p.stride(0), cfg)

                us = _graph_us(fn)
                nbytes = sum(w.pw.nbytes + m * w.k * 4 + p.numel() * 4 for w, p in zip(ws, parts, strict=True))
                res["sweep"].append({"format": q, "launches": len(ws), "config": _cfg_name(cfg), "m": m, "us": us,
                                     "gbs": _gbs(nbytes, us)})
                total += us
            if total < best.get(q, 1e30):
                best[q], chosen[q] = total, cfg
        log(f"sweep {q}: {len(ws)} launches, best {_cfg_name(chosen[q]) if q in chosen else None}")
    for cfg in wide:
        if not ok[(_cfg_name(cfg), "head")]:
            continue
        total = 0.0
        for m in STUDY_M:
            x, part = xs[(m, hk)], head.part(m)
            us = _graph_us(lambda x=x, part=part, cfg=cfg: launch_qgemv(x, head.pw, part, 1, 0, cfg))
            res["sweep"].append({"format": "head", "launches": 1, "config": _cfg_name(cfg), "m": m, "us": us,
                                 "gbs": _gbs(head.pw.nbytes + x.numel() * 4 + part.numel() * 4, us)})
            total += us
        if total < best.get("head", 1e30):
            best["head"], chosen["head"] = total, cfg
    if os.environ.get("STUDY_FINAL"):
        chosen = dict(qm.QGEMV_CONFIGS) | {"head": qm.QGEMV_WIDE_CONFIGS["Q8_0"]}
    for q in FORMATS:
        chosen.setdefault(q, qm.QGEMV_CONFIGS[q])
    chosen.setdefault("head", qm.QGEMV_WIDE_CONFIGS["Q8_0"])
    res["chosen"] = {q: _cfg_name(c) for q, c in chosen.items()}
    log(f"sweep done; chosen {res['chosen']}")
    dump()

    # per-kernel table: COPIES distinct weights per graph (the head: one), per launch
    for label, q, n, k in KERNEL_SHAPES:
        is_head = label == "head"
        ws = [head] if is_head else [_W(q, n, k, dense=True) for _ in range(COPIES)]
        cfg = chosen["head"] if is_head else chosen[q]
        for m in STUDY_M:
            x = xs[(m, k)]
            xb = x.to(torch.bfloat16)
            parts = [w.part(m) for w in ws]
            outs = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in ws]
            pairs = list(zip(ws, parts, outs, strict=True))
            t_raw = _graph_us(lambda pairs=pairs, x=x: [_raw_launch(x, w.raw, q, n, k, p, w.splits, w.k_slice) for w, p, _o in pairs])
            t_new = _graph_us(lambda pairs=pairs, x=x, cfg=cfg: [launch_qgemv(x, w.pw, p, w.splits, p.stride(0), cfg)
                                                                for w, p, _o in pairs])
            t_cub = _graph_us(lambda pairs=pairs, xb=xb: [torch.mm(xb, w.w16.T, out=o) for w, _p, o in pairs])
            nl = len(ws)
            t_raw, t_new, t_cub = t_raw / nl, t_new / nl, t_cub / nl
            w = ws[0]
            y_bytes = parts[0].numel() * 4
            res["kernels"].append({
                "shape": f"{label} {q} {n}x{k}", "m": m, "config": _cfg_name(cfg), "splits": w.splits,
                "raw_us": t_raw, "packed_us": t_new, "cublas_bf16_us": t_cub,
                "raw_bytes": w.raw.numel(), "packed_bytes": w.pw.nbytes, "bf16_bytes": n * k * 2,
                "raw_gbs": _gbs(w.raw.numel() + x.numel() * 4 + y_bytes, t_raw),
                "packed_gbs": _gbs(w.pw.nbytes + x.numel() * 4 + y_bytes, t_new),
                "cublas_gbs": _gbs(n * k * 2 + m * (k + n) * 2, t_cub)})
            r = res["kernels"][-1]
            print(f"{label:<12} {q} {n:>6}x{k:<5} M={m:<2} raw {t_raw:7.1f}  packed {t_new:7.1f}  cuBLAS {t_cub:7.1f} us"
                  f"   packed {r['packed_gbs']:5.0f} GB/s", flush=True)
    log("kernel table done")
    dump()

    # one decode step's 82 quantized launches (distinct weights per layer), one graph
    dense = [[(torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16) for _l, _q, n, k, _w in L] for L in layers]
    step_bytes = {"raw": sum(w.raw.numel() for L in layers for *_, w in L) + head.raw.numel(),
                  "packed": sum(w.pw.nbytes for L in layers for *_, w in L) + head.pw.nbytes,
                  "cublas_bf16": sum(d.numel() * 2 for D in dense for d in D) + head.w16.numel() * 2}
    nlaunch = sum(len(L) for L in layers) + 1
    for m in STUDY_M:
        xb = {k: xs[(m, k)].to(torch.bfloat16) for k in ks}
        parts = [[w.part(m) for *_, w in L] for L in layers]
        hpart = head.part(m)
        outs = [[torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _l, _q, n, _k, _w in L] for L in layers]
        hout = torch.empty(m, hv, device=DEV, dtype=torch.bfloat16)

        def run_raw(m=m, parts=parts, hpart=hpart):
            for L, P in zip(layers, parts, strict=True):
                for (_l, q, n, k, w), p in zip(L, P, strict=True):
                    _raw_launch(xs[(m, k)], w.raw, q, n, k, p, w.splits, w.k_slice)
            _raw_launch(xs[(m, hk)], head.raw, "Q8_0", hv, hk, hpart, 1, head.k_slice)

        def run_packed(m=m, parts=parts, hpart=hpart):
            for L, P in zip(layers, parts, strict=True):
                for (_l, q, _n, k, w), p in zip(L, P, strict=True):
                    launch_qgemv(xs[(m, k)], w.pw, p, w.splits, p.stride(0), chosen[q])
            launch_qgemv(xs[(m, hk)], head.pw, hpart, 1, 0, chosen["head"])

        def run_cublas(xb=xb, outs=outs, hout=hout):
            for L, D, O in zip(layers, dense, outs, strict=True):
                for (_l, _q, _n, k, _w), d, o in zip(L, D, O, strict=True):
                    torch.mm(xb[k], d.T, out=o)
            torch.mm(xb[hk], head.w16.T, out=hout)

        variants = [("raw", run_raw), ("packed", run_packed), ("cublas_bf16", run_cublas)]
        if m == 1:
            variants.append(("packed", run_packed))  # the same version twice: the spread
        for name, fn in variants:
            us = _graph_us(fn, 20)
            res["step"].append({"variant": name, "m": m, "launches": nlaunch, "us": us, "bytes": step_bytes[name],
                                "gbs": _gbs(step_bytes[name], us)})
            print(f"step matmuls {name:<12} M={m:<2} {us:7.1f} us  {_gbs(step_bytes[name], us):6.0f} GB/s", flush=True)
        # the packed step without the head, and the head alone, for the estimate
        dump()
    log("step done")

    # a prefill chunk: the 81 layer launches (no head) at M = PREFILL_M rows, raw vs packed
    pm = PREFILL_M
    xp = {k: torch.randn(pm, k, device=DEV) for k in ks}
    pparts = [[w.part(pm) for *_, w in L] for L in layers]
    for name in ("raw", "packed"):
        def run_layers(name=name):
            for L, P in zip(layers, pparts, strict=True):
                for (_l, q, n, k, w), p in zip(L, P, strict=True):
                    if name == "raw":
                        _raw_launch(xp[k], w.raw, q, n, k, p, w.splits, w.k_slice)
                    else:
                        launch_qgemv(xp[k], w.pw, p, w.splits, p.stride(0), chosen[q])

        us = _graph_us(run_layers, 5)
        res["step"].append({"variant": f"{name} layers only (prefill chunk)", "m": pm, "launches": nlaunch - 1,
                            "us": us})
        print(f"prefill layers {name:<8} M={pm} {us:9.1f} us", flush=True)
    dump()

    # the short table, last
    print("\n== qmatmul on", res["device"], f"(copy {res['copy_gbs']:.0f} GB/s); chosen configs:", res["chosen"])
    print(f"{'shape (per launch, graph replay)':<32} {'M':>3} {'raw us':>8} {'packed us':>10} {'cuBLAS us':>10} "
          f"{'packed GB/s':>12}")
    for r in res["kernels"]:
        print(f"{r['shape']:<32} {r['m']:>3} {r['raw_us']:8.1f} {r['packed_us']:10.1f} {r['cublas_bf16_us']:10.1f} "
              f"{r['packed_gbs']:12.0f}")
    print(f"decode-step matmuls ({nlaunch} launches, one graph), us raw / packed / cuBLAS bf16 (/ packed again): " + "  ".join(
        f"M={m}: " + " / ".join(f"{r['us']:.0f}" for r in res["step"] if r["m"] == m) for m in STUDY_M))
    fails = len(bad)
    print(f"checks: {len(res['checks']) - fails}/{len(res['checks'])} passed; elapsed {time.time() - t0:.0f} s")
    dump()
    return 0


def qmatmul_parquet(out: str, run_dirs: list[str]) -> int:
    """Tidy rows (run, table, shape, config, m, variant, us, gbs, ...) from qmatmul study JSONs."""
    from pathlib import Path

    import polars as pl

    rows = []
    for d in run_dirs:
        r = json.loads((Path(d) / "qmatmul_h200.json").read_text())
        run = Path(d).name
        timing = r.get("timing", "do_bench median (cold L2, Python launch included) per launch; step: CUDA graph")
        base = {"run": run, "device": r["device"], "torch": r["torch"], "triton": r["triton"], "timing": timing,
                "copy_gbs": r.get("copy_gbs_do_bench", r.get("copy_gbs"))}
        for c in r.get("checks", []):
            rows.append(base | {"table": "check", "shape": c["shape"], "config": c["config"], "rel_err": c["rel_err"],
                                "bitwise_rows": c["bitwise_rows"], "written": c["written"]})
        for s in r.get("sweep", []):
            rows.append(base | {"table": "sweep", "shape": s.get("format", s.get("shape")), "config": s["config"],
                                "m": s["m"], "variant": "packed", "us": s["us"], "gbs": s["gbs"],
                                "launches": s.get("launches", 1)})
        for k in r.get("kernels", []):
            for v, key in (("raw", "raw"), ("packed", "packed"), ("cublas_bf16", "cublas")):
                us = k[f"{v}_us"] if v != "cublas_bf16" else k["cublas_bf16_us"]
                rows.append(base | {"table": "kernel", "shape": k["shape"], "config": k["config"] if v == "packed" else "",
                                    "m": k["m"], "variant": v, "us": us, "gbs": k[f"{key}_gbs"],
                                    "bytes": k.get(f"{v if v != 'cublas_bf16' else 'bf16'}_bytes")})
        for st in r.get("step", []):
            rows.append(base | {"table": "step", "shape": "decode-step matmuls" if "layers" not in st["variant"]
                                else "prefill-chunk layer matmuls", "variant": st["variant"].split(" ")[0], "m": st["m"],
                                "us": st["us"], "gbs": st.get("gbs"), "bytes": st.get("bytes"),
                                "launches": st.get("launches")})
    df = pl.DataFrame(rows, infer_schema_length=None)
    df.write_parquet(out)
    print(f"{out}: {df.height} rows")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="memory bandwidth ceiling, GB/s (H200 datasheet: 4800)")
    ap.add_argument("--json", help="write one JSON record per line here")
    ap.add_argument("--qmatmul-study", metavar="OUTDIR", help="only the qmatmul study (raw vs packed vs cuBLAS)")
    ap.add_argument("--wait-for", metavar="FILE", help="(study) before timing, wait until FILE exists")
    ap.add_argument("--qmatmul-parquet", nargs="+", metavar=("OUT", "RUN_DIR"),
                    help="here (polars): OUT.parquet from the study JSONs of RUN_DIRs, one tidy row per number")
    args = ap.parse_args(argv)
    if args.qmatmul_parquet:
        return qmatmul_parquet(args.qmatmul_parquet[0], args.qmatmul_parquet[1:])
    if args.qmatmul_study and os.environ.get("STUDY_TINY"):  # CPU dry run of the study's code
        return qmatmul_study(args.qmatmul_study, args.wait_for)
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device", file=sys.stderr)
        return 2
    if args.qmatmul_study:
        return qmatmul_study(args.qmatmul_study, args.wait_for)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    rows: list[dict] = []
    bench_matmuls(rows, args.peak_gbs)
    bench_head_variants(rows, args.peak_gbs)
    bench_attention(rows, args.peak_gbs)
    bench_small_ops(rows, args.peak_gbs)
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
