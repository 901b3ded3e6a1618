"""QSA decode throughput against dense decode on the Triton runner at long context (issue 22,
item 5): C slots at L positions each, greedy graphed decode steps (`TritonRunner.decode_loop`),
dense and with QSA, one row per (L, C, arm) into a parquet file, with the bandwidth floor of
each arm's step (the bytes it must read: weights, the KV each row reads, the indexer's
summaries).

Timing only. Both arms' pools are prefilled with the same prompts by the dense path (a QSA
prefill scores every prompt row past the boundary against all earlier blocks, per row: at 32K
x 16 slots that is minutes of indexer work, issue 22's next slice); the QSA arm's prefill runs
through a second runner on the same pages whose boundary lies past L, so every row is dense
but the indexer's summaries are written as a QSA prefill writes them. A decode step's work has
the same shapes whatever the KV's values, so the step time is the QSA decode's; its outputs
are not claimed to be a QSA run's (exactness is tests/test_qsa.py's, natively on the device).

    python3 scripts/qsa_decode_bench.py --contexts 4096,16384,32512 --concurrency 1,16 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--shapes", choices=["gemma3-270m"], default=None,
                    help="instead of --model: random weights in the real model's layer shapes (workbench.synthetic)")
    ap.add_argument("--contexts", default="4096,16384,32512")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=512)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--summary", default="mean")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile this many graphed steps per row: device time by kernel into "
                         "qsa_profile.json (where a step's time goes; 0: off)")
    ap.add_argument("--prefill-probe", type=int, default=0, metavar="ROWS",
                    help="in the QSA arm at one slot: time (and with --profile, profile) one eager QSA prefill chunk "
                         "of ROWS rows ending at L, every row past the boundary (where a sparse prefill's time goes)")
    ap.add_argument("--dry-run", action="store_true",
                    help="without a GPU: a tiny random model under the interpreter, emulated graphs (checks the script)")
    a = ap.parse_args(argv)
    if a.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"

    try:
        import polars as pl
    except ImportError:  # a device image without polars: the QSA_BENCH lines of the log are the record
        pl = None
    import torch

    import workbench
    from workbench.atomic import atomic_write_parquet, atomic_write_text
    from workbench.hardware import measure_copy_bandwidth
    from workbench.qsa import MAX_TOP_K, QSAConfig
    from workbench.runners.direct_pages import DirectPages
    from workbench.runners.triton_options import TritonOptions
    from workbench.runners.triton_runner import TritonRunner

    opts = TritonOptions()
    if a.dry_run:
        from workbench.synthetic import SyntheticSpec, write_random_gguf

        a.model = str(write_random_gguf(Path(a.out) / "tiny.gguf", SyntheticSpec(n_layers=1, n_embd=64, n_heads=2,
                                                                              n_kv_heads=1, n_ff=128)))
        opts = TritonOptions(graphs="emulate", page_size=64)
    elif a.shapes:
        from workbench.synthetic import GEMMA3_270M_SHAPES, write_random_gguf

        Path(a.out).mkdir(parents=True, exist_ok=True)
        a.model = str(write_random_gguf(Path(a.out) / "shapes.gguf", GEMMA3_270M_SHAPES))
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    m = workbench.load_model(a.model, dtype="bfloat16" if cuda else "float32")
    c = m.config
    cfg = QSAConfig(block=a.block, top_k=a.top_k, summary=a.summary)
    contexts = [int(x) for x in a.contexts.split(",")]
    slots = [int(x) for x in a.concurrency.split(",")]
    bw = measure_copy_bandwidth("cuda" if cuda else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    profiles = {}

    def profile_into(key: str, run, steps: int) -> None:
        """Profile `run` (`steps` steps) into qsa_profile.json, rewritten whole after each."""
        profiles[key] = _profile(run, steps)
        atomic_write_text(out / "qsa_profile.json", json.dumps(profiles, indent=1))

    weights = None
    g = torch.Generator().manual_seed(0)
    for L in contexts:
        cap = L + a.steps + 8
        for C in slots:
            prompts = [torch.randint(10, c.vocab_size, (L,), generator=g).tolist() for _ in range(C)]
            for arm in ("dense", "qsa"):
                r = TritonRunner(m, cap, opts, weights=weights, qsa=cfg if arm == "qsa" else None)
                weights = r.weights
                pages = DirectPages(r, C * (cap + 256))
                # the prefill: this runner (dense), or one on the same pages with a boundary past L
                pre = r
                if arm == "qsa":
                    pre = TritonRunner(m, cap, opts, weights=weights, qsa=replace(cfg, top_k=MAX_TOP_K))
                    pre.kv, pre.graphs = r.kv, None
                t0 = time.perf_counter()
                first = []
                for sl, p in enumerate(prompts):
                    tok = None
                    for s in range(0, L, 4096):
                        part = p[s : s + 4096]
                        res = pre.run([pages.segment(sl, f"s{sl}", part, s, samples=s + len(part) == L)],
                                      {sl: cap}, argmax=frozenset({sl}))
                        tok = res.get(sl, tok)
                    first.append(int(tok))
                sync()
                prefill_s = time.perf_counter() - t0
                seg = lambda start: [pages.segment(sl, f"s{sl}", (first[sl],), start, reserve=a.steps)  # noqa: E731
                                     for sl in range(C)]
                r.decode_loop(seg(L), 4)  # (captures the graph)
                sync()
                t0 = time.perf_counter()
                toks = r.decode_loop(seg(L), a.steps)
                sync()
                dt = time.perf_counter() - t0
                kv_elem = torch.empty(0, dtype=r.kv_dtype).element_size()
                glob = sum(1 for i in range(c.n_layers) if c.layer_window(i) == 0)
                slide = c.n_layers - glob
                per_pos = 2 * c.n_kv_heads * c.head_dim * kv_elem  # K and V of one position, one layer
                ctx = L + a.steps // 2
                sliding = C * slide * min(ctx, c.sliding_window) * per_pos
                if arm == "dense":
                    kv_bytes = C * glob * ctx * per_pos
                else:
                    nblk = ctx // cfg.block
                    s_n = 1 if cfg.summary == "mean" else 2
                    kv_bytes = C * glob * (nblk * s_n * c.n_kv_heads * c.head_dim * 4
                                           + min(ctx, cfg.dense_positions) * per_pos)
                step_bytes = r.step_weight_bytes + kv_bytes + sliding
                row = dict(arm=arm, context=L, concurrency=C, steps=a.steps, step_ms=1e3 * dt / a.steps,
                           decode_tok_s_aggregate=C * a.steps / dt, decode_tok_s_per_stream=a.steps / dt,
                           prefill_s=prefill_s, step_bytes=step_bytes, weight_bytes=r.step_weight_bytes,
                           kv_read_bytes=kv_bytes + sliding, floor_tok_s=C * bw / step_bytes,
                           fraction_of_floor=(C * a.steps / dt) / (C * bw / step_bytes), copy_bandwidth=bw,
                           qsa=cfg.text() if arm == "qsa" else "off", boundary=cfg.dense_positions,
                           launches=r.launches, tokens_head=toks[:4, 0].tolist(),
                           model=f"random {a.shapes} shapes" if a.shapes else Path(a.model).name)
                if a.profile and cuda:
                    profile_into(f"L={L} C={C} {arm}", lambda: r.decode_loop(seg(L), a.profile), a.profile)
                if a.prefill_probe and arm == "qsa" and C == 1:
                    n = min(a.prefill_probe, L - cfg.dense_positions)
                    chunk = lambda: r.run([pages.segment(0, "s0", prompts[0][L - n:], L - n, samples=True)],  # noqa: E731
                                          {0: cap}, argmax=frozenset({0}))
                    chunk()  # (compiles)
                    sync()
                    t0 = time.perf_counter()
                    chunk()
                    sync()
                    row.update(prefill_probe_rows=n, prefill_probe_ms=1e3 * (time.perf_counter() - t0))
                    print(f"QSA_BENCH L={L} a QSA prefill chunk of {n} rows: {row['prefill_probe_ms']:.1f} ms", flush=True)
                    if a.profile and cuda:
                        profile_into(f"L={L} prefill {n} rows qsa", chunk, 1)
                print("QSA_BENCH", json.dumps(row), flush=True)
                rows.append(row)
                del r, pre, pages
                if cuda:
                    torch.cuda.empty_cache()
            d, q = rows[-2], rows[-1]
            print(f"QSA_BENCH L={L} C={C}: dense {d['decode_tok_s_aggregate']:.1f} tok/s, qsa "
                  f"{q['decode_tok_s_aggregate']:.1f} tok/s ({q['decode_tok_s_aggregate'] / d['decode_tok_s_aggregate']:.2f}x); "
                  f"floors {d['floor_tok_s']:.0f} / {q['floor_tok_s']:.0f}", flush=True)
            if pl is not None:
                atomic_write_parquet(out / "qsa_decode.parquet", pl.DataFrame(rows))
    if a.shapes or a.dry_run:
        (out / Path(a.model).name).unlink(missing_ok=True)
    return 0


def _profile(run, steps: int) -> dict:
    """Device time per step by kernel name over `steps` graphed steps (kernels inside CUDA graphs
    are traced by CUPTI), largest first, and the step's total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()  # (warm)
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    except Exception as e:  # a profile is a diagnosis: its failure must not lose the timings
        return {"error": f"{type(e).__name__}: {e}"}
    by = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, n = by.get(e.name, (0.0, 0))
            by[e.name] = (t + e.device_time, n + 1)
    total = sum(t for t, _ in by.values())
    kernels = sorted(by.items(), key=lambda kv: -kv[1][0])
    return {"device_us_per_step": total / steps,
            "kernels": [{"name": k[:120], "us_per_step": t / steps, "launches_per_step": n / steps}
                        for k, (t, n) in kernels[:30]]}


if __name__ == "__main__":
    sys.exit(main())
