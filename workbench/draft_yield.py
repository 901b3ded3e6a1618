"""The draft-yield ablation (issue 21, item 7): goodput of speculative decoding against plain
(autoregressive, AR) decoding, on the same prompts in the same run, with bitwise-identical
outputs.

For every workload and concurrency C, C prompts of the workload (workbench/workloads.py) are
submitted together on a plain engine: the reference. Then, for every proposer, k, token-tree
budget (`trees`: 0 for a linear chain) and guard setting, the same prompts on an engine with
that speculation, its timed passes alternating with the reference engine's (rounds: a host
whose speed drifts meets both alike). A row says what the proposer
drafted and the target kept (verify steps, draft tokens, acceptance, the acceptance-length
histogram, draft yield: tokens emitted per verify step), the goodput (tokens generated over
the run's wall, from the first submit to the last token) against the reference's, and
whether every request's tokens equal the reference's.

Greedy (temperature 0) or seeded sampling (top-p 0.95, each request its own seed index: the
exact verify keeps sampled outputs bitwise too), EOS honoured (both arms stop alike). The
default model is a base checkpoint, which under greedy decoding falls into loops that any
proposer predicts; sampling (`temperatures`) is what keeps an essay from repeating. The engines keep no logits (on the GPU a verify
then answers with its rows' argmax and plain steps run ahead, as they serve); the logits'
bitwise equality is tests/test_speculation.py's claim, on both runners.

A row that asked for speculation and verified nothing is flagged (`activation_ok` False),
never reported as a measurement of speculation.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

from workbench.errors import WorkbenchError

# the yield guard on or off, or seed 002's cohort rule (SpecConfig.guard True / False / "cohort")
GUARDS = ("on", "off", "cohort")
GUARD_VALUES = {"on": True, "off": False, "cohort": "cohort"}


def measure_draft_yield(
    model,
    *,
    workloads: Sequence[str],
    proposers: Sequence[str],
    ks: Sequence[int],
    concurrency: Sequence[int],
    guards: Sequence[str] = ("on",),
    trees: Sequence[int] = (0,),
    pipelines: Sequence[int] = (0,),
    temperatures: Sequence[float] = (0.0,),
    max_tokens: int | None = None,
    backend: str = "torch",
    seed: int = 0,
    data_dir: str = "data",
    progress: bool = True,
    timed_passes: int = 1,
):
    """One row per (workload, temperature, concurrency, proposer, k, tree, guard), each beside
    its AR reference. `trees`: token-tree node budgets (SpecConfig.tree; 0: a linear chain).
    `pipelines`: the slots the pipeline starts at (SpecConfig.pipeline; 0: off).
    `max_tokens`: a cap on each prompt's own suggestion (None: the suggestion).
    `timed_passes`: after its warm-up pass, each arm's engine runs the prompts this many times,
    each pass right after one of the AR engine's (a round, `_rounds`); a row reports the arm's
    pass of median goodput and AR's from the same rounds, and `goodput_vs_ar` is the median of
    the rounds' ratios (on the GPU a step shape first met in a timed pass captures a graph
    inside it: H200 run 83, essays C1, 0.83x in a first timed pass and 0.97x in the next two).
    Every timed pass's tokens, the arm's and AR's, are checked against AR's."""
    import polars as pl

    from workbench import workloads as wl
    from workbench.ablations import measurement_bar, next_measurement
    from workbench.engine_config import EngineConfig
    from workbench.spec import SpecConfig, proposer_fields

    bad = [g for g in guards if g not in GUARDS]
    if bad:
        raise WorkbenchError(f"guard={bad[0]!r} is not allowed: allowed {', '.join(GUARDS)}")
    specs = [(p, k, n, g, pipe) for p in proposers for k in ks for n in trees for g in guards for pipe in pipelines]
    # (built before any work: a bad value is one line)
    configs = {spec: SpecConfig(**proposer_fields(spec[0]), k=spec[1], tree=spec[2] or None,
                                guard=GUARD_VALUES[spec[3]], pipeline=spec[4]) for spec in specs}
    labels = [f"{w} T={t:g} C={c} " + (_arm(*spec) if spec[0] else "AR")
              for w in workloads for t in temperatures for c in concurrency
              for spec in [(None, 0, 0, None, 0)] + _arms(specs, c)]
    rows = []
    with measurement_bar(labels, enabled=progress) as bar:
        for w in workloads:
            prompts = _prompts(model, wl, w, max(concurrency), seed, data_dir, max_tokens)
            for t in temperatures:
                sampling = dict(temperature=t, top_p=0.95 if t else 1.0, seed=seed if t else None)
                for c in concurrency:
                    timed = prompts[:c]
                    # (no prefix cache: each arm's untimed pass runs the same prompts first, ahead)
                    base = dict(max_concurrency=c, dtype=model.dtype_name, backend=backend, prefix_cache=False)
                    ar = _warm(model, EngineConfig(**base), timed, sampling)
                    next_measurement(bar, labels)
                    for spec in _arms(specs, c):
                        p, k, n, g, pipe = spec
                        engine = _warm(model, EngineConfig(**base, speculation=configs[spec]), timed, sampling)
                        got, ref = _rounds(engine, ar, timed, sampling, timed_passes)
                        del engine  # (its KV pool goes before the next arm's is allocated)
                        rows.append(_row(model, got, ref, workload=w, concurrency=c, proposer=p, k=k, tree=n,
                                         guard=g, pipeline=pipe, backend=backend, temperature=t))
                        next_measurement(bar, labels)
    return pl.DataFrame(rows, infer_schema_length=None)


def _arms(specs: list, concurrency: int) -> list:
    """The arms measured at `concurrency`: an arm whose pipeline starts at more slots than run
    is the same engine as its pipeline=0 twin, so it is left out where that twin is measured."""
    off = {spec[:4] for spec in specs if not spec[4]}
    return [spec for spec in specs if spec[4] <= concurrency or spec[:4] not in off]


def measure_from_config(model, config: dict):
    """`measure_draft_yield` with a validated config (`ablations.validate("draft-yield", ...)`):
    what the notebook and scripts/draft_yield_run.py both run."""
    return measure_draft_yield(
        model, workloads=config["workloads"], proposers=config["proposers"], ks=config["ks"],
        concurrency=config["concurrencies"], guards=config["guards"], trees=config["trees"],
        pipelines=config["pipelines"],
        max_tokens=config["max_tokens"],
        temperatures=[t / 100 for t in config["temperatures_pct"]],
        backend=config["backend"], seed=config["seed"], data_dir=config["data_dir"], progress=config["progress"],
        timed_passes=config["timed_passes"])


def _prompts(model, wl, workload: str, num: int, seed: int, data_dir: str, cap: int | None):
    """(token ids, max_tokens) of `num` prompts of the workload: the shipped set where it has
    them (seed 0), else generated."""
    try:
        items = wl.load(workload, data_dir) if seed == 0 else []
    except WorkbenchError:
        items = []
    if len(items) < num:
        items = wl.generate(workload, num, seed)
    out = []
    for it in items[:num]:
        # the completion form: the default model is a base checkpoint (workloads.render says why)
        ids = model.tokenize(wl.render(it, "completion"))
        out.append((ids, it.max_tokens if cap is None else min(cap, it.max_tokens)))
    return out


def _warm(model, config, prompts, sampling: dict):
    """A fresh engine after one untimed pass of the prompts. The untimed pass is there because
    CUDA graphs are captured per engine the first time a step shape needs one (H200 run 78
    warmed up on other prompts of the workload, and shapes first met in the timed pass cost AR
    extraction at C1 7x), and the guard's cost model learns this machine's step costs in it."""
    from workbench.engine import Engine

    engine = Engine(model, config)
    _pass(engine, prompts, sampling, "warm")
    return engine


def _rounds(engine, ar, prompts, sampling: dict, timed_passes: int = 1) -> tuple[dict, dict]:
    """(the arm's, AR's) measurement: `timed_passes` rounds, each a pass of AR's engine then one
    of the arm's `engine`, so the two meet the host alike. Each is its pass of median goodput,
    with `all_results` (every timed pass's results) and `graph_captures` (the graphs its runner
    captured in these passes); the arm's carries `ratio`, the median over rounds of its goodput
    over AR's in the same round. Why rounds: on the H100 host a plain step takes 0.6 ms in some
    passes and 1.0-1.3 ms in others, whichever engine runs (runs 114 and 118), and engines
    timed one after the other moved whole rows (run 116: an arm that verified nothing, so did
    AR's work, at 0.79x). Before each pass the proposer forgets what it saw (a suffix proposer
    would otherwise draft a pass from the previous pass's outputs)."""
    before_arm, before_ar = _num_graphs(engine), _num_graphs(ar)
    done = len(ar.telemetry.request_records)  # (AR's engine serves every arm: its request ids go on)
    pairs = [(_pass(ar, prompts, sampling, f"ar{done}.{i}"), _pass(engine, prompts, sampling, f"yield{i}"))
             for i in range(timed_passes)]
    ratios = sorted(b["goodput_tok_s"] / a["goodput_tok_s"] for a, b in pairs)

    def median(passes, captures):
        out = dict(sorted(passes, key=lambda q: q["goodput_tok_s"])[len(passes) // 2])
        out["all_results"] = [q["results"] for q in passes]
        out["graph_captures"] = captures
        return out

    got = median([b for _, b in pairs], _num_graphs(engine) - before_arm)
    got["ratio"] = ratios[len(ratios) // 2]
    return got, median([a for a, _ in pairs], _num_graphs(ar) - before_ar)


def _num_graphs(engine) -> int:
    """CUDA graphs the engine's runner captured so far (0 for a runner without them)."""
    return getattr(engine.runner, "num_captures", 0)


def _pass(engine, prompts, sampling: dict, tag: str) -> dict:
    """The prompts submitted together on `engine`, run to the end: results and counters."""
    if engine.speculator is not None:
        engine.speculator.forget_proposals()
    warm_steps = engine.telemetry.steps().height
    start = time.perf_counter()
    handles = [engine.submit(ids, max_tokens=n, request_id=f"{tag}-{i}", index=i, **sampling)
               for i, (ids, n) in enumerate(prompts)]
    engine.run_until_done()
    wall = time.perf_counter() - start
    results = [h.result() for h in handles]
    steps = engine.telemetry.steps()
    steps = steps.filter(steps["step"] >= warm_steps)
    generated = sum(len(r.token_ids) for r in results)
    spec = [r.spec for r in results if r.spec is not None]
    hist: list[int] = []
    pos_d: list[int] = []
    pos_a: list[int] = []
    for s in spec:
        for acc, src in ((hist, s.hist), (pos_d, s.position_drafted), (pos_a, s.position_accepted)):
            acc.extend([0] * (len(src) - len(acc)))
            for i, v in enumerate(src):
                acc[i] += v
    verify = sum(s.verify_steps for s in spec)
    drafted = sum(s.drafted for s in spec)
    accepted = sum(s.accepted for s in spec)
    emitted = sum(s.emitted for s in spec)
    last = steps.tail(1)
    return {
        "results": results,
        "wall_s": wall,
        "generated_tokens": generated,
        "goodput_tok_s": generated / wall,
        "num_steps": steps.height,
        "verify_steps": verify if spec else None,
        "drafted": drafted if spec else None,
        "accepted": accepted if spec else None,
        "emitted_in_verify": emitted if spec else None,
        "acceptance": accepted / drafted if drafted else None,
        "draft_yield": emitted / verify if verify else None,
        "guard_skips": sum(s.guard_skips for s in spec) if spec else None,
        "empty_proposals": sum(s.empty for s in spec) if spec else None,
        # of the guard's skips, those its step-level rule made (the slot's own rule drafted)
        "guard_vetoes": sum(s.vetoed for s in spec) if spec else None,
        # shadow drafts: checked against plain decoding's tokens at k = 0, and what they kept
        "shadow_checks": sum(s.shadows for s in spec) if spec else None,
        "shadow_acceptance": (sum(s.shadow_accepted for s in spec) / max(1, sum(s.shadow_drafted for s in spec))
                              if spec else None),
        "acceptance_hist": hist if spec else None,
        "position_acceptance": [a / d for a, d in zip(pos_a + [0] * (len(pos_d) - len(pos_a)), pos_d)] if spec else None,
        "row_cost": float(last["row_cost"][0]) if spec and last.height and last["row_cost"][0] is not None else None,
        "draft_rows": int(steps["draft_tokens"].fill_null(0).sum()) if spec else None,
        # token trees: alternative paths verified, their rows, verifies an alternative won
        "tree_paths": sum(s.tree_paths for s in spec) if spec else None,
        "tree_rows": int(steps["tree_rows"].fill_null(0).sum()) if spec else None,
        "tree_wins": sum(s.tree_wins for s in spec) if spec else None,
        # seed 002's cohort rule (guard "cohort"): what its first verify step decided, "on" or "off"
        "cohort_decision": getattr(engine.speculator.guard, "decision", None) if engine.speculator else None,
        # steps whose forward was launched ahead during the step before (the Triton runner's
        # run-ahead: plain decoding's overlap of host and device, also the guard's k = 0 steps')
        "ahead_steps": int(steps["ran_ahead"].sum()),
        # half steps of the pipeline (SpecConfig.pipeline: the slots' halves verify in turn)
        "pipelined_steps": int(steps["pipelined"].sum()),
    }


def _arm(proposer, k, tree, guard, pipeline=0) -> str:
    return (f"{proposer} k={k}" + (f" tree={tree}" if tree else "") + f" guard {guard}"
            + (f" pipeline {pipeline}" if pipeline else ""))


def _row(model, got: dict, ref: dict, *, workload, concurrency, proposer, k, tree, guard, backend, temperature,
         pipeline=0) -> dict:
    same = [a.token_ids == b.token_ids for results in got["all_results"] + ref["all_results"]
            for a, b in zip(results, ref["results"])]
    ok, flag = activation(got["verify_steps"] or 0, tree=bool(tree), tree_paths=got["tree_paths"] or 0)
    keep = ("wall_s", "generated_tokens", "goodput_tok_s", "num_steps", "verify_steps", "drafted", "accepted",
            "emitted_in_verify", "acceptance", "draft_yield", "guard_skips", "guard_vetoes", "shadow_checks",
            "shadow_acceptance", "empty_proposals", "acceptance_hist", "position_acceptance", "row_cost",
            "draft_rows", "tree_paths", "tree_rows", "tree_wins", "cohort_decision", "ahead_steps",
            "pipelined_steps")
    return {
        "workload": workload,
        "concurrency": concurrency,
        "proposer": proposer,
        "k": k,
        "tree": tree,
        "guard": guard,
        "temperature": temperature,
        "backend": backend,
        "pipeline": pipeline,
        "arm": _arm(proposer, k, tree, guard, pipeline),
        **{key: got[key] for key in keep},
        "ar_goodput_tok_s": ref["goodput_tok_s"],
        "ar_wall_s": ref["wall_s"],
        "ar_generated_tokens": ref["generated_tokens"],
        "ar_ahead_steps": ref["ahead_steps"],
        "timed_passes": len(got["all_results"]),
        # graphs captured inside the timed passes (their time is in them), the arm's and AR's
        "graph_captures": got["graph_captures"],
        "ar_graph_captures": ref["graph_captures"],
        # the median over the rounds of the arm's goodput over AR's in the same round (`_rounds`)
        "goodput_vs_ar": got["ratio"],
        "tokens_identical": all(same),
        "activation_ok": ok,
        "activation_flag": flag,
        "tokens_sha256": hashlib.sha256(json.dumps([r.token_ids for r in got["results"]]).encode()).hexdigest(),
        "model_name": str(model.source.get("general.name", model.path.stem)),
        "model_sha256": model.source.index.sha256,
    }


def activation(verify_steps: int, *, tree: bool = False, tree_paths: int = 0) -> tuple[bool, str | None]:
    """Whether a speculation row verified anything, and with a tree asked an alternative path
    (one line when not)."""
    if verify_steps == 0:
        return False, ("speculation asked but no draft was verified (the proposer found nothing, or the guard "
                       "kept every slot at k=0)")
    if tree and tree_paths == 0:
        return False, ("token trees asked but no alternative path was verified (the proposer offered one path "
                       "only, or the forks' pages did not fit)")
    return True, None


def differing(summary) -> str | None:
    """One line naming the rows whose tokens differ from the AR run's; None when all agree."""
    bad = summary.filter(~summary["tokens_identical"])
    if not bad.height:
        return None
    cases = ", ".join(f"{r['workload']} T={r['temperature']:g} C={r['concurrency']} {r['arm']}"
                      for r in bad.head(5).iter_rows(named=True))
    return f"tokens differ from the AR run in {bad.height} measurement(s): {cases}"


def require_identical(summary) -> None:
    line = differing(summary)
    if line:
        raise WorkbenchError(line)


def flagged(summary):
    return summary.filter(~summary["activation_ok"])
