"""Where the host spends an Engine decode step: cProfile of `Engine.generate` at C slots on the
GPU (backend triton), after an untimed run that captures the graphs; prints the decode span per
step and the top functions by own time.

    python3 scripts/engine_profile.py --model model.gguf [--concurrency 16] [--gen 128] [--options 'pdl=false']
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--options", default="", help="the engine's TritonOptions as 'name=value,...' (default: the defaults)")
    args = ap.parse_args()
    from workbench import Engine, EngineConfig
    from workbench.bench import bench_prompts
    from workbench.errors import WorkbenchError
    from workbench.model import load_model
    from workbench.runners.triton_options import TritonOptions

    try:
        options = TritonOptions.parse(args.options)
    except WorkbenchError as e:
        ap.error(str(e))

    m = load_model(args.model, dtype="bfloat16")
    cfg = EngineConfig(backend="triton", dtype="bfloat16", max_concurrency=args.concurrency,
                       max_context=args.prompt_len + args.gen + 8, triton=options)
    eng = Engine(m, cfg)
    prompts = bench_prompts(m, args.concurrency, args.prompt_len)
    eng.generate(prompts, max_tokens=args.gen, ignore_eos=True)  # graphs captured here
    n0 = eng.telemetry.steps().height
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    eng.generate(prompts, max_tokens=args.gen, ignore_eos=True)
    prof.disable()
    dt = time.perf_counter() - t0
    steps = eng.telemetry.steps()
    steps = steps.filter(steps["step"] >= n0)
    print(f"C={args.concurrency}: {steps.height} steps in {dt * 1e3:.1f} ms under cProfile "
          f"({dt / steps.height * 1e3:.3f} ms per step)")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())
    t0 = time.perf_counter()
    eng.generate(prompts, max_tokens=args.gen, ignore_eos=True)
    dt = time.perf_counter() - t0
    print(f"without the profiler: {dt * 1e3:.1f} ms, {dt / (steps.height) * 1e3:.3f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
