"""Where speculation's time goes when it barely drafts: the draft-yield ablation's prompts of one
workload at one concurrency, plain and with speculation, each engine warmed up once and then
timed `--repeats` times alternately. Per pass: goodput, verify steps, the mean wall time of
plain decode steps, and the CUDA graphs captured during the pass (a capture inside a timed pass
is time no steady state pays).

    python3 scripts/spec_overhead.py --workload essay --concurrency 1 --spec ngram:4
    python3 scripts/spec_overhead.py --workload essay --concurrency 16 --spec ngram:8 \
        --variant verify_graph_family=false     (a third engine: speculation with these TritonOptions)
    python3 scripts/spec_overhead.py --workload code-edit --concurrency 16 --spec ngram:8 --phases
        (each pass's plain and verify steps split by phase: where a verify step's time goes)
    ... --steps-out steps.parquet   (every engine's step telemetry, all passes, one parquet: `engine` says whose)
    ... --profile-out host.prof   (cProfile of the last engine's timed passes: where its host time goes,
        with the device's time inside the runner's calls; the top functions printed too)
"""

from __future__ import annotations

import argparse
import sys
import time

from workbench.draft_yield import _num_graphs as _graphs  # (the runner's capture count)
from workbench.errors import WorkbenchError


def _pass(engine, prompts, tag: str) -> dict:
    if engine.speculator is not None:
        engine.speculator.forget_proposals()
    before, first = _graphs(engine), engine.telemetry.steps().height
    t0 = time.perf_counter()
    hs = [engine.submit(ids, max_tokens=n, request_id=f"{tag}-{i}", index=i, ignore_eos=False)
          for i, (ids, n) in enumerate(prompts)]
    engine.run_until_done()
    wall = time.perf_counter() - t0
    res = [h.result() for h in hs]
    steps = engine.telemetry.steps()
    steps = steps.filter(steps["step"] >= first)
    plain = steps.filter((steps["phase"] == "decode") & (steps["draft_tokens"].fill_null(0) == 0))
    return {"tok_s": sum(len(r.token_ids) for r in res) / wall, "steps": steps.height,
            "verify_steps": sum(r.spec.verify_steps for r in res) if res[0].spec else 0,
            "shadows": sum(r.spec.shadows for r in res) if res[0].spec else 0,
            "plain_step_ms": float(plain["wall_ms"].mean()) if plain.height else None,
            "captures": _graphs(engine) - before, "ahead": int(steps["ran_ahead"].sum()),
            "pipelined": int(steps["pipelined"].sum()),
            "tokens": [r.token_ids for r in res]}


PHASES = (("drafts", "_drafts"), ("schedule", "scheduler.schedule"), ("run", "runner.run"),
          ("verify", "_verify"), ("commit", "scheduler.commit"), ("record", "_record_step"))


class Phases:
    """Wall time per engine step by phase (PHASES: the proposer and guard, planning, the
    runner's forwards, accepting the drafts, committing, the step's telemetry), summed over
    plain and verify steps apart. The runner's time holds the device's where the runner waits
    for its tokens (a verify, a step not launched ahead); the rest is the host's. Wrapping
    costs a few microseconds a call."""

    def __init__(self, engine):
        self.sums = {"plain": {}, "verify": {}}
        self.steps = {"plain": 0, "verify": 0}
        self._now: dict[str, float] = {}
        for name, path in PHASES:
            *owner, attr = path.split(".")
            obj = engine
            for o in owner:
                obj = getattr(obj, o)
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))
        engine.step = self._step(engine, engine.step)

    def _timed(self, name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._now[name] = self._now.get(name, 0.0) + time.perf_counter() - t
        return call

    def _step(self, engine, fn):
        def step():
            self._now = {}
            t = time.perf_counter()
            out = fn()
            self._now["total"] = time.perf_counter() - t
            rec = engine.telemetry.step_records[-1] if engine.telemetry.step_records else None
            if rec is not None and rec["phase"] == "decode":
                kind = "verify" if rec.get("draft_tokens") else "plain"
                self.steps[kind] += 1
                for k, v in self._now.items():
                    self.sums[kind][k] = self.sums[kind].get(k, 0.0) + v
            return out
        return step

    def report(self) -> str:
        lines = []
        for kind in ("plain", "verify"):
            n = self.steps[kind]
            if n:
                parts = ", ".join(f"{k} {1e3 * v / n:.3f}" for k, v in self.sums[kind].items() if k != "total")
                lines.append(f"    {kind} steps: {n}, {1e3 * self.sums[kind]['total'] / n:.3f} ms each ({parts} ms)")
            self.sums[kind], self.steps[kind] = {}, 0
        return "\n".join(lines)


def _ms(v) -> str:
    return "none" if v is None else f"{v:.3f} ms"  # (a pass that ran no plain decode step)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="essay")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--spec", default="ngram:4", help="PROPOSER:K (proposer as bench --spec takes it)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--prompts-dir", default="data")
    ap.add_argument("--variant", default=None, metavar="NAME=VALUE,...",
                    help="also time speculation on an engine with these TritonOptions (bench's --triton-options form)")
    ap.add_argument("--spec-variant", default=None, metavar="NAME=VALUE,...",
                    help="also time speculation with these SpecConfig fields changed (e.g. pipeline=0)")
    ap.add_argument("--phases", action="store_true",
                    help="also print each pass's mean step time by phase (drafts, schedule, run, verify, commit, record)")
    ap.add_argument("--steps-out", default=None, metavar="PATH",
                    help="write every engine's step telemetry (warm-up and timed passes) to this parquet")
    ap.add_argument("--profile-out", default=None, metavar="PATH",
                    help="cProfile the last engine's timed passes into this pstats file (and print its top functions)")
    args = ap.parse_args(argv)
    try:
        import workbench
        from workbench import workloads as wl
        from workbench.draft_yield import _prompts
        from workbench.engine_config import EngineConfig
        from workbench.spec import spec_config

        spec = spec_config(args.spec)
        m = workbench.load_model(args.model)
        prompts = _prompts(m, wl, args.workload, args.concurrency, 0, args.prompts_dir, None)
        base = dict(max_concurrency=args.concurrency, dtype=m.dtype_name, backend=args.backend, prefix_cache=False)
        engines = {"AR": workbench.Engine(m, EngineConfig(**base)),
                   args.spec: workbench.Engine(m, EngineConfig(**base, speculation=spec))}
        if args.variant:
            from workbench.runners.triton_options import TritonOptions

            engines[f"{args.spec} {args.variant}"] = workbench.Engine(
                m, EngineConfig(**base, speculation=spec, triton=TritonOptions.parse(args.variant)))
        if args.spec_variant:
            engines[f"{args.spec} {args.spec_variant}"] = workbench.Engine(
                m, EngineConfig(**base, speculation=spec.overridden(args.spec_variant)))
        phases = {tag: Phases(e) for tag, e in engines.items()} if args.phases else {}
        for tag, e in engines.items():
            _pass(e, prompts, f"warm-{tag}")
            if tag in phases:
                phases[tag].report()  # (the warm-up's sums dropped)
        ref = None
        profiler, last = None, list(engines)[-1]
        if args.profile_out:
            import cProfile

            profiler = cProfile.Profile()
        for r in range(args.repeats):
            for tag, e in engines.items():
                if profiler is not None and tag == last:
                    profiler.enable()
                got = _pass(e, prompts, f"{tag}-{r}")
                if profiler is not None and tag == last:
                    profiler.disable()
                ref = ref or got["tokens"]
                print(f"{tag:>12} pass {r}: {got['tok_s']:8.1f} tok/s, {got['steps']} steps, "
                      f"{got['verify_steps']} verify, {got['shadows']} shadows, "
                      f"plain step {_ms(got['plain_step_ms'])}, "
                      f"{got['ahead']} ran ahead, {got['pipelined']} pipelined, {got['captures']} graph captures, "
                      f"tokens {'same' if got['tokens'] == ref else 'DIFFER'}",
                      flush=True)
                if tag in phases:
                    print(phases[tag].report(), flush=True)
        if profiler is not None:
            import pstats

            profiler.dump_stats(args.profile_out)
            print(f"cProfile of {last!r}, {args.repeats} timed passes (profiling slows each call):")
            for order in ("tottime", "cumulative"):
                pstats.Stats(args.profile_out).sort_stats(order).print_stats(30)
        if args.steps_out:
            import polars as pl

            from workbench.atomic import atomic_write_parquet

            frames = [e.telemetry.steps().with_columns(pl.lit(tag).alias("engine")) for tag, e in engines.items()]
            atomic_write_parquet(args.steps_out, pl.concat(frames, how="diagonal_relaxed"))
    except WorkbenchError as e:
        print(f"spec_overhead: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
