"""Time the workbench kernels on a CUDA GPU at Gemma 3 270M shapes; report GB/s.

    python scripts/bench_kernels_gpu.py [--peak-gbs 4800] [--json out.jsonl]

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
import sys

import torch
import triton
import triton.testing

from workbench.kernels.attention import decode_attention
from workbench.kernels.embedding import embedding
from workbench.kernels.geglu import geglu
from workbench.kernels.norm import rmsnorm, rmsnorm_heads
from workbench.kernels.qmatmul import qmatmul
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


def bench_head_variants(rows, peak):
    """Batch-invariant qmatmul vs cuBLAS on dequantized weights, for the head."""
    n, k = VOCAB, HIDDEN
    raw = random_quant_rows("Q8_0", n, k, "cuda")
    w32 = dequant_ref(raw.cpu(), "Q8_0", k).cuda()
    w16 = w32.to(torch.bfloat16)
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda")
        variants = {
            "qmatmul Q8_0 (inv.)": (lambda x=x: qmatmul(x, raw, "Q8_0", n, k), raw.numel()),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="memory bandwidth ceiling, GB/s (H200 datasheet: 4800)")
    ap.add_argument("--json", help="write one JSON record per line here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device", file=sys.stderr)
        return 2
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
