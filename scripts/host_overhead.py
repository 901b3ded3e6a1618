"""The engine's host time per step, without a forward: a runner that answers every scored row
with the token a recorded plain-decoding run emitted there, so a step's wall time is the
scheduler's, the speculator's and the telemetry's alone (the pages are still allocated, fitted
and committed as in a real run). What a GPU step costs beyond its device time, measured on any
machine; on the device a verify step cannot hide it (docs/GPU_NOTES.md, session 29).

    python3 scripts/host_overhead.py --workload code-edit --concurrency 16 --spec ngram:8
    python3 scripts/host_overhead.py ... --spec-variant step_plan=joint --out steps.parquet
    python3 scripts/host_overhead.py ... --spec-variant pipeline=8   (the pipeline: a half step's host)

The recorded run is plain greedy decoding on the torch runner (the slow part on a CPU: about a
minute for code editing at 16 slots). Each pass's tokens must equal it, or the script exits 1.
The guard decides from its acceptance counts and `SpecConfig.row_cost` (measure_cost off): the
replay's step times are no device's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from workbench.errors import WorkbenchError


class ReplayRunner:
    """Stands in for a runner's `run`: each scored row's greedy token from the recorded run
    (its request's output at that position). Only `run` is replaced, so the runner's page pool
    and the scheduler's view of it stay real."""

    def __init__(self, prompts: list[tuple[int, ...]], outputs: list[list[int]]):
        self.prompts, self.outputs = prompts, outputs

    def launch(self, forward, max_context, argmax=frozenset()):
        """The pipeline's launch (SpecConfig.pipeline): answered at once, as `run`."""
        from workbench.runner import Launched

        return Launched(self.run(forward, max_context, argmax))

    def run(self, forward, max_context, argmax=frozenset(), ahead=False):
        out = {}
        for s in forward:
            n = s.num_scored
            if not n:
                continue
            i = int(str(s.request_id).rsplit("-", 1)[-1])
            end = s.start_pos + len(s.token_ids)  # the row at position p emits the token at p + 1
            toks = tuple(self.outputs[i][p - len(self.prompts[i])] for p in range(end - n + 1, end + 1))
            out[s.slot_id] = toks[0] if n == 1 else toks
        return out


def _pass(engine, prompts, tag: str) -> list[list[int]]:
    hs = [engine.submit(ids, max_tokens=n, request_id=f"{tag}-{i}", index=i, ignore_eos=False)
          for i, (ids, n) in enumerate(prompts)]
    engine.run_until_done()
    return [h.result().token_ids for h in hs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="code-edit")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--spec", default="ngram:8", help="PROPOSER:K (e.g. ngram:8), or 'off' (plain decoding's host alone)")
    ap.add_argument("--spec-variant", default=None, metavar="NAME=VALUE,...", help="SpecConfig fields changed")
    ap.add_argument("--passes", type=int, default=5, help="timed passes, after one untimed")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each prompt's tokens")
    ap.add_argument("--prompts-dir", default="data")
    ap.add_argument("--out", default=None, metavar="PATH", help="every timed step's telemetry, as parquet")
    args = ap.parse_args(argv)
    try:
        import polars as pl

        import workbench
        from workbench import workloads as wl
        from workbench.draft_yield import _prompts
        from workbench.engine_config import EngineConfig
        from workbench.spec import spec_config

        if args.passes < 1 or args.concurrency < 1:
            raise WorkbenchError(f"--passes={args.passes} and --concurrency={args.concurrency}: allowed integers >= 1")
        spec = None
        if args.spec != "off":
            # the guard's lengths from its acceptance counts and row_cost alone: measured costs
            # would be the replay's host times, not a device's (--spec-variant measure_cost=true
            # to let them decide)
            spec = spec_config(args.spec, measure_cost=False)
            if args.spec_variant:
                spec = spec.overridden(args.spec_variant)
        m = workbench.load_model(args.model)
        prompts = _prompts(m, wl, args.workload, args.concurrency, 0, args.prompts_dir, args.max_tokens)
        base = dict(max_concurrency=args.concurrency, dtype=m.dtype_name, backend="torch", prefix_cache=False)
        recorded = _pass(workbench.Engine(m, EngineConfig(**base)), prompts, "ar")
        engine = workbench.Engine(m, EngineConfig(**base, speculation=spec))
        # (an engine builds its own runner; its run alone is replaced, an instance attribute)
        replay = ReplayRunner([tuple(p) for p, _ in prompts], recorded)
        engine.runner.run, engine.runner.launch = replay.run, replay.launch
        _pass(engine, prompts, "warm")
        first = engine.telemetry.steps().height
        for r in range(args.passes):
            if engine.speculator is not None:
                engine.speculator.forget_proposals()
            t0 = time.perf_counter()
            got = _pass(engine, prompts, f"p{r}")
            wall = time.perf_counter() - t0
            if got != recorded:
                print(f"host_overhead: pass {r}: tokens differ from the recorded run", file=sys.stderr)
                return 1
            print(f"pass {r}: {1e3 * wall:.1f} ms for {sum(map(len, got))} tokens", flush=True)
        steps = engine.telemetry.steps().slice(first)
        decode = steps.filter(pl.col("phase") == "decode")
        verify, half = pl.col("draft_tokens").fill_null(0) > 0, pl.col("pipelined")
        for kind, rows in (("plain", decode.filter(~verify & ~half)), ("verify", decode.filter(verify & ~half)),
                           ("half plain", decode.filter(~verify & half)), ("half verify", decode.filter(verify & half))):
            if rows.height:
                print(f"{kind} steps: {rows.height}, host {statistics.median(rows['wall_ms']):.3f} ms each (median), "
                      f"{rows['rows'].mean():.1f} rows, {rows['tokens_out'].mean():.1f} tokens out")
        if args.out:
            from workbench.atomic import atomic_write_parquet

            atomic_write_parquet(args.out, steps)
    except WorkbenchError as e:
        print(f"host_overhead: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
