"""`workbench bench`: throughput at several concurrencies, as tidy parquet in the run store.

For each concurrency C and repeat, C distinct prompts of `prompt_len` tokens run together for
`gen` tokens each (EOS ignored). Reported per measurement, in the shape of seed 000's table:

- prefill tok/s: the prompt tokens the run prefilled (the effective prompts, after prompt
  compression, less those served from the prefix cache, plus those prefilled again after a
  preemption) over the time until the last slot's first token (which includes the scoring);
- prompt tokens raw and effective: what was submitted and what was admitted (they differ only
  with `--prompt-compression`; `num_compressed` counts the requests that were compressed);
- decode tok/s aggregate: tokens produced by pure decode steps over those steps' time, each
  from its start to the next step's start (all the host spends on it), and per stream
  (aggregate / C); with `--spec` a verify step's tokens are its bursts (kept drafts and the
  target's own), and the row carries the verify steps, draft tokens and those kept;
- TTFT (mean, max), peak RSS, the engine's memory reservation;
- bandwidth floor: C * copy-bandwidth / weight-bytes-per-step, the decode rate no version can
  beat when every step streams the weights once; `fraction_of_floor` = measured / floor;
- matches_solo: slot 0's tokens equal the C=1 run of the same prompt (exactness evidence).

Progress goes to a `progress(line)` callback: the plan, then one line per measurement as it
finishes (its configuration and result), then the total wall time. The CLI prints them on stderr
(`--no-progress` drops them); the table goes to stdout.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from .errors import WorkbenchError

CORPUS = (
    "The history of computing is a history of memory. Early machines stored a few words in "
    "mercury delay lines; later ones in magnetic cores, then in transistors packed by the billion. "
    "Each step made memory larger and faster, yet processors grew faster still, and the gap between "
    "arithmetic and the bytes it consumes became the central problem of system design. Serving a "
    "language model is a clean example: every generated token reads every weight once, so a single "
    "sequence is limited by bandwidth, not by arithmetic. Running several sequences together lets "
    "one pass over the weights serve all of them. "
)


def bench_prompts(model, num: int, prompt_len: int, shared_prefix_len: int = 0) -> list[list[int]]:
    """`num` distinct prompts of exactly `prompt_len` tokens (BOS + text from rotated corpora); with
    `shared_prefix_len` (0 <= it < prompt_len, which `run_bench` checks before any work), each
    starts with the same that many tokens (a shared system prompt) and differs after it."""
    base = model.tokenize(CORPUS * (2 + 2 * prompt_len // 60), add_bos=False)
    bos = [model.tokenizer.bos_id] if model.tokenizer.bos_id is not None else []
    shared = (bos + base)[:shared_prefix_len] if shared_prefix_len else bos
    out = []
    for i in range(num):
        off = (i * 37 + (prompt_len if shared_prefix_len else 0)) % max(1, len(base) - prompt_len)
        body = base[off : off + prompt_len - len(shared)]
        out.append(shared + body)
    return out


def measure(model, concurrency: int, prompt_len: int, gen: int, chunk: int | None, policy: str = "decode-first",
            backend: str = "torch", head_matmul: str | None = None, triton=None, kv_resident_tokens: int | None = None,
            prefix_cache: bool = True, shared_prefix_len: int = 0, prompt_compression: str | float = "off",
            kv_host_tokens: int | None = None, preemption: str = "swap", residency_quantum: int = 32,
            eviction: str = "lru", speculation=None, qsa=None):
    """One measurement. ``qsa``: EngineConfig's (a QSAConfig, None: dense). ``speculation``: EngineConfig's (a SpecConfig, None: off). ``triton``: the triton backend's ``TritonOptions`` (None: the defaults).
    ``kv_resident_tokens`` / ``prefix_cache``: the paged runners' pool and prefix cache (EngineConfig);
    ``shared_prefix_len``: every prompt starts with the same that many tokens;
    ``prompt_compression``: EngineConfig's ("off", "auto" or a kept ratio); ``kv_host_tokens``,
    ``preemption``, ``residency_quantum``: host backing's (EngineConfig); ``eviction``: the prefix
    cache's ("lru" or "scored", EngineConfig)."""
    import polars as pl

    from .engine import Engine
    from .engine_config import EngineConfig, TritonOptions

    cfg = EngineConfig(max_concurrency=concurrency, chunk_size=chunk, policy=policy, dtype=model.dtype_name,
                       backend=backend, head_matmul=head_matmul, triton=triton or TritonOptions(),
                       kv_resident_tokens=kv_resident_tokens, prefix_cache=prefix_cache,
                       prompt_compression=prompt_compression, kv_host_tokens=kv_host_tokens,
                       preemption=preemption, residency_quantum=residency_quantum, speculation=speculation,
                       qsa=qsa, eviction=eviction)
    engine = Engine(model, cfg)
    prompts = bench_prompts(model, concurrency + 1, prompt_len, shared_prefix_len)
    prime, prompts = prompts[-1], prompts[:-1]
    ttft_cold = None
    if shared_prefix_len:
        # one request with the shared prefix first, alone: its TTFT is the cold one, and (prefix
        # cache on) its full pages are cached when the measured requests arrive
        ttft_cold = engine.generate([prime], max_tokens=1, ignore_eos=True)[0].ttft_s
    warm_steps = engine.telemetry.steps().height
    if backend == "triton":
        # the same run once untimed: CUDA graphs are captured per (row bucket, attention
        # segments) the first time a step needs one, which would land inside the timed steps
        engine.generate(prompts, max_tokens=gen, ignore_eos=True)
        warm_steps = engine.telemetry.steps().height
    draft = getattr(engine.speculator.proposer, "stats", None) if engine.speculator is not None else None
    draft0 = (draft.forwards, draft.seconds) if draft is not None else None
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_tokens=gen, ignore_eos=True)
    t1 = time.perf_counter()
    steps = engine.telemetry.steps()
    steps = steps.filter(steps["step"] >= warm_steps)
    # a step lasts until the next one starts (its telemetry record and the loop's own host work
    # included: a run-ahead device overlaps them, and the run is host-bound where they exceed the
    # device's step); the run's last step, until its bookkeeping ends
    until = steps["start_s"].shift(-1).fill_null(steps["start_s"] + steps["wall_ms"] / 1e3)
    steps = steps.with_columns((until - steps["start_s"]).alias("span_s"))
    dec = steps.filter(steps["phase"] == "decode")
    dec_tokens = int(dec["tokens_out"].sum()) if dec.height else 0
    dec_s = float(dec["span_s"].sum()) if dec.height else 0.0
    last_first = max(r.first_token_at for r in results)
    # Prefill tok/s counts the tokens the run prefilled: each effective prompt's tokens (the
    # admitted prompt, after compression) less those served from the prefix cache, plus those
    # prefilled again after a preemption (recomputation is prefill work the run did, and its
    # time is in the span). The span ends at the last slot's first token, so a recomputation
    # after it (a slot preempted once it had its first token) is counted without its time: a run
    # with preemptions (num_preemptions > 0) may overstate it. Compression's scoring runs at
    # submit, so its time is in the span too (compress_s says how much).
    prefill_tokens = sum(r.effective_prompt_tokens - r.cached_tokens + r.recomputed_tokens for r in results)
    prefill_s = last_first - t0
    ttfts = [r.ttft_s for r in results]
    paged = "prefix_hit_tokens" in steps.columns and steps["pages_used"].null_count() < steps.height

    def total(col: str):  # (proof of activation: what the paged state really did; None where unpaged)
        return int(steps[col].fill_null(0).sum()) if paged else None
    agg = dec_tokens / dec_s if dec_s > 0 else 0.0
    scored = [r.compression.scores for r in results if r.compression is not None and r.compression.scores]
    return {
        "prefill_tok_s": prefill_tokens / prefill_s,
        "prefill_tokens": prefill_tokens,
        "prefill_s": prefill_s,
        "raw_prompt_tokens": sum(r.raw_prompt_tokens for r in results),  # as submitted (what usage bills)
        "effective_prompt_tokens": sum(r.effective_prompt_tokens for r in results),  # as admitted
        # (proof of activation: the requests that compression shortened; None where it was off)
        "num_compressed": (None if prompt_compression == "off"
                           else sum(r.compression is not None and r.compression.compressed for r in results)),
        "compress_s": sum(sc.scorer_s for sc in scored) if scored else None,  # the scorer's time, in prefill_s
        "decode_tok_s_aggregate": agg,
        "decode_tok_s_per_stream": agg / concurrency,
        "ttft_s_mean": statistics.fmean(ttfts),
        "ttft_s_max": max(ttfts),
        "ttft_s_cold": ttft_cold,  # --shared-prefix-len: the priming request's TTFT, alone and cold
        "wall_s": t1 - t0,
        "peak_memory_bytes": engine.peak_memory_bytes,
        "kv_peak_bytes": engine.telemetry.peak_kv_bytes,
        "num_steps": steps.height,
        "num_solo_fallback": int(steps["num_solo"].sum()),
        "chunk_size_used": int(steps["chunk_size"].max()),
        "paged": paged,
        "prefix_hit_tokens": total("prefix_hit_tokens"),
        "cached_prompt_tokens": sum(r.cached_tokens for r in results) if paged else None,
        "recomputed_tokens": sum(r.recomputed_tokens for r in results),
        "num_preemptions": total("num_preemptions"),
        "pages_allocated": total("pages_allocated"),
        # cached prefix pages evicted for new ones (every group; the proof for eviction="scored")
        "pages_evicted": (int(steps.select(pl.sum_horizontal(pl.col("^pages_evicted_.*$").fill_null(0).sum())).item())
                          if paged and any(c.startswith("pages_evicted_") for c in steps.columns) else None),
        "pages_used_max": int(steps["pages_used"].max()) if paged else None,
        # host backing (None without a host store): pages and bytes moved, requests paged out,
        # the transfers' time, and the longest run of steps a request waited admitted
        "pages_out": total("pages_out") if kv_host_tokens else None,
        "pages_in": total("pages_in") if kv_host_tokens else None,
        "bytes_out": total("bytes_out") if kv_host_tokens else None,
        "bytes_in": total("bytes_in") if kv_host_tokens else None,
        "num_swaps": total("swaps_out") if kv_host_tokens else None,
        "transfer_ms": float(steps["transfer_ms"].fill_null(0).sum()) if kv_host_tokens else None,
        "max_wait_steps": max(r.max_wait_steps for r in results),
        # speculation (None when off): verify steps, draft tokens verified and kept, tokens per verify
        "spec_verify_steps": sum(r.spec.verify_steps for r in results) if speculation else None,
        "spec_drafted": sum(r.spec.drafted for r in results) if speculation else None,
        "spec_accepted": sum(r.spec.accepted for r in results) if speculation else None,
        # shadow drafts checked at k = 0 (n-gram and suffix: acceptance measured without verifying)
        "spec_shadows": sum(r.spec.shadows for r in results) if speculation else None,
        # token trees: alternative paths verified, and verifies an alternative won (0 with chains)
        "spec_tree_paths": sum(r.spec.tree_paths for r in results) if speculation else None,
        "spec_tree_wins": sum(r.spec.tree_wins for r in results) if speculation else None,
        # the pipeline's half steps (SpecConfig.pipeline; 0 when it never started)
        "spec_pipelined_steps": int(steps["pipelined"].sum()) if speculation else None,
        "draft_yield": (sum(r.spec.emitted for r in results) / max(1, sum(r.spec.verify_steps for r in results))
                        if speculation else None),
        # a draft model's forwards and their wall time (self / draft proposers; None otherwise)
        "draft_forwards": draft.forwards - draft0[0] if draft is not None else None,
        "draft_ms": 1e3 * (draft.seconds - draft0[1]) if draft is not None else None,
        # QSA (None when off): row-layers that attended sparsely past the boundary, blocks they kept
        "qsa_sparse_rows": int(steps["qsa_sparse_rows"].sum()) if qsa is not None else None,
        "qsa_blocks_kept": int(steps["qsa_blocks_kept"].sum()) if qsa is not None else None,
        "weight_bytes": engine.runner.step_weight_bytes,  # read per decode step: the floor's bytes
        "resident_weight_bytes": engine.runner.fixed_bytes,
    }, [r.token_ids for r in results]


def run_bench(model, *, concurrency: list[int], prompt_len: int, gen: int, chunk: int | None,
              repeats: int, data_dir: str, backend: str = "torch", head_matmul: str | None = None,
              triton=None, kv_resident_tokens: int | None = None, prefix_cache: bool = True,
              shared_prefix_len: int = 0, prompt_compression: str | float = "off",
              kv_host_tokens: int | None = None, preemption: str = "swap", residency_quantum: int = 32,
              eviction: str = "lru", speculation=None, qsa=None, progress=print) -> tuple[object, list[dict]]:
    """``triton``: the triton backend's ``TritonOptions`` for every engine of the run (None: the
    defaults); the run's params record the options that differ from them (``triton_options``).
    ``prompt_compression``: EngineConfig's, for every engine of the run."""
    from .engine_config import EngineConfig, TritonOptions
    from .hardware import measure_copy_bandwidth
    from .runstore import RunStore

    # (a bad combination: one line, before any work)
    config = EngineConfig(backend=backend, head_matmul=head_matmul, triton=triton or TritonOptions(),
                          kv_resident_tokens=kv_resident_tokens, prefix_cache=prefix_cache,
                          prompt_compression=prompt_compression, kv_host_tokens=kv_host_tokens,
                          preemption=preemption, residency_quantum=residency_quantum, speculation=speculation,
                          qsa=qsa, eviction=eviction)
    # (head_matmul included in triton: EngineConfig keeps the two in step; the ratio as a float)
    opts = dict(triton=config.triton, kv_resident_tokens=kv_resident_tokens, prefix_cache=prefix_cache,
                prompt_compression=config.prompt_compression, kv_host_tokens=kv_host_tokens,
                preemption=preemption, residency_quantum=residency_quantum, speculation=speculation, qsa=qsa,
                eviction=eviction)
    compression = compression_text(config.prompt_compression)
    # the one check of the shared prefix's range (bench_prompts relies on it): here, before the
    # bandwidth probe, the warm-up and the run store, for the CLI and callers alike
    if not 0 <= shared_prefix_len < prompt_len:
        raise WorkbenchError(f"--shared-prefix-len {shared_prefix_len} is out of range: allowed 0..{prompt_len - 1} "
                             f"(below --prompt-len {prompt_len})")

    if kv_host_tokens is not None:  # (the engine refuses such a request at add; here, before any work)
        P = config.triton.page_size if backend == "triton" else model.state_layout.page_size
        need = -(-(prompt_len + gen) // P) * P
        if -(-kv_host_tokens // P) * P < need:
            raise WorkbenchError(f"--kv-host-tokens {kv_host_tokens} cannot hold one request of --prompt-len "
                                 f"{prompt_len} + --gen {gen} ({need} positions in pages of {P}): allowed >= {need}")
    if prompt_len + gen > model.config.context_length:
        raise WorkbenchError(
            f"prompt-len {prompt_len} + gen {gen} exceeds the model context of {model.config.context_length}"
        )
    params = {
        "model": str(model.path.name),
        "model_sha256": model.source.index.sha256,
        "dtype": model.dtype_name,
        "backend": backend,
        "head_matmul": config.head_matmul or "default",
        "triton_options": options_text(config.triton) or "default",
        "prompt_len": prompt_len,
        "gen": gen,
        "chunk": chunk if chunk is not None else "auto",
        "repeats": repeats,
        "kv_resident_tokens": kv_resident_tokens if kv_resident_tokens is not None else "auto",
        "prefix_cache": prefix_cache,
        "shared_prefix_len": shared_prefix_len,
        "prompt_compression": compression,
        "kv_host_tokens": kv_host_tokens if kv_host_tokens is not None else "none",
        "preemption": preemption,
        "residency_quantum": residency_quantum,
        "eviction": eviction,
        "speculation": spec_text(speculation),
        "qsa": "off" if qsa is None else qsa.text(),
    }
    from .cli import format_duration

    started = time.perf_counter()
    num = len(concurrency) * repeats
    progress(f"bench: {num} measurement{'s' if num != 1 else ''} (concurrency {','.join(map(str, concurrency))}"
             f" x {repeats} repeat{'s' if repeats != 1 else ''}), prompt {prompt_len} tokens, gen {gen} tokens, "
             f"backend {backend}, {model.dtype_name}"
             + (f", triton options {options_text(config.triton)}" if config.triton.changed() else "")
             + (f", prompt compression {compression}" if compression != "off" else ""))
    import torch

    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    bw = measure_copy_bandwidth(device)
    progress(f"copy bandwidth ({device}) {bw / 1e9:.1f} GB/s; warming up")
    # warm-up: allocators, thread pools, first-touch of the weights, kernel compilation
    measure(model, 1, min(prompt_len, 32), 4, chunk, backend=backend, **opts)
    rows = []
    solo_tokens = None
    store = RunStore(data_dir)
    with store.start_run("bench", params) as run:
        for c in concurrency:
            for r in range(repeats):
                t_measure = time.perf_counter()
                m, toks = measure(model, c, prompt_len, gen, chunk, backend=backend,
                                  shared_prefix_len=shared_prefix_len, **opts)
                if c == 1 and solo_tokens is None:
                    solo_tokens = toks[0]
                floor = c * bw / m["weight_bytes"]
                row = {
                    "concurrency": c,
                    "repeat": r,
                    **m,
                    "copy_bandwidth_bytes_s": bw,
                    "bandwidth_floor_tok_s": floor,
                    "fraction_of_floor": m["decode_tok_s_aggregate"] / floor,
                    "matches_solo": None if solo_tokens is None else toks[0] == solo_tokens,
                }
                row["flag"] = activation_flag(row, prefix_cache=prefix_cache, shared_prefix_len=shared_prefix_len,
                                              prompt_compression=config.prompt_compression,
                                              host_backing=kv_host_tokens is not None,
                                              speculation=speculation is not None,
                                              tree=speculation is not None and speculation.tree is not None,
                                              pipeline=(speculation is not None and speculation.pipeline != "auto"
                                                        and 0 < speculation.pipeline <= c),
                                              qsa_boundary=None if qsa is None else qsa.dense_positions,
                                              scored_eviction=eviction == "scored")
                rows.append(row)
                if row["flag"]:
                    progress(f"bench: FLAGGED: {row['flag']}")
                exact = {None: "", True: ", exact vs solo", False: ", DIFFERS from solo"}[row["matches_solo"]]
                kept = (f", prompt tokens {m['effective_prompt_tokens']} of {m['raw_prompt_tokens']} admitted"
                        if config.prompt_compression != "off" else "")
                progress(
                    f"[{len(rows)}/{num}] concurrency {c}, prompt {prompt_len}, repeat {r + 1}/{repeats}: "
                    f"decode {m['decode_tok_s_aggregate']:.1f} tok/s aggregate ({row['fraction_of_floor']:.2f} of "
                    f"the floor), prefill {m['prefill_tok_s']:.1f} tok/s, TTFT max {m['ttft_s_max']:.2f} s"
                    f"{kept}{exact} "
                    f"({format_duration(time.perf_counter() - t_measure)})"
                )
        run.write_rows("summary", rows)
    progress(f"bench: {num} measurement{'s' if num != 1 else ''} in {format_duration(time.perf_counter() - started)}")
    return run, rows


def activation_flag(row: dict, *, prefix_cache: bool, shared_prefix_len: int,
                    prompt_compression: str | float = "off", host_backing: bool = False,
                    speculation: bool = False, tree: bool = False, qsa_boundary: int | None = None,
                    scored_eviction: bool = False, pipeline: bool = False) -> str | None:
    """Why a measurement that asked for a feature shows none of it (None when each asked-for
    feature ran; each feature's reason, joined by "; ", when several did not): a shared prefix
    with the cache on must show prefix-hit tokens, on a paged runner; prompt compression must
    have compressed at least one request ("auto" leaves prompts below its threshold whole); host
    backing must have paged a page out or recomputed a request (else the pool held everything);
    speculation must have verified a draft, and with the pipeline asked at the concurrency it
    starts at (a number of slots; "auto" is the default, not asked), run half steps."""
    why = []
    if shared_prefix_len and prefix_cache:
        if not row.get("paged"):
            why.append("a shared prefix with the prefix cache asked, but the runner is not paged (no prefix cache ran)")
        elif not row.get("prefix_hit_tokens"):
            why.append("a shared prefix with the prefix cache asked, but no prompt token came from the cache")
    if prompt_compression != "off" and not row.get("num_compressed"):
        whole = ("auto leaves a prompt below its threshold whole" if prompt_compression == "auto"
                 else "a prompt too short for the ratio to drop a whole block is admitted whole")
        why.append(f"prompt compression {compression_text(prompt_compression)} asked, but no prompt was "
                   f"compressed ({whole})")
    if host_backing and not (row.get("pages_out") or row.get("num_preemptions")):
        why.append("host backing asked, but no page was paged out and no request recomputed (the resident "
                   "pool held every request's KV: lower --kv-resident-tokens or raise the concurrency)")
    if speculation and not row.get("spec_verify_steps"):
        why.append("speculation asked, but no draft was verified (the proposer found nothing, or the guard kept "
                   "every slot at k=0)")
    if tree and row.get("spec_verify_steps") and not row.get("spec_tree_paths"):
        why.append("token trees asked, but no alternative path was verified (the proposer offered one path "
                   "only, or the forks' pages did not fit)")
    if pipeline and row.get("spec_verify_steps") and not row.get("spec_pipelined_steps"):
        why.append("the pipeline asked at this concurrency, but no step ran as a half (no step drafted in both "
                   "halves, or requests kept waiting for slots)")
    if speculation and row.get("draft_forwards") == 0:
        why.append("a draft model asked, but it ran no forward (the guard kept every slot at k=0, or its KV "
                   "pool had no room: raise SpecConfig.draft_kv_tokens)")
    if scored_eviction and not row.get("pages_evicted"):
        why.append("eviction='scored' asked, but no cached page was evicted (the pool held every cached page: "
                   "lower --kv-resident-tokens, or run more distinct prompts than it holds)")
    if qsa_boundary is not None and not row.get("qsa_sparse_rows"):
        why.append(f"QSA asked, but no row attended sparsely (every context stayed within its boundary of "
                   f"{qsa_boundary} positions: raise --prompt-len or lower top_k)")
    return "; ".join(why) or None


def spec_text(spec) -> str:
    """'off', or the speculation's proposer and k ("ngram:k4"; "+tree12" with a node budget,
    "+noguard" with the guard off, "+cohort" with seed 002's rule, "+pipeline8" with the pipeline
    from 8 slots, "+nopipeline" with it off; nothing where it is "auto", the default)."""
    if spec is None:
        return "off"
    name = {"self": f"self:{spec.draft_layers}", "draft": f"draft:{os.path.basename(spec.draft_model or '')}"}
    return (f"{name.get(spec.proposer, spec.proposer)}:k{spec.k}" + ("" if spec.tree is None else f"+tree{spec.tree}")
            + {True: "", False: "+noguard", "cohort": "+cohort"}[spec.guard]
            + {"auto": "", 0: "+nopipeline"}.get(spec.pipeline, f"+pipeline{spec.pipeline}"))


def compression_text(mode: str | float) -> str:
    """'off', 'auto' or the ratio as the request records write it (0.5 -> '0.5', 1.0 -> '1')."""
    return mode if isinstance(mode, str) else f"{mode:g}"


def options_text(options) -> str:
    """The options that differ from the defaults, as ``TritonOptions.parse`` reads them back
    ("name=value,..."; "" for the defaults)."""
    def value(name: str, v) -> str:
        if name == "layer_forms":
            return "+".join(f"{fmt}:{form}" for fmt, form in v)
        return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return ",".join(f"{name}={value(name, getattr(options, name))}" for name in options.changed())


def format_table(rows: list[dict]) -> str:
    by_c: dict[int, list[dict]] = {}
    for r in rows:
        by_c.setdefault(r["concurrency"], []).append(r)
    base = None
    lines = [
        "| slots | prefill tok/s | decode tok/s per stream | decode tok/s aggregate | vs 1 slot | TTFT max s | peak RSS GiB | floor tok/s | exact vs solo |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for c in sorted(by_c):
        rs = by_c[c]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        agg = med("decode_tok_s_aggregate")
        if c == 1:
            base = agg
        ratio = f"{agg / base:.2f}x" if base else "-"
        exact = {r["matches_solo"] for r in rs}
        lines.append(
            f"| {c} | {med('prefill_tok_s'):.1f} | {med('decode_tok_s_per_stream'):.1f} | {agg:.1f} | {ratio} | "
            f"{med('ttft_s_max'):.2f} | {med('peak_memory_bytes') / 2**30:.2f} | {med('bandwidth_floor_tok_s'):.0f} | "
            f"{'yes' if exact == {True} else 'n/a' if exact == {None} else 'NO'} |"
        )
    return "\n".join(lines)


def _cmd_bench(args) -> int:
    from .model import load_model

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    args.speculation = None
    if args.spec is not None or args.spec_tree is not None:
        from .spec import SpecConfig

        # (a bad combination: one line, before the model loads; --spec-tree without --spec too)
        args.speculation = SpecConfig(**(args.spec or {"proposer": SpecConfig.proposer}), k=args.spec_k,
                                      tree=args.spec_tree, guard=args.spec_guard, pipeline=args.spec_pipeline)
    model = load_model(args.model, dtype=args.dtype)
    run, rows = run_bench(model, concurrency=args.concurrency, prompt_len=args.prompt_len, gen=args.gen,
                          chunk=args.chunk, repeats=args.repeats, data_dir=args.data_dir, backend=args.backend,
                          head_matmul=args.head_matmul, triton=args.triton_options,
                          kv_resident_tokens=args.kv_resident_tokens, prefix_cache=args.prefix_cache,
                          shared_prefix_len=args.shared_prefix_len, prompt_compression=args.prompt_compression,
                          kv_host_tokens=args.kv_host_tokens, preemption=args.preemption,
                          residency_quantum=args.residency_quantum, eviction=args.eviction,
                          speculation=args.speculation, qsa=args.qsa,
                          progress=progress if args.progress else lambda line: None)
    print(format_table(rows))
    if args.shared_prefix_len:
        for r in rows:
            hit = r["ttft_s_mean"]
            print(f"shared prefix {args.shared_prefix_len}, concurrency {r['concurrency']}: TTFT alone and cold "
                  f"{r['ttft_s_cold']:.3f} s, measured requests {hit:.3f} s mean ({r['ttft_s_cold'] / hit:.1f}x), "
                  f"prefix-hit tokens {r['prefix_hit_tokens']}" + (f" -- FLAGGED: {r['flag']}" if r["flag"] else ""))
    if args.prompt_compression != "off":
        for r in rows:
            print(f"prompt compression {compression_text(args.prompt_compression)}, concurrency {r['concurrency']}: prompt tokens "
                  f"{r['raw_prompt_tokens']} raw, {r['effective_prompt_tokens']} admitted, {r['num_compressed']} of "
                  f"{r['concurrency']} requests compressed" + (f" -- FLAGGED: {r['flag']}" if r["flag"] else ""))
    if args.kv_host_tokens is not None:
        for r in rows:
            print(f"host backing, concurrency {r['concurrency']}: pages out/in {r['pages_out']}/{r['pages_in']} "
                  f"({(r['bytes_out'] + r['bytes_in']) / 2**20:.1f} MiB, {r['transfer_ms']:.1f} ms), requests paged out "
                  f"{r['num_swaps']} times, recomputed {r['num_preemptions']}, longest wait {r['max_wait_steps']} steps"
                  + (f" -- FLAGGED: {r['flag']}" if r["flag"] else ""))
    if args.speculation is not None:
        for r in rows:
            print(f"speculation {spec_text(args.speculation)}, concurrency {r['concurrency']}: {r['spec_verify_steps']} "
                  f"verify steps, {r['spec_accepted']} of {r['spec_drafted']} draft tokens kept, "
                  f"{r['draft_yield']:.2f} tokens per verify" + (f" -- FLAGGED: {r['flag']}" if r["flag"] else ""))
    if args.qsa is not None:
        for r in rows:
            print(f"qsa {args.qsa.text()} (boundary {args.qsa.dense_positions}), concurrency {r['concurrency']}: "
                  f"{r['qsa_sparse_rows']} sparse row-layers, {r['qsa_blocks_kept']} blocks kept"
                  + (f" -- FLAGGED: {r['flag']}" if r["flag"] else ""))
    print(f"results: {run.path}")
    return 0


def _triton_options(text: str):
    """--triton-options' type: ``TritonOptions.parse``, its one-line error as argparse's."""
    import argparse

    from .engine_config import ConfigError, TritonOptions

    try:
        return TritonOptions.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec_pipeline(text: str) -> str | int:
    """--spec-pipeline's type: auto or a number of slots (SpecConfig checks the number's range)."""
    import argparse

    if text == "auto" or text.isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not allowed: allowed auto, 0 (off) or the slots it starts at")


def _prompt_compression(text: str) -> str | float:
    """--prompt-compression's type: off, auto or a ratio, as `compression.check_ratio` allows."""
    import argparse

    from .compression import check_ratio
    from .errors import ConfigError

    allowed = "allowed off, auto or a ratio in (0, 1]"
    try:
        value = text if text in ("off", "auto") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {allowed}") from None
    try:
        return check_ratio(value)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text} is out of range: {allowed}") from None


def _qsa(text: str):
    """--qsa's type: ``QSAConfig.parse``, its one-line error as argparse's."""
    import argparse

    from .errors import ConfigError
    from .qsa import QSAConfig

    try:
        return QSAConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec_proposer(text: str) -> dict:
    """--spec's value as SpecConfig fields (spec.proposer_fields)."""
    import argparse

    from .errors import ConfigError
    from .spec import proposer_fields

    try:
        return proposer_fields(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register_cli(sub) -> None:
    from dataclasses import fields

    from .cli import add_model_args, int_list, int_range
    from .compression import CompressionOptions
    from .engine_config import EVICTIONS, HEAD_MATMULS, PREEMPTIONS, EngineConfig, TritonOptions

    from .spec import MAX_K, SpecConfig
    from .spec.config import AUTO_PIPELINE

    auto = CompressionOptions()  # (--prompt-compression's help: the auto threshold and target)

    p = sub.add_parser(
        "bench", help="throughput at several concurrencies (tidy parquet in the run store)",
        description="Measure prefill and decode throughput, TTFT and memory at each concurrency: C distinct "
        "prompts run together, EOS ignored. Progress on stderr, a table on stdout, one parquet row per "
        "measurement in the run store.",
    )
    p.add_argument("--concurrency", type=int_list(1, 64), default=[1, 2, 4, 8], metavar="C,C,...",
                   help="concurrencies to measure, a comma list of 1..64")
    p.add_argument("--prompt-len", type=int_range(1), default=512, metavar="N", help="tokens in each prompt")
    p.add_argument("--gen", type=int_range(1), default=128, metavar="N", help="tokens generated per prompt")
    p.add_argument("--chunk", type=int_range(1), default=None, metavar="ROWS",
                   help="prefill rows per step (default: auto, sized from the memory budget)")
    p.add_argument("--repeats", type=int_range(1, 100), default=1, metavar="N",
                   help="measurements per concurrency")
    p.add_argument("--data-dir", default="data", metavar="DIR", help="run store root the results go to")
    p.add_argument("--no-progress", "--quiet", dest="progress", action="store_false",
                   help="no progress lines on stderr (the plan, each measurement as it finishes, the total time)")
    p.add_argument("--backend", default="torch", choices=["torch", "triton"],
                   help="torch: the CPU reference path; triton: the kernels (a GPU, or the CPU interpreter)")
    p.add_argument("--head-matmul", default=None, choices=list(HEAD_MATMULS),
                   help="triton: the output head's form (default: int8 MMAs for a bfloat16 engine's Q8_0 head, "
                        "llama.cpp's numerics; 'dense': its dequantized copy)")
    p.add_argument("--triton-options", type=_triton_options, default=None, metavar="NAME=VALUE,...",
                   help="triton: the runner's options (TritonOptions, workbench/runners/triton_options.py: "
                        f"{', '.join(f.name for f in fields(TritonOptions))}), e.g. 'pdl=false,attn_segment=32'; "
                        "booleans true/false, layer_forms as Q8_0:gemv+Q4_K:mma (default: the measured best, "
                        "docs/GPU_NOTES.md)")
    p.add_argument("--kv-resident-tokens", type=int_range(1), default=None, metavar="N",
                   help="positions each global KV group's page pool holds (a sliding group's: what every "
                        "slot's window spans; default: what the memory budget allows)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="no prefix cache across requests")
    p.add_argument("--shared-prefix-len", type=int_range(0), default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a shared system prompt); one request "
                        "with it runs alone first, and its TTFT is recorded as ttft_s_cold (0: no shared prefix)")
    p.add_argument("--kv-host-tokens", type=int_range(1), default=None, metavar="N",
                   help="host backing: positions of each global KV group's host store (requests beyond the "
                        "resident pool are admitted and turn over, paged out to it; default: none)")
    p.add_argument("--preemption", default=EngineConfig.preemption, choices=list(PREEMPTIONS),
                   help="host backing: a request evicted for pages is paged out (swap) or recomputed")
    p.add_argument("--eviction", default=EngineConfig.eviction, choices=list(EVICTIONS),
                   help="paged: which cached prefix pages leave first, the least recently used or the least "
                        "attended (scored: by the attention mass each page received)")
    p.add_argument("--residency-quantum", type=int_range(1), default=EngineConfig.residency_quantum, metavar="STEPS",
                   help="host backing: steps a paged-in request runs before it may be paged out for a waiting one")
    p.add_argument("--prompt-compression", type=_prompt_compression, default=EngineConfig.prompt_compression,
                   metavar="off|auto|RATIO",
                   help="compress each prompt before admission (PFlash, workbench/compression.py): auto (prompts "
                        f"of {auto.auto_min_tokens}+ tokens keep about {auto.auto_kept_tokens}) or the fraction "
                        "kept, in (0, 1]; prefill tok/s then counts the admitted tokens")
    p.add_argument("--spec", default=None, type=_spec_proposer, metavar="ngram|suffix|self:K|draft:PATH",
                   help="speculative decoding with this draft proposer (workbench/spec): n-gram, suffix, the "
                        "model's first K layers and its head, or a draft GGUF with its tokenizer (default: off)")
    p.add_argument("--spec-k", type=int_range(1, MAX_K), default=SpecConfig.k, metavar="K",
                   help=f"--spec: the most draft tokens a slot verifies per step, 1..{MAX_K}")
    p.add_argument("--spec-tree", type=int_range(1), default=None, metavar="N",
                   help="--spec: token trees with a node budget of N draft tokens per slot per step across "
                        "its paths (more than --spec-k; default: linear chains)")
    p.add_argument("--spec-pipeline", type=_spec_pipeline, default=SpecConfig.pipeline, metavar="auto|N",
                   help="--spec: from N decoding slots on, the slots' halves verify in turn, one half's host work "
                        "under the other's forward (n-gram and suffix chains; outputs unchanged; 0: off; default "
                        f"auto: from {AUTO_PIPELINE} slots on with the triton backend)")
    p.add_argument("--no-spec-guard", dest="spec_guard", action="store_false",
                   help="--spec: every slot drafts what its proposer offers, up to K (default: the yield guard)")
    p.add_argument("--qsa", type=_qsa, default=None, metavar="on|NAME=VALUE,...",
                   help="QSA sparse attention (workbench/qsa.py; both backends): 'on' (top 512 blocks of 4, one "
                        "sink and one local block) or options, e.g. 'top_k=256,block=8,summary=minmax' (default: off)")
    add_model_args(p)
    p.set_defaults(func=_cmd_bench)
