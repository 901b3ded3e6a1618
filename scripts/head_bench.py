"""The output head alone on the GPU: each form and tiling of ``kernels/dense_mma.py`` timed in CUDA
graphs (REPEAT launches per replay, back to back), at 1 / 16 / 32 rows: the dense bf16 copy with
its input in float32 (as the runner passes it for a float32 h) or already rounded to bfloat16
(the products round it anyway, so the logits are the same bits, and the kernel reads half the x
bytes), and the int8 form (``q8i8``: x quantized per row to Q8_0 blocks, timed with its
quantization and without).

    python3 scripts/head_bench.py --model model.gguf --out DIR      (writes DIR/head_bench.json)
    python3 scripts/head_bench.py --random --forms q8i8 --configs 'm16 p4,m16 p6 s2,auto' --out DIR

Reads the real head (Gemma 3 270M's tied Q8_0 embedding, 262,144 x 640), or with --random random
planes of that shape (no model: a device call without the model's upload); x is random,
normalized as the output norm leaves it. One row per (variant, rows): us per launch (median of the replays),
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


DENSE_CFGS = "base,p3,n128,s4,n128 s4,p3 s4,k64 s6 p3,n128 k64 s6,m16"  # each relative to DenseConfig()
I8_CFGS = "auto,m16 p4,m32 p3,m16 p2,m16 p6 s2,n128 m16 p2,s4 m16 p4"  # each relative to DenseConfig() (K steps of 128)
FIELDS = {"m": "block_m", "n": "block_n", "k": "block_k", "s": "num_stages", "p": "programs_per_sm", "w": "num_warps"}
FORMS = ("dense", "q8i8")


def config(label: str, base):
    """'m16 p4 s2' -> base with block_m 16, programs_per_sm 4, num_stages 2 ('base': base)."""
    kw = {}
    for tok in label.split():
        if tok != "base":
            if tok[0] not in FIELDS or not tok[1:].isdigit():
                raise ValueError(f"bad config token {tok!r} in {label!r}: allowed base, auto or "
                                 f"{'/'.join(FIELDS)} followed by a number (e.g. 'm16 p4 s2')")
            kw[FIELDS[tok[0]]] = int(tok[1:])
    return replace(base, **kw)


def random_head(N: int, K: int, dev: str):
    """Q8_0 planes of an N x K head with random quants and scales (speed does not depend on the
    values) and its bfloat16 dense copy: no model needed (``--random``)."""
    from workbench.kernels.qmatmul import pack_weights

    gen = torch.Generator().manual_seed(1)
    nb = K // 32
    raw = torch.empty(N, nb, 34, dtype=torch.uint8)
    raw[:, :, 2:] = torch.randint(-127, 128, (N, nb, 32), generator=gen, dtype=torch.int8).view(torch.uint8)
    d = (torch.rand(N, nb, generator=gen) * 0.02 + 0.001).to(torch.float16)
    raw[:, :, :2] = d.view(torch.uint8).view(N, nb, 2)
    pw = pack_weights(raw.view(N, -1).to(dev), "Q8_0", N, K)
    dense = (pw.qs.view(torch.int8).float().view(N, nb, 32) * pw.d.float()[:, :, None]).view(N, K).to(torch.bfloat16)
    return pw, dense.contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded default model)")
    ap.add_argument("--random", action="store_true",
                    help="random Q8_0 planes of Gemma 3 270M's head shape (262,144 x 640) instead of a model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,32")
    ap.add_argument("--n", type=int, default=0, help="only the first n vocabulary rows (a CPU dry run)")
    ap.add_argument("--forms", default="dense,q8i8", help="comma-separated: dense, q8i8")
    ap.add_argument("--best", action="store_true",
                    help="each launch also keeps each row's running argmax (best=, as the runner's argmax_in_head)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated tilings for every form, each relative to the form's base, e.g. "
                         f"'base,m16 p4,m16 p6 s2' (default: dense {DENSE_CFGS!r}; int8 {I8_CFGS!r})")
    args = ap.parse_args()
    from workbench.kernels import dense_mma as DM

    # (the arguments checked before any model is read: one line and exit status 2 where they are bad)
    forms = set(args.forms.split(","))
    bad = forms - set(FORMS)
    if bad:
        ap.error(f"unknown form(s) {', '.join(sorted(bad))}: allowed {', '.join(FORMS)}")
    base = DM.DenseConfig()
    try:
        cfgs = {label: config(label, base) for label in (args.configs or DENSE_CFGS).split(",") if label != "auto"}
        # ('auto': q8i8_mma's default, dense_mma.i8_config's tiles for the launch's rows)
        i8_cfgs = {label: None if label == "auto" else config(label, base)
                   for label in (args.configs or I8_CFGS).split(",")}
    except ValueError as e:
        ap.error(str(e))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.random:
        N, K = args.n or 262144, 640
        pw, dense = random_head(N, K, dev)
    else:
        from workbench.kernels.qmatmul import pack_weights
        from workbench.model import load_model

        m = load_model(args.model, dtype="bfloat16")
        name = "token_embd.weight" if m.config.tied_output else "output.weight"
        t = m.source.tensors[name]
        N, K = t.shape
        N = args.n or N
        raw = torch.frombuffer(bytearray(m.source.raw(name)), dtype=torch.uint8).view(t.shape[0], -1)[:N].to(dev)
        pw = pack_weights(raw.contiguous(), "Q8_0", N, K)
        dense = m.head[:N].to(dev).contiguous()
    variants = []
    for label, cfg in cfgs.items():
        for xdt in (torch.float32, torch.bfloat16):
            if "dense" in forms:
                variants.append((f"dense bf16 x{str(xdt)[6:]} {label}", DM.dense_mma, dense, "bf16", xdt, cfg, 2 * N * K))
    # q8i8: x quantized per row to Q8_0 blocks (its own launch, timed with the product and without)

    def q8i8(x, w, prec, out, config, best=None):
        return DM.q8i8_mma(*DM.quantize_rows_q8(x), w, out=out, config=config, best=best)

    def q8i8_product(x, w, prec, out, config, best=None):
        return DM.q8i8_mma(*x, w, out=out, config=config, best=best)

    if "q8i8" in forms:
        for label, cfg in i8_cfgs.items():
            if cfg is not None and cfg.block_k != 128:  # (the int8 form takes 128-weight K steps)
                continue
            variants.append((f"q8i8 {label}", q8i8, pw, "i8", torch.float32, cfg, N * K * 34 // 32))
            variants.append((f"q8i8 product only {label}", q8i8_product, pw, "i8", "pre", cfg, N * K * 34 // 32))
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
                kw = {}
                if args.best:  # (where the tile holds all M rows: else best_partials is None)
                    kw["best"] = DM.best_partials(M, N, dev, cfg or DM.i8_config(dev, M))
                if xdt not in (torch.float32, "pre"):  # x pre-rounded: the same logits as from float32 x, bitwise
                    fn(x32, w, prec, out=out, config=cfg, **kw)
                    ref = out.clone()
                    fn(x, w, prec, out=out, config=cfg, **kw)
                    same = bool(torch.equal(out, ref))
                if dev == "cpu":  # (the dry run: the calls, not their time)
                    fn(x, w, prec, out=out, config=cfg, **kw)
                    med = float("nan")
                else:
                    us = graph_replay_us(lambda: [fn(x, w, prec, out=out, config=cfg, **kw) for _ in range(REPEAT)], 20, 3)
                    med = us[len(us) // 2] / REPEAT
                vname = vname + (" best" if kw.get("best") is not None else "")
                row = dict(variant=vname, rows=M, us=med, gbs=nbytes / med / 1e3, weight_bytes=nbytes, same_bits=same)
            except Exception as e:  # noqa: BLE001 (a tiling that does not fit: recorded, the sweep goes on)
                row = dict(variant=vname, rows=M, error=f"{type(e).__name__}: {str(e)[:200]}")
            print(row, flush=True)
            rows.append(row)
    # q8i8's default tiles follow M (dense_mma.i8_config): rows of a 32-row launch (32-row tiles) and
    # of a 16-row one against each row alone (16-row tiles), bitwise?
    xs = torch.randn(32, K, generator=gen)
    xs = (xs / xs.pow(2).mean(-1, keepdim=True).sqrt()).to(dev)
    if "q8i8" in forms:
        y32 = DM.q8i8_mma(*DM.quantize_rows_q8(xs), pw)
        y16 = DM.q8i8_mma(*DM.quantize_rows_q8(xs[:16]), pw)
        same = torch.equal(y16, y32[:16]) and all(
            torch.equal(DM.q8i8_mma(*DM.quantize_rows_q8(xs[i : i + 1]), pw), y32[i : i + 1])
            for i in (0, 7, 15, 16, 31))
        row = dict(variant="q8i8 tiles by M: rows of 32 / 16 vs alone", rows=32, same_bits=bool(same))
        print(row, flush=True)
        rows.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "head_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
