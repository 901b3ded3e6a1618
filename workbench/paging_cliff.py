"""The paging-cliff ablation (issue 20, item 5): throughput against concurrency as the live KV
outgrows the device pool, with host backing (swap) or recompute, prompt compression off or on.

For every prompt length, PFlash setting and concurrency the requests first run on an
all-resident engine (a pool that holds all of them, no host store): the reference. Then, for
every resident pool and preemption policy, the same requests on that pool with a host store.
A row says how far the live KV oversubscribed the pool, what paging cost (pages and bytes
moved, transfer time, recomputes, the longest wait), the throughput against the reference's,
and whether every token and logit is bitwise the reference's. With PFlash on the reference
compresses too, so compression's own loss is not counted here (compression_quality.py
measures that).

A row is also checked for activation (`activation`): where the requests' pages outnumber the
pool's and yet no page moved and nothing was recomputed (the engine held the excess in its
admission queue instead), or where PFlash was on and compressed no prompt, `activation_ok` is
False and `activation_flag` says what showed none. Such a row is kept and flagged, never
reported as a measurement of paging.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

from workbench.errors import WorkbenchError

# what each `pflash` word asks of EngineConfig.prompt_compression: "on" is the engine's own
# auto rule, as seed 002 ran it (prompts of at least compression.auto_min_tokens keep about
# compression.auto_kept_tokens; shorter ones are left whole)
PFLASH = {"off": "off", "on": "auto"}
# the longest warm-up prompt: the effective length PFlash "auto" keeps (its auto_kept_tokens)
WARM_UP_PROMPT_CAP = 2048


def measure_paging_cliff(
    model,
    *,
    concurrency: Sequence[int],
    resident_tokens: Sequence[int],
    prompt_lens: Sequence[int],
    gen_tokens: int,
    pflash: Sequence[str] = ("off",),
    preemption: Sequence[str] = ("swap", "recompute"),
    host_tokens: int | None = None,
    quantum: int | None = None,
    backend: str = "torch",
    seed: int = 0,
    progress: bool = True,
):
    """One row per (prompt length, PFlash, concurrency, resident pool, preemption): `concurrency`
    requests of `prompt_len` seeded tokens, each generating `gen_tokens` (greedy, EOS
    ignored), submitted together, on a pool of `resident_tokens` positions per global KV group
    with a host store of `host_tokens` positions (None: enough for every request, so a swap never
    falls back to recompute) and `quantum` steps of residency (None: the engine's default).

    Every engine keeps its logits (`keep_logits=True`, the paged runs and the references alike)
    so that `outputs_identical` compares them; the throughput is generated tokens over the
    run's wall, from the first submit (PFlash's scoring included) to the last token.
    """
    import polars as pl

    from workbench.ablations import measurement_bar, next_measurement, prompt_ids
    from workbench.engine_config import EngineConfig

    default = EngineConfig()
    quantum = default.residency_quantum if quantum is None else quantum
    unknown = [p for p in pflash if p not in PFLASH]
    if unknown:
        raise WorkbenchError(f"pflash={unknown[0]!r} is not allowed: allowed {', '.join(PFLASH)}")
    context = model.config.context_length
    for prompt_len in prompt_lens:
        if "off" in pflash and prompt_len + gen_tokens > context:
            raise WorkbenchError(f"prompt_len={prompt_len} with gen_tokens={gen_tokens} does not fit the model's "
                                 f"context of {context} tokens uncompressed (pflash 'off'): allowed prompt_len <= "
                                 f"{context - gen_tokens}")
    base = dict(dtype=model.dtype_name, backend=backend)
    page = EngineConfig(**base).triton.page_size if backend == "triton" else model.state_layout.page_size
    warm = min(max(prompt_lens), WARM_UP_PROMPT_CAP, context - 2)
    warm_pool = -(-(warm + max(2, default.admission_headroom_tokens)) // page) * page  # a request's pages
    _warm_up(model, EngineConfig(max_concurrency=max(concurrency), **base), sorted(set(concurrency)), warm,
             warm_pool)
    labels = [f"prompt_len={n} pflash={pf} C={c} " + (f"pool={pool} {policy}" if pool else "all-resident")
              for n in prompt_lens for pf in pflash for c in concurrency
              for pool, policy in [(None, None)] + [(r, p) for r in resident_tokens for p in preemption]]
    rows = []
    with measurement_bar(labels, enabled=progress) as bar:
        for prompt_len in prompt_lens:
            for pf in pflash:
                for c in concurrency:
                    prompts = [prompt_ids(model, prompt_len, f"{seed}-cliff-{prompt_len}-{i}") for i in range(c)]
                    span = min(prompt_len, context - gen_tokens) + max(gen_tokens, default.admission_headroom_tokens)
                    per_request = -(-span // page) * page
                    ref_config = EngineConfig(max_concurrency=c, kv_resident_tokens=c * per_request,
                                              prompt_compression=PFLASH[pf], **base)
                    ref = _run(model, ref_config, prompts, gen_tokens)
                    if ref["recomputes"] or ref["pages_out"]:
                        raise WorkbenchError(f"the all-resident reference at concurrency={c}, prompt_len={prompt_len} "
                                             f"was preempted ({ref['recomputes']} recompute(s)): its pool of "
                                             f"{c * per_request} positions does not hold every request")
                    next_measurement(bar, labels)
                    host = c * per_request if host_tokens is None else host_tokens
                    for pool in resident_tokens:
                        for policy in preemption:
                            config = EngineConfig(max_concurrency=c, kv_resident_tokens=pool, kv_host_tokens=host,
                                                  preemption=policy, residency_quantum=quantum,
                                                  prompt_compression=PFLASH[pf], **base)
                            got = _run(model, config, prompts, gen_tokens)
                            rows.append(_row(model, got, ref, prompt_len=prompt_len, concurrency=c, pool=pool,
                                             pflash=pf, preemption=policy, host=host, quantum=quantum,
                                             backend=backend, gen_tokens=gen_tokens))
                            next_measurement(bar, labels)
    return pl.DataFrame(rows, infer_schema_length=None)


def measure_from_config(model, config: dict):
    """`measure_paging_cliff` with a validated config (`ablations.validate("paging-cliff", ...)`):
    what the notebook and scripts/paging_cliff_run.py both run."""
    return measure_paging_cliff(
        model, concurrency=config["concurrencies"], resident_tokens=config["resident_pools"],
        prompt_lens=config["prompt_lens"], gen_tokens=config["gen_tokens"], pflash=config["pflash_modes"],
        preemption=config["preemptions"], host_tokens=config["host_tokens"], quantum=config["quantum"],
        backend=config["backend"], seed=config["seed"], progress=config["progress"])


def _warm_up(model, config, concurrency: Sequence[int], prompt_len: int, pool_per_request: int) -> None:
    """A short generation at each concurrency, its prompts as long as the measured ones (up to
    WARM_UP_PROMPT_CAP), as ablations._warm_up does at one: so that no measurement pays the
    one-off costs of the first prefill of a length or the first batch of a size (measured on
    the CPU: without it the first all-resident run, C1's, ran at a fourteenth of C1's paged runs)."""
    from dataclasses import replace

    from workbench.ablations import prompt_ids
    from workbench.engine import Engine

    for c in concurrency:
        engine = Engine(model, replace(config, max_concurrency=c, kv_resident_tokens=c * pool_per_request))
        engine.generate([prompt_ids(model, prompt_len, f"warm-up-{i}") for i in range(c)], max_tokens=2,
                        ignore_eos=True)


def _run(model, config, prompts, gen_tokens: int) -> dict:
    """The prompts submitted together on a fresh engine, run to the end: results and counters."""
    from workbench.engine import Engine
    from workbench.telemetry import percentile

    engine = Engine(model, config, keep_logits=True)
    warm_steps = 0
    if config.backend == "triton":
        # the same shapes once untimed, on other prompts of the same lengths (no prefix hit on the
        # measured ones): CUDA graphs are captured per engine the first time a step shape needs
        # one, and a paged run meets shapes the warm-up's full batches never do (H200 run 76:
        # without this, C8's first arm ran at 0.27x its all-resident run and the second at 0.79x
        # on the same schedule)
        for i, p in enumerate(prompts):
            engine.submit([(t + 1) % model.config.vocab_size or 1 for t in p], max_tokens=gen_tokens,
                          ignore_eos=True, request_id=f"warm-{i}")
        engine.run_until_done()
        warm_steps = engine.telemetry.steps().height
    start = time.perf_counter()
    handles = [engine.submit(p, max_tokens=gen_tokens, ignore_eos=True, request_id=f"cliff-{i}")
               for i, p in enumerate(prompts)]
    engine.run_until_done()
    wall = time.perf_counter() - start
    results = [h.result() for h in handles]
    steps, reqs = engine.telemetry.steps(), engine.telemetry.requests()
    steps = steps.filter(steps["step"] >= warm_steps)
    reqs = reqs.filter(reqs["request_id"].str.starts_with("cliff-"))
    layout = engine.scheduler.allocator.layout
    pool_pages = engine.scheduler.kv_pool_pages
    global_groups = [g.name for g in layout.groups if not g.sliding] or [g.name for g in layout.groups]

    def total(column: str):
        """A step counter summed over the run; None where the engine has no host store."""
        if column not in steps.columns or steps[column].null_count() == steps.height:
            return None
        return steps[column].sum()

    ttft = reqs["ttft_s"].to_list()
    generated = sum(len(r.token_ids) for r in results)
    return {
        "results": results,
        "page_size": layout.page_size,
        "resident_pages": min(pool_pages[g] for g in global_groups),
        "wall_s": wall,
        "generated_tokens": generated,
        "decode_tok_s_aggregate": generated / wall,
        "ttft_s_p50": percentile(ttft, 50),
        "ttft_s_max": max(ttft),
        "pages_out": total("pages_out"),
        "pages_in": total("pages_in"),
        "bytes_out": total("bytes_out"),
        "bytes_in": total("bytes_in"),
        "transfer_ms": total("transfer_ms"),
        "swaps": int(reqs["num_swaps"].sum()),
        "recomputes": int(reqs["num_preemptions"].sum()),
        "recomputed_tokens": int(reqs["recomputed_tokens"].sum()),
        "max_wait_steps": int(reqs["max_wait_steps"].max()),
        "raw_prompt_tokens": int(reqs["raw_prompt_tokens"].sum()),
        "effective_prompt_tokens": int(reqs["effective_prompt_tokens"].sum()),
        "effective_prompt_lens": reqs["effective_prompt_tokens"].to_list(),
        "num_compressed": int(reqs["compressed"].sum()),
        # the scorer's seconds per compressed request (in its TTFT), and where it ran
        "compress_s_mean": reqs["compress_s"].mean(),
        "compress_device": next((d for d in reqs["compress_device"].to_list() if d is not None), None),
    }


def _row(model, got: dict, ref: dict, *, prompt_len, concurrency, pool, pflash, preemption, host, quantum,
         backend, gen_tokens) -> dict:
    import torch

    page = got["page_size"]
    spans = [n + gen_tokens for n in got["effective_prompt_lens"]]
    live_tokens, live_pages = sum(spans), sum(-(-s // page) for s in spans)
    tokens_same = [a.token_ids == b.token_ids for a, b in zip(got["results"], ref["results"])]
    logits_same = [a.logits is not None and b.logits is not None and torch.equal(a.logits, b.logits)
                   for a, b in zip(got["results"], ref["results"])]
    ok, flag = activation(live_kv_pages=live_pages, resident_pages=got["resident_pages"],
                          pages_out=got["pages_out"] or 0, recomputes=got["recomputes"], pflash=pflash,
                          num_compressed=got["num_compressed"])
    keep = ("wall_s", "generated_tokens", "decode_tok_s_aggregate", "ttft_s_p50", "ttft_s_max", "pages_out",
            "pages_in", "bytes_out", "bytes_in", "swaps", "recomputes", "recomputed_tokens", "transfer_ms",
            "max_wait_steps", "raw_prompt_tokens", "effective_prompt_tokens", "num_compressed", "compress_s_mean",
            "compress_device")
    return {
        "prompt_len": prompt_len,
        "concurrency": concurrency,
        "resident_tokens": pool,
        "resident_pages": got["resident_pages"],
        "page_size": page,
        "live_kv_tokens": live_tokens,
        "live_kv_pages": live_pages,
        "oversubscription": live_tokens / pool,
        "pflash": pflash,
        "prompt_compression": PFLASH[pflash],
        "preemption": preemption,
        "host_store_tokens": host,
        "quantum": quantum,
        "backend": backend,
        "gen_tokens": gen_tokens,
        "arm": f"{preemption} · pflash {pflash} · {prompt_len}-token prompts · {pool}-token pool",
        **{k: got[k] for k in keep},
        "resident_decode_tok_s_aggregate": ref["decode_tok_s_aggregate"],
        "resident_ttft_s_max": ref["ttft_s_max"],
        "resident_wall_s": ref["wall_s"],
        "throughput_vs_resident": got["decode_tok_s_aggregate"] / ref["decode_tok_s_aggregate"],
        "tokens_identical": all(tokens_same),
        "outputs_identical": all(tokens_same) and all(logits_same),
        "activation_ok": ok,
        "activation_flag": flag,
        "tokens_sha256": hashlib.sha256(json.dumps([r.token_ids for r in got["results"]]).encode()).hexdigest(),
        "model_name": str(model.source.get("general.name", model.path.stem)),
        "model_sha256": model.source.index.sha256,
    }


def activation(*, live_kv_pages: int, resident_pages: int, pages_out: int, recomputes: int, pflash: str,
               num_compressed: int) -> tuple[bool, str | None]:
    """Whether the row exercised what it is about, and if not, what showed none (one line).

    Paging: the requests' pages outnumbered the pool's, so pages had to move or be recomputed;
    neither happening means the excess waited in the admission queue. PFlash on: some prompt
    must have been compressed."""
    flags = []
    if live_kv_pages > resident_pages and pages_out + recomputes == 0:
        flags.append(f"live KV of {live_kv_pages} pages exceeds the pool's {resident_pages} but no page moved and "
                     "nothing was recomputed (the excess waited for admission)")
    if pflash == "on" and num_compressed == 0:
        flags.append("pflash on but no prompt was compressed (shorter than compression.auto_min_tokens)")
    return not flags, "; ".join(flags) or None


def differing(summary) -> str | None:
    """One line naming the rows whose tokens or logits differ from the all-resident run's; None
    when every row is identical."""
    bad = summary.filter(~summary["outputs_identical"])
    if not bad.height:
        return None
    cases = ", ".join(f"C={r['concurrency']} pool={r['resident_tokens']} {r['preemption']} pflash={r['pflash']} "
                      f"prompt_len={r['prompt_len']}" + ("" if r["tokens_identical"] else " (tokens too)")
                      for r in bad.head(5).iter_rows(named=True))
    return f"outputs differ from the all-resident run in {bad.height} measurement(s): {cases}"


def require_identical(summary) -> None:
    """Raise unless every row's tokens and logits equal its all-resident reference's."""
    line = differing(summary)
    if line:
        raise WorkbenchError(line)


def flagged(summary):
    """The rows whose activation check failed (what the notebook shows, and never hides)."""
    return summary.filter(~summary["activation_ok"])


def paging_cliff_charts(rows, data_dir: str | Path = "data") -> list:
    """The dashboard's paging-cliff views over tagged summary rows, then the rows' throughput
    beside seed 002's (`<data_dir>/reference/seeds.parquet`), each relative to its own
    one-sequence figure."""
    from workbench import dashboard
    from workbench.dashboard.reference import SEEDS_PATH, cliff_chart, read_table, reference_points

    charts = dashboard.ablation_charts("paging-cliff", rows)
    charts.append(cliff_chart(rows, reference_points(read_table(Path(data_dir) / SEEDS_PATH), None)))
    return charts
