"""Where speculation's time goes when it barely drafts: the draft-yield ablation's prompts of one
workload at one concurrency, plain and with speculation, each engine warmed up once and then
timed `--repeats` times alternately. Per pass: goodput, verify steps, the mean wall time of
plain decode steps, and the CUDA graphs captured during the pass (a capture inside a timed pass
is time no steady state pays).

    python3 scripts/spec_overhead.py --workload essay --concurrency 1 --spec ngram:4
    python3 scripts/spec_overhead.py --workload essay --concurrency 16 --spec ngram:8 \
        --variant verify_graph_family=false     (a third engine: speculation with these TritonOptions)
"""

from __future__ import annotations

import argparse
import sys
import time

from workbench.errors import WorkbenchError


def _graphs(engine) -> int:
    g = getattr(engine.runner, "graphs", None)
    return 0 if g is None else len(g.keys) + len(g.chunk_keys)


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
            "plain_step_ms": float(plain["wall_ms"].mean()) if plain.height else None,
            "captures": _graphs(engine) - before, "tokens": [r.token_ids for r in res]}


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
    args = ap.parse_args(argv)
    try:
        import workbench
        from workbench import workloads as wl
        from workbench.draft_yield import _prompts
        from workbench.engine_config import EngineConfig
        from workbench.spec import SpecConfig, proposer_fields

        name, _, k = args.spec.rpartition(":")
        spec = SpecConfig(**proposer_fields(name), k=int(k))
        m = workbench.load_model(args.model)
        prompts = _prompts(m, wl, args.workload, args.concurrency, 0, args.prompts_dir, None)
        base = dict(max_concurrency=args.concurrency, dtype=m.dtype_name, backend=args.backend, prefix_cache=False)
        engines = {"AR": workbench.Engine(m, EngineConfig(**base)),
                   args.spec: workbench.Engine(m, EngineConfig(**base, speculation=spec))}
        if args.variant:
            from workbench.runners.triton_options import TritonOptions

            engines[f"{args.spec} {args.variant}"] = workbench.Engine(
                m, EngineConfig(**base, speculation=spec, triton=TritonOptions.parse(args.variant)))
        for tag, e in engines.items():
            _pass(e, prompts, f"warm-{tag}")
        ref = None
        for r in range(args.repeats):
            for tag, e in engines.items():
                got = _pass(e, prompts, f"{tag}-{r}")
                ref = ref or got["tokens"]
                print(f"{tag:>12} pass {r}: {got['tok_s']:8.1f} tok/s, {got['steps']} steps, "
                      f"{got['verify_steps']} verify, plain step {_ms(got['plain_step_ms'])}, "
                      f"{got['captures']} graph captures, tokens {'same' if got['tokens'] == ref else 'DIFFER'}",
                      flush=True)
    except WorkbenchError as e:
        print(f"spec_overhead: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
