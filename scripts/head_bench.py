"""The output head alone on the GPU: each form and tiling of ``kernels/dense_mma.py`` timed in CUDA
graphs (REPEAT launches per replay, back to back), at 1 / 16 / 32 rows, with the head's input in
float32 (as the runner passes it) or already rounded to the operand precision (the products
round it anyway, so the logits are the same bits, and the kernel reads half the x bytes).

    python3 scripts/head_bench.py --model model.gguf --out DIR      (writes DIR/head_bench.json)

Reads the real head (Gemma 3 270M's tied Q8_0 embedding, 262,144 x 640); x is random, normalized
as the output norm leaves it. One row per (variant, rows): us per launch (median of the replays),
the weight bytes read, GB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import graph_replay_us  # noqa: E402

REPEAT = 10


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded default model)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,32")
    ap.add_argument("--n", type=int, default=0, help="only the first n vocabulary rows (a CPU dry run)")
    ap.add_argument("--forms", default="dense,q8f16,q8bf16,q8i8", help="comma-separated: dense, q8f16, q8bf16, q8i8")
    args = ap.parse_args()
    from workbench.kernels import dense_mma as DM
    from workbench.kernels.qmatmul import pack_weights
    from workbench.model import load_model

    m = load_model(args.model, dtype="bfloat16")
    name = "token_embd.weight" if m.config.tied_output else "output.weight"
    t = m.source.tensors[name]
    N, K = t.shape
    N = args.n or N
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    raw = torch.frombuffer(bytearray(m.source.raw(name)), dtype=torch.uint8).view(t.shape[0], -1)[:N].to(dev)
    pw = pack_weights(raw.contiguous(), "Q8_0", N, K)
    dense = m.head[:N].to(dev).contiguous()
    base = DM.DenseConfig()
    cfgs = {"base": base, "p3": replace(base, programs_per_sm=3), "n128": replace(base, block_n=128),
            "s4": replace(base, num_stages=4), "n128 s4": replace(base, block_n=128, num_stages=4),
            "p3 s4": replace(base, programs_per_sm=3, num_stages=4), "k64 s6 p3": replace(base, block_k=64, num_stages=6,
                                                                                           programs_per_sm=3),
            "n128 k64 s6": replace(base, block_n=128, block_k=64, num_stages=6), "m16": replace(base, block_m=16)}
    forms = set(args.forms.split(","))
    variants = []
    for label, cfg in cfgs.items():
        for xdt in (torch.float32, torch.bfloat16):
            if "dense" in forms:
                variants.append((f"dense bf16 x{str(xdt)[6:]} {label}", DM.dense_mma, dense, "bf16", xdt, cfg, 2 * N * K))
        for xdt in (torch.float32, torch.float16):
            if "q8f16" in forms:
                variants.append((f"q8f16 x{str(xdt)[6:]} {label}", DM.q8_dense_mma, pw, "f16", xdt, cfg, N * K * 34 // 32))
        if label in ("base", "n128") and "q8bf16" in forms:
            variants.append((f"q8 bf16 xbfloat16 {label}", DM.q8_dense_mma, pw, "bf16", torch.bfloat16, cfg, N * K * 34 // 32))
    # q8i8: x quantized per row to Q8_0 blocks (its own launch, timed with the product and without)
    q8 = DM.q8_config(dev)
    i8_cfgs = {"p3": q8, "p2": replace(q8, programs_per_sm=2), "p4": replace(q8, programs_per_sm=4),
               "n128 p2": replace(q8, block_n=128, programs_per_sm=2), "k256": replace(q8, block_k=256),
               "k64 s4": replace(q8, block_k=64, num_stages=4), "s4": replace(q8, num_stages=4),
               "m16": replace(q8, block_m=16), "m16 p4": replace(q8, block_m=16, programs_per_sm=4)}

    def q8i8(x, w, prec, out, config):
        return DM.q8i8_mma(*DM.quantize_rows_q8(x), w, out=out, config=config, batched=prec == "i8b")

    if "q8i8" in forms:
        for label, cfg in i8_cfgs.items():
            variants.append((f"q8i8 {label}", q8i8, pw, "i8", torch.float32, cfg, N * K * 34 // 32))
            variants.append((f"q8i8 product only {label}", lambda x, w, prec, out, config: DM.q8i8_mma(
                *x, w, out=out, config=config), pw, "i8", "pre", cfg, N * K * 34 // 32))
            if cfg.block_k == 128:  # a step's four blocks in one batched dot (DM.I8_BATCHED)
                variants.append((f"q8i8 batched {label}", q8i8, pw, "i8b", torch.float32, cfg, N * K * 34 // 32))
    rows = []
    gen = torch.Generator().manual_seed(0)
    for M in [int(r) for r in args.rows.split(",")]:
        x32 = torch.randn(M, K, generator=gen)
        x32 = (x32 / x32.pow(2).mean(-1, keepdim=True).sqrt()).to(dev)
        out = torch.empty(M, N, device=dev)
        xq = DM.quantize_rows_q8(x32)
        for vname, fn, w, prec, xdt, cfg, nbytes in variants:
            x = xq if xdt == "pre" else x32.to(xdt)  # ("pre": q8i8's product alone, x already quantized)
            try:
                same = None
                if xdt not in (torch.float32, "pre"):  # x pre-rounded: the same logits as from float32 x, bitwise
                    fn(x32, w, prec, out=out, config=cfg)
                    ref = out.clone()
                    fn(x, w, prec, out=out, config=cfg)
                    same = bool(torch.equal(out, ref))
                if dev == "cpu":  # (the dry run: the calls, not their time)
                    fn(x, w, prec, out=out, config=cfg)
                    med = float("nan")
                else:
                    us = graph_replay_us(lambda: [fn(x, w, prec, out=out, config=cfg) for _ in range(REPEAT)], 20, 3)
                    med = us[len(us) // 2] / REPEAT
                row = dict(variant=vname, rows=M, us=med, gbs=nbytes / med / 1e3, weight_bytes=nbytes, same_bits=same)
            except Exception as e:  # noqa: BLE001 (a tiling that does not fit: recorded, the sweep goes on)
                row = dict(variant=vname, rows=M, error=f"{type(e).__name__}: {str(e)[:200]}")
            print(row, flush=True)
            rows.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "head_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
