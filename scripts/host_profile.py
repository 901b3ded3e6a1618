"""Where an eager Triton forward's time goes (device runs: `python3 scripts/host_profile.py
--model PATH`): wall time of prefill chunks of 64 / 512 / 2112 rows and of one eager decode row
(each after a warm-up, synchronized), the device time per kernel of a 64-row chunk and of one
row (torch.profiler), then cProfile of the 64-row chunk, top functions by own time. A prefix-cache hit's TTFT is one such chunk (the prompt's tokens past the cached pages)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    from workbench.model import load_model
    from workbench.runners.direct_pages import DirectPages
    from workbench.runners.triton_options import TritonOptions
    from workbench.runners.triton_runner import TritonRunner

    m = load_model(args.model, dtype="bfloat16")
    r = TritonRunner(m, 4096, TritonOptions())
    pages = DirectPages(r, 64 * 4096)
    n = [0]

    def chunk(rows: int) -> None:
        n[0] += 1
        toks = tuple(range(10, 10 + rows))
        r.run([pages.segment(0, n[0], toks, 0)], {0: 4096}, argmax=frozenset({0}))
        torch.cuda.synchronize()
        pages.free(n[0])

    for rows in (64, 512, 2112, 1):
        chunk(rows)  # warm: compile / load
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            chunk(rows)
        print(f"eager chunk of {rows} rows: {1e3 * (time.perf_counter() - t0) / args.repeats:.2f} ms, "
              f"{r.launches} launches", flush=True)
    from torch.profiler import ProfilerActivity, profile

    for rows in (64, 1):
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            for _ in range(3):
                chunk(rows)
        kern = sorted(((e.key, e.count, getattr(e, "device_time_total", 0) or 0) for e in tp.key_averages()),
                      key=lambda k: -k[2])
        total = sum(k[2] for k in kern) / 3
        print(f"device time of a {rows}-row chunk: {total / 1e3:.2f} ms; top kernels (us per chunk, calls):")
        for name, count, dt in kern[:14]:
            print(f"  {dt / 3:9.1f}  x{count // 3:<4d} {name[:100]}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.repeats):
        chunk(64)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
