"""The engine's host time per step, without a forward: a runner that answers every scored row
with the token a recorded plain-decoding run emitted there, so a step's wall time is the
scheduler's, the speculator's and the telemetry's alone (the pages are still allocated, fitted
and committed as in a real run). What a GPU step costs beyond its device time, measured on any
machine; on the device a verify step cannot hide it (docs/GPU_NOTES.md, session 29).

    python3 scripts/host_overhead.py --workload code-edit --concurrency 16 --spec ngram:8
    python3 scripts/host_overhead.py ... --spec-variant pipeline=0 --out steps.parquet
    python3 scripts/host_overhead.py ... --spec-variant pipeline=8   (the pipeline: a half step's host)

The recorded run is plain greedy decoding on the torch runner (the slow part on a CPU: about a
minute for code editing at 16 slots). Each pass's tokens must equal it, or the script exits 1.
The guard decides from its acceptance counts and `SpecConfig.row_cost` (measure_cost off): the
replay's step times are no device's.

With `--device-ms PA,PB,VA,VB` each forward also takes a simulated device's time on one stream:
a plain step (one row a slot, the decode graph) PA + PB x rows ms, any other VA + VB x rows ms.
Plain steps run ahead of the host as the Triton runner's do, the pipeline's halves queue behind
each other, a verify step waits for its own forward. The guard then decides from the measured
step times (measure_cost on, as on a device), and plain decoding (AR) is timed beside the
speculation arm, alternating, so the two engines' scheduling (what the step rule does with
such a device, whether the pipeline starts and stays) is seen on any machine: the tokens are
the recorded run's, the times the model's. H100 figures (docs/GPU_NOTES.md, runs 104 and 107,
16 slots at 2048 positions): plain 0.56 + 0.006 a row, a verify's chunk graph 0.52 + 0.0165.

    python3 scripts/host_overhead.py ... --spec-variant pipeline=8 --device-ms 0.56,0.006,0.52,0.0165
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from workbench.errors import WorkbenchError


class Replay:
    """Each scored row's greedy token from the recorded run (its request's output at that
    position): the answer a runner gives for a forward, with no forward run."""

    def __init__(self, prompts: list[tuple[int, ...]], outputs: list[list[int]]):
        self.prompts, self.outputs = prompts, outputs

    def __call__(self, forward) -> dict:
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
    ap.add_argument("--device-ms", default=None, metavar="PA,PB,VA,VB",
                    help="a simulated device: a plain step PA + PB x rows ms, any other VA + VB x rows (module docstring)")
    args = ap.parse_args(argv)
    try:
        import polars as pl

        import workbench
        from workbench import workloads as wl
        from workbench.draft_yield import _prompts
        from workbench.engine_config import EngineConfig
        from workbench.runners.simulated import DeviceModel, SimulatedDevice
        from workbench.spec import spec_config

        if args.passes < 1 or args.concurrency < 1:
            raise WorkbenchError(f"--passes={args.passes} and --concurrency={args.concurrency}: allowed integers >= 1")
        device = DeviceModel.parse(args.device_ms) if args.device_ms else None
        spec = None
        if args.spec != "off":
            # without a device model the guard's lengths come from its acceptance counts and
            # row_cost alone: measured costs would be the replay's host times, not a device's
            # (--spec-variant measure_cost=true to let them decide)
            spec = spec_config(args.spec, measure_cost=device is not None)
            if args.spec_variant:
                spec = spec.overridden(args.spec_variant)
        m = workbench.load_model(args.model)
        prompts = _prompts(m, wl, args.workload, args.concurrency, 0, args.prompts_dir, args.max_tokens)
        base = dict(max_concurrency=args.concurrency, dtype=m.dtype_name, backend="torch", prefix_cache=False)
        recorded = _pass(workbench.Engine(m, EngineConfig(**base)), prompts, "ar")
        replay = Replay([tuple(p) for p, _ in prompts], recorded)
        arms = {}  # name -> engine; with a device model plain decoding is timed beside speculation
        for name, sp in ([("AR", None)] if device is not None and spec is not None else []) + [(args.spec, spec)]:
            engine = workbench.Engine(m, EngineConfig(**base, speculation=sp))
            # (the engine's runner keeps its page pool; each forward is answered from the replay,
            # at once without a device model)
            engine.runner = SimulatedDevice(engine.runner, device, answer=replay)
            _pass(engine, prompts, "warm")
            arms[name] = engine
        engine = arms[args.spec]
        first = engine.telemetry.steps().height
        for r in range(args.passes):
            rates = {}
            for name, e in arms.items():
                if e.speculator is not None:
                    e.speculator.forget_proposals()
                t0 = time.perf_counter()
                got = _pass(e, prompts, f"p{r}")
                wall = time.perf_counter() - t0
                if got != recorded:
                    print(f"host_overhead: {name} pass {r}: tokens differ from the recorded run", file=sys.stderr)
                    return 1
                rates[name] = sum(map(len, got)) / wall
                print(f"{name} pass {r}: {1e3 * wall:.1f} ms for {sum(map(len, got))} tokens, {rates[name]:.0f} tok/s"
                      + (f", {rates[name] / rates['AR']:.2f}x AR" if name != "AR" and "AR" in rates else ""), flush=True)
        steps = engine.telemetry.steps().slice(first)
        decode = steps.filter(pl.col("phase") == "decode")
        verify, half = pl.col("draft_tokens").fill_null(0) > 0, pl.col("pipelined")
        what = "host" if device is None else "wall"
        for kind, rows in (("plain", decode.filter(~verify & ~half)), ("verify", decode.filter(verify & ~half)),
                           ("half plain", decode.filter(~verify & half)), ("half verify", decode.filter(verify & half))):
            if rows.height:
                print(f"{kind} steps: {rows.height}, {what} {statistics.median(rows['wall_ms']):.3f} ms each (median), "
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
