"""Exactness check and decode benchmarks of the Triton backend on a CUDA GPU (scripts/gpu_run.sh).

    python scripts/gpu_bench.py main  --model M.gguf --out DIR   # exactness + triton/cuBLAS/engine
    python scripts/gpu_bench.py hf    --model M.gguf --out DIR   # transformers on the same GGUF
    python scripts/gpu_bench.py table DIR                         # print the summary table
    python scripts/gpu_bench.py parquet data/gpu/h200_bench.parquet DIR...   # here, with polars

Every stage writes JSON into DIR as soon as it has a result, so a stage that fails or runs out
of time leaves what came before. Decode rates: N slots, 128-token random prompts, 128 greedy
tokens; "tok/s" is aggregate (N * steps / decode time; prefill excluded). ``STAGES=a,b`` picks
stages (main_stage lists them); every runner takes ``TritonOptions`` (GPU_BENCH_OPTIONS=
'name=value,...' is the base each stage's own fields go over), never patched module globals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT, GEN = 128, 128
SLOTS = tuple(int(x) for x in os.environ.get("GPU_BENCH_SLOTS", "1,4,16,32").split(","))


def log(*a):
    print(*a, flush=True)


def dump(out: Path, name: str, obj) -> None:
    (out / name).write_text(json.dumps(obj, indent=1, default=str))


def fingerprint() -> dict:
    try:
        from workbench.hardware import fingerprint as fp

        return fp()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}


def copy_bandwidth() -> float:
    """bytes/s of a 2 GiB device-to-device copy, read + write counted (median of 10)."""
    import torch

    n = 1 << 29
    x = torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * n * 4 / sorted(ts)[len(ts) // 2]


def weight_bytes(r) -> int:
    """Raw GGUF bytes one decode step reads: every layer projection, the norms, the head."""
    n = sum(w.fmt.row_bytes(w.K) * w.N for L in r.layers for p in (L.qkv, L.wo, L.gate_up, L.down) for _, w in p.parts)
    n += sum(4 * t.numel() for L in r.layers for t in vars(L).values() if hasattr(t, "numel") and t.dtype == __import__("torch").float32)
    h = r.head.parts[0][1]
    return n + h.fmt.row_bytes(h.K) * h.N


def kv_bytes_step(cfg, positions, elem: int) -> int:
    """KV bytes attention reads for rows at these positions (each sees keys 0..pos, windowed)."""
    total = 0
    for p in positions:
        for li in range(cfg.n_layers):
            w = cfg.layer_window(li)
            total += (min(p + 1, w) if w else p + 1) * 2 * cfg.kv_dim * elem
    return total


def prompts_for(n: int, vocab: int, seed: int, length: int = PROMPT):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


# ---- exactness ----------------------------------------------------------------------------------

EXACT_SIZES = ((4, dict(temperature=0.8, top_p=0.95, seed=11)), (16, dict(temperature=0.0)))
EXACT_32 = EXACT_SIZES + ((32, dict(temperature=0.0)),)  # (32 rows: the int8 head's 32-row tiles, one row alone 16)


def options(**kw):
    """The stage's TritonOptions: GPU_BENCH_OPTIONS ('name=value,...', TritonOptions.parse) with
    the stage's own fields over it."""
    from workbench.runners.triton_options import TritonOptions

    return replace(TritonOptions.parse(os.environ.get("GPU_BENCH_OPTIONS", "")), **kw)


def stage_exact(m, out: Path, rows: list, sizes=EXACT_SIZES, opts=None) -> None:
    """Engine batches of N requests (prompts 3..700 tokens) against each request alone: tokens and
    float32 logits bitwise, for each (N, sampling) of ``sizes``."""
    import torch

    from workbench import Engine, EngineConfig

    opts = opts or options()
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = [600, 5, 37, 128, 300, 64, 17, 520, 200, 90, 3, 256, 700, 45, 11, 150]
    lens += [n + 7 for n in lens]  # (32 requests at most)
    prompts = [torch.randint(10, V, (n,), generator=g).tolist() for n in lens]
    for N, kw in sizes:
        ps = prompts[:N]
        cfg = EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=N, max_context=1024,
                           memory_budget_bytes=64 << 30, chunk_size=256, triton=opts)
        t0 = time.perf_counter()
        eng = Engine(m, cfg, keep_logits=True)
        batched = eng.generate(ps, max_tokens=32, ignore_eos=True, **kw)
        tb = time.perf_counter() - t0
        solo_eng = Engine(m, replace(cfg, max_concurrency=1, chunk_size=None), keep_logits=True)
        t0 = time.perf_counter()
        solo = [solo_eng.submit(p, index=i, max_tokens=32, ignore_eos=True, **kw).result() for i, p in enumerate(ps)]
        ts = time.perf_counter() - t0
        tok_eq = [b.token_ids == s.token_ids for b, s in zip(batched, solo)]
        lg_eq = [torch.equal(b.logits.cpu(), s.logits.cpu()) for b, s in zip(batched, solo)]
        graphs = eng.runner.graphs.keys if eng.runner.graphs is not None else []
        row = dict(stage="exact", check=f"{N} slots vs solo", slots=N, prompt_lens=lens[:N], sampling=str(kw),
                   options=str(opts.changed()), tokens_equal=all(tok_eq), logits_equal=all(lg_eq),
                   requests_differing=[i for i, (a, b) in enumerate(zip(tok_eq, lg_eq)) if not (a and b)],
                   batched_s=tb, solo_s=ts, graphs=str(graphs))
        log("EXACT", row)
        rows.append(row)
        dump(out, "exact.json", rows)
        del eng, solo_eng, batched, solo
        torch.cuda.empty_cache()


def _runner(m, opts, capacity: int = 1024):
    """A TritonRunner with ``opts`` and its pages (DirectPages: room for 64 sequences of
    ``capacity`` positions in every KV group), for stages that drive the runner directly."""
    from workbench.runners.direct_pages import DirectPages
    from workbench.runners.triton_runner import TritonRunner

    r = TritonRunner(m, capacity, opts)
    return r, DirectPages(r, 64 * capacity)


def _decode_rows(pages, rids, toks, starts, steps: int):
    """Decode segments for ``decode_loop`` (slot i: sequence rids[i], token toks[i] at starts[i]),
    their tables covering ``steps`` positions."""
    return [pages.segment(sl, rid, (int(t),), p, reserve=steps) for sl, (rid, t, p) in enumerate(zip(rids, toks, starts))]


def _prefill(m, r, pages, slots: int) -> tuple[list[int], list[int]]:
    """Prefill slots 0..slots-1 of runner r (its DirectPages ``pages``) with seeded prompts of 3..700 tokens: (their
    lengths, each slot's first greedy token)."""
    import torch

    g = torch.Generator().manual_seed(0)
    lens = [600, 5, 37, 128, 300, 64, 17, 520, 200, 90, 3, 256, 700, 45, 11, 150][:slots]
    prompts = [torch.randint(10, m.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    toks = [int(r.run([pages.segment(sl, f"p{sl}", tuple(p), 0)], {sl: 1024})[sl].argmax())
            for sl, p in enumerate(prompts)]
    return lens, toks


def _graphed_logits(m, opts, slots: int = 16, steps: int = 8):
    """Logits [steps, slots, vocab] of graphed decode steps after prefilling prompts 3..700 (a
    TritonRunner with ``opts``), and its launches per step."""
    import torch

    r, pages = _runner(m, opts)
    lens, toks = _prefill(m, r, pages, slots)
    logits = []
    for t in range(steps):
        o = r.run([pages.segment(sl, f"p{sl}", (toks[sl],), lens[sl] + t) for sl in range(slots)],
                  {sl: 1024 for sl in range(slots)})
        logits.append(torch.stack([o[sl].float().cpu() for sl in range(slots)]))
        toks = [int(o[sl].argmax()) for sl in range(slots)]
    launches = r.launches
    del r
    torch.cuda.empty_cache()
    return torch.stack(logits), launches


def stage_same_bits(m, out: Path, rows: list, label: str, opts) -> None:
    """Options that claim to change no bit (a fold against its unfolded form, ordering only):
    the defaults' logits against ``opts``', 16 slots x 8 graphed steps, bitwise equal?"""
    import torch

    base, nb = _graphed_logits(m, options())
    got, ng = _graphed_logits(m, opts)
    row = dict(stage="same bits", check=f"{label} vs defaults, 16 slots x 8 graphed steps",
               logits_equal=bool(torch.equal(base, got)), max_abs_diff=float((base - got).abs().max()),
               launches=ng, launches_default=nb)
    log("EXACT", row)
    rows.append(row)
    dump(out, "exact.json", rows)


def stage_same_tokens(m, out: Path, rows: list, label: str, opts, slots: int = 16, steps: int = 32) -> None:
    """Options that claim the same greedy tokens from the graph's device argmax: the defaults'
    decode-loop tokens (16 slots after prompts 3..700) against ``opts``', equal?"""
    import torch

    def tokens(o):
        r, pages = _runner(m, o)
        lens, first = _prefill(m, r, pages, slots)
        rows = _decode_rows(pages, [f"p{sl}" for sl in range(slots)], first, lens, steps)
        return r.decode_loop(rows, steps).cpu(), r.launches

    (base, nb), (got, ng) = tokens(options()), tokens(opts)
    row = dict(stage="same tokens", check=f"{label} vs defaults, {slots} slots x {steps} graphed greedy steps",
               tokens_equal=bool(torch.equal(base, got)), launches=ng, launches_default=nb)
    log("EXACT", row)
    rows.append(row)
    dump(out, "exact.json", rows)


def stage_vs_torch(path: str, m, out: Path, rows: list) -> None:
    """Teacher-forced triton (float32 or bf16 KV, GGUF weights) vs the torch reference in float32 (CPU)."""
    import torch

    from workbench.model import Segment as MSeg
    from workbench.model import load_model

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    m32 = load_model(path, dtype="float32")
    toks = prompts_for(1, m.config.vocab_size, 5, 40)[0] + prompts_for(1, m.config.vocab_size, 6, 8)[0]
    for kv in ("float32", "bfloat16"):
        r, pages = _runner(m32, options(kv_dtype=kv))
        st = m32.new_state(256)
        errs, agree = [], 0
        got = r.run([pages.segment(0, "a", tuple(toks[:40]), 0)], {0: 64})[0]
        ref = m32.forward([MSeg(st, toks[:40], "last")])[0][0]
        for i in range(40, 48):
            errs.append(float((got.cpu() - ref).norm() / ref.norm()))
            agree += int(got.argmax()) == int(ref.argmax())
            got = r.run([pages.segment(0, "a", (toks[i],), i)], {0: 64})[0]
            ref = m32.forward([MSeg(st, [toks[i]], "last")])[0][0]
        row = dict(stage="vs_torch", kv_dtype=kv, max_rel_err=max(errs), mean_rel_err=sum(errs) / len(errs),
                   argmax_agree=f"{agree}/8")
        log("VS_TORCH", row)
        rows.append(row)
        dump(out, "exact.json", rows)
    del m32


# ---- decode benchmarks --------------------------------------------------------------------------

def bench_runner(m, variant: str, slots_list, out: Path, rows: list, bw: float, opts=None) -> None:
    """The runner's decode loop (graph replays back to back; eager: one run() per step) at each
    slot count, with ``opts`` (default: ``options()``)."""
    import torch

    opts = opts or options()
    r, pages = _runner(m, opts)
    V = m.config.vocab_size
    wbytes = weight_bytes(r)
    elem = r.kv_dtype.itemsize
    for N in slots_list:
        try:
            ps = prompts_for(N, V, 100 + N)

            def prefill(tag, r=r):
                first = []
                for sl, p in enumerate(ps):
                    o = r.run([pages.segment(sl, f"{tag}-{N}-{sl}", tuple(p), 0)], {sl: PROMPT + GEN + 8})
                    first.append(int(o[sl].argmax()))
                return first

            def done(tag):
                for sl in range(N):
                    pages.free(f"{tag}-{N}-{sl}")

            if r.graphs is not None:
                first = prefill("warm")
                rids = [f"warm-{N}-{sl}" for sl in range(N)]
                r.decode_loop(_decode_rows(pages, rids, first, [PROMPT] * N, GEN), GEN)  # captures the graph
                done("warm")
                first = prefill("timed")
                rows_ = _decode_rows(pages, [f"timed-{N}-{sl}" for sl in range(N)], first, [PROMPT] * N, GEN)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r.decode_loop(rows_, GEN)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                steps = GEN
            else:  # eager: one run() per step, tokens through the host
                steps = 32
                first = prefill("timed")
                toks = first
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for t in range(steps):
                    o = r.run([pages.segment(sl, f"timed-{N}-{sl}", (toks[sl],), PROMPT + t) for sl in range(N)],
                              {sl: PROMPT + GEN + 8 for sl in range(N)})
                    toks = torch.stack([o[sl] for sl in range(N)]).argmax(1).tolist()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            done("timed")
            kvb = kv_bytes_step(m.config, [PROMPT + steps // 2] * N, elem)
            step_s = dt / steps
            floor_w = wbytes / bw
            row = dict(stage="bench", variant=variant, slots=N, prompt=PROMPT, steps=steps, tok_s=N * steps / dt,
                       step_ms=1e3 * step_s, launches_per_step=r.launches, weight_bytes=wbytes, kv_bytes_step=kvb,
                       floor_weights_us=1e6 * floor_w, floor_weights_kv_us=1e6 * (wbytes + kvb) / bw,
                       x_floor=step_s / floor_w, copy_bw_gbs=bw / 1e9, options=str(opts.changed()))
            log("BENCH", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
            rows.append(row)
            dump(out, "bench.json", rows)
        except Exception:  # noqa: BLE001
            log(f"BENCH {variant} N={N} FAILED\n{traceback.format_exc()}")
            rows.append(dict(stage="bench", variant=variant, slots=N, error=traceback.format_exc()[-800:]))
            dump(out, "bench.json", rows)
    del r
    torch.cuda.empty_cache()


def stage_profile(m, out: Path, rows: list, opts=None) -> None:
    """Per-kernel device time of decode steps (torch.profiler, CUPTI): graph replays, and eager."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    opts = opts or options()
    V = m.config.vocab_size
    for graphs in (True, False):
        r, pages = _runner(m, replace(opts, graphs=graphs))
        for N in (1, 16):
            ps = prompts_for(N, V, 300 + N)
            rids = [f"p{graphs}{N}-{sl}" for sl in range(N)]
            toks = [int(r.run([pages.segment(sl, rids[sl], tuple(p), 0)], {sl: 400})[sl].argmax())
                    for sl, p in enumerate(ps)]
            steps = 10 if graphs else 3
            if graphs:  # (capture outside the profile)
                toks = r.decode_loop(_decode_rows(pages, rids, toks, [PROMPT] * N, 2), 2)[-1].tolist()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                if graphs:
                    r.decode_loop(_decode_rows(pages, rids, toks, [PROMPT + 2] * N, steps), steps)
                else:
                    for t in range(steps):
                        o = r.run([pages.segment(sl, rids[sl], (toks[sl],), PROMPT + t) for sl in range(N)],
                                  {sl: 400 for sl in range(N)})
                        toks = [int(o[sl].argmax()) for sl in range(N)]
                torch.cuda.synchronize()
            _launch_sequence(prof, out, f"launches_{'graph' if graphs else 'eager'}_{N}.json", r.launches)
            ka = prof.key_averages()
            kern = []
            for e in ka:
                dt = getattr(e, "device_time_total", None)
                if dt is None:
                    dt = getattr(e, "cuda_time_total", 0)
                if dt and dt > 0:
                    kern.append((e.key, e.count, dt))
            kern.sort(key=lambda k: -k[2])
            total = sum(k[2] for k in kern) / steps
            for name, count, dt in kern[:24]:
                rows.append(dict(stage="profile", graphs=graphs, slots=N, seg=r.attn_segment, kernel=name[:90],
                                 calls_per_step=count / steps, us_per_step=dt / steps))
            rows.append(dict(stage="profile", graphs=graphs, slots=N, seg=r.attn_segment, kernel="TOTAL(kernel time)",
                             calls_per_step=sum(k[1] for k in kern) / steps, us_per_step=total))
            log(f"PROFILE graphs={graphs} N={N}: kernel time {total:.0f} us/step; top: " +
                "; ".join(f"{n[:40]} {d / steps:.0f}us x{c / steps:.0f}" for n, c, d in kern[:8]))
            dump(out, "profile.json", rows)
        del r


def bench_engine(m, slots_list, out: Path, rows: list, opts=None) -> None:
    """End to end through Engine (host sampling each step, as served): aggregate decode tok/s."""

    from workbench import Engine, EngineConfig

    opts = opts or options()
    V = m.config.vocab_size
    for N in slots_list:
        try:
            cfg = EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=N, max_context=PROMPT + GEN + 8,
                               memory_budget_bytes=64 << 30, triton=opts)
            eng = Engine(m, cfg)
            eng.generate(prompts_for(N, V, 7), max_tokens=8, ignore_eos=True)  # warm: graphs
            res = eng.generate(prompts_for(N, V, 8 + N), max_tokens=GEN, ignore_eos=True)
            t0 = min(r.first_token_at for r in res)
            t1 = max(r.token_times[-1] for r in res)
            n = sum(len(r.token_ids) - 1 for r in res)
            row = dict(stage="bench", variant="engine_triton", slots=N, prompt=PROMPT, steps=GEN, tok_s=n / (t1 - t0),
                       step_ms=1e3 * (t1 - t0) / (GEN - 1), options=str(opts.changed()))
            log("BENCH", row)
            rows.append(row)
            dump(out, "bench.json", rows)
            del eng
        except Exception:  # noqa: BLE001
            log(f"ENGINE N={N} FAILED\n{traceback.format_exc()}")


@contextlib.contextmanager
def _config_tables():
    """The product kernels' launch-config tables (qmma's layer and wide tables, qmatmul's GEMV
    table) as they are now: yields (mma, wide, gemv) copies and a reset() that puts the tables
    back mid-stage; they are put back on exit too. Tiling sweeps change these data tables
    between runners (each runner takes its configs when it launches); options never go here."""
    from workbench.kernels import qmatmul, qmma

    tables = (qmma.QMMA_CONFIGS, qmma.QMMA_WIDE_CONFIGS, qmatmul.QGEMV_CONFIGS)
    saved = tuple(dict(t) for t in tables)

    def reset():
        for t, b in zip(tables, saved, strict=True):
            t.clear()
            t.update(b)

    try:
        yield saved, reset
    finally:
        reset()


def _launch_sequence(prof, out: Path, name: str, per_step: int) -> None:
    """The last step's kernels in issue order: name, start and end (us from the step's first
    kernel). With graphs (PDL) a kernel's end minus its predecessor's end is what it adds to the
    step's chain; eager, the durations and the gaps between launches. Best effort: a profiler
    without per-event device times skips it."""
    try:
        ev = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
              and not e.name.startswith("Memcpy")]
        ev.sort(key=lambda e: e.time_range.start)
        ev = ev[-per_step:]
        t0 = ev[0].time_range.start
        dump(out, name, [dict(i=i, kernel=e.name[:60], start_us=e.time_range.start - t0,
                              end_us=e.time_range.end - t0) for i, e in enumerate(ev)])
    except Exception as e:  # noqa: BLE001
        log(f"launch sequence {name}: skipped ({e})")


ALL_MMA = {"layer_forms": {}}  # every layer weight on tensor cores


def stage_mma_sweep(m, out: Path, rows: list, bw: float) -> None:
    """End-to-end decode steps (graphs, 1 and 16 slots) for candidate tensor-core tilings of the
    layer products (all formats alike, every layer on tensor cores). Each candidate is fixed per
    weight shape (never per M), as the runner requires."""
    from workbench.kernels import qmma

    C = qmma.MmaConfig
    layer_cands = {"n64k128w4": C(64, 128, 4), "n128k128w4": C(128, 128, 4), "n64k256w4": C(64, 256, 4),
                   "n32k128w4": C(32, 128, 4), "n128k128w8": C(128, 128, 8), "n64k128w4s2": C(64, 128, 4, 2)}
    with _config_tables():
        for label, cfg in layer_cands.items():
            for k in qmma.QMMA_CONFIGS:
                qmma.QMMA_CONFIGS[k] = replace(cfg)
            bench_runner(m, f"mma_sweep layers {label}", (1, 16), out, rows, bw, options(**ALL_MMA))


def _gemv_variants(m, prefix: str, cands: dict, base_gemv: dict, reset, out: Path, rows: list, bw: float) -> None:
    """One GEMV config change at a time ({label: (format, fields)}), each from the base tables."""
    from workbench.kernels import qmatmul

    for label, (fmt, kw) in cands.items():
        qmatmul.QGEMV_CONFIGS[fmt] = replace(base_gemv[fmt], **kw)
        bench_runner(m, f"{prefix} {label}", (1, 16), out, rows, bw)
        reset()


def stage_tile_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Around the defaults: one format's tiling at a time (Q5_0 on tensor cores, the GEMV's)."""
    from workbench.kernels import qmma

    mma = {"Q5_0 n16k128w4": dict(block_n=16), "Q5_0 n64k128w4": dict(block_n=64), "Q5_0 n32k128w8": dict(num_warps=8)}
    gemv = {"Q8_0 m4": ("Q8_0", dict(m_tile=4)), "Q8_0 m2": ("Q8_0", dict(m_tile=2)),
            "Q8_0 w4": ("Q8_0", dict(num_warps=4))}
    with _config_tables() as ((base_mma, _, base_gemv), reset):
        for label, kw in mma.items():
            qmma.QMMA_CONFIGS["Q5_0"] = replace(base_mma["Q5_0"], **kw)
            bench_runner(m, f"tile_sweep mma {label}", (1, 16), out, rows, bw)
            reset()
        _gemv_variants(m, "tile_sweep gemv", gemv, base_gemv, reset, out, rows, bw)


def stage_form_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Which formats take the FMA GEMV (the rest tensor cores), at 1, 4, 16 slots."""
    cands = [(), ("Q8_0",), ("Q8_0", "Q6_K"), ("Q8_0", "Q4_K", "Q6_K"), ("Q8_0", "Q5_0", "Q4_K", "Q6_K")]
    for fmts in cands:
        label = "+".join(fmts) or "none"
        bench_runner(m, f"form_sweep gemv {label}", (1, 4, 16), out, rows, bw,
                     options(layer_forms={f: "gemv" for f in fmts}))


def stage_m32(m, out: Path, rows: list, bw: float) -> None:
    """32-row tensor-core tiles for the layers: fixed per weight, so 1..16 rows pay a 32-wide
    MMA and 32 rows take one tile instead of two."""
    from workbench.kernels import qmma

    with _config_tables() as ((base, _, _), _reset):
        for k, cfg in base.items():
            qmma.QMMA_CONFIGS[k] = replace(cfg, block_m=32)
        bench_runner(m, "m32 layers", SLOTS, out, rows, bw)


def stage_torch_path(path: str, out: Path, rows: list, device: str = "cuda", slots=(1, 4, 16), gen: int = 32) -> None:
    """The torch reference path (workbench.model, TorchRunner) on the GPU, through Engine: the
    model's tensors moved to the device and torch's default device set, so its step-local
    tensors are made there too. Eager torch ops, cuBLAS bf16 products; the row-invariance
    policy of workbench/linear.py was measured for the CPU's BLAS, not for cuBLAS, so this
    row times the reference path and claims no exactness."""
    import torch

    from workbench import Engine, EngineConfig
    from workbench.model import load_model

    m = load_model(path, dtype="bfloat16")
    dev = torch.device(device)
    for layer in m.layers:
        for k, v in vars(layer).items():
            if isinstance(v, torch.Tensor):
                setattr(layer, k, v.to(dev))
    m.embed_raw, m.head, m.output_norm = m.embed_raw.to(dev), m.head.to(dev), m.output_norm.to(dev)
    V = m.config.vocab_size
    prompts = {N: (prompts_for(N, V, 7), prompts_for(N, V, 8 + N)) for N in slots}  # (CPU generators)
    torch.set_default_device(dev)
    try:
        for N in slots:
            cfg = EngineConfig(backend="torch", dtype="bfloat16", max_concurrency=N, max_context=PROMPT + gen + 8,
                               memory_budget_bytes=64 << 30)
            eng = Engine(m, cfg)
            eng.generate(prompts[N][0], max_tokens=4, ignore_eos=True)  # warm-up
            n0 = eng.telemetry.steps().height
            eng.generate(prompts[N][1], max_tokens=gen, ignore_eos=True)
            st = eng.telemetry.steps()
            st = st.filter((st["step"] >= n0) & (st["phase"] == "decode"))
            dt = float(st["wall_ms"].sum()) / 1e3
            row = dict(stage="bench", variant="torch_reference_path", slots=N, prompt=PROMPT, steps=st.height,
                       tok_s=float(st["decode_rows"].sum()) / dt, step_ms=1e3 * dt / st.height)
            log("BENCH", row)
            rows.append(row)
            dump(out, "bench.json", rows)
    finally:
        torch.set_default_device(None)


# The runner-loop variants: stage name -> (row label, TritonOptions fields over the base).
# (Session 13: each option that is left, against the defaults. The variants measured and removed
# are in docs/GPU_NOTES.md, "Options as data"; their stages went with them.)
VARIANTS = {
    "default": ("triton_default", {}),
    "nopdl": ("triton_nopdl", {"pdl": False}),
    "cublas": ("cublas_bf16_graphs", {"products": "cublas_bf16"}),
    "dense head": ("triton_dense_head", {"head_matmul": "dense"}),
    "eager": ("triton_eager", {"graphs": False}),
    "seg32": ("triton_seg32", {"attn_segment": 32}),
    "seg128": ("triton_seg128", {"attn_segment": 128}),
    "mma layers": ("triton_all_mma", ALL_MMA),
    "noargmax": ("triton_argmax_after_head", {"argmax_in_head": False}),
    "norope": ("triton_rope_kernel", {"rope_in_attention": False}),
    "nopair": ("triton_qkv_two_launches", {"pair_launch": False}),
    "noglu": ("triton_glu_kernel", {"fuse_glu": False}),
    "unfused combine": ("triton_combine_kernel", {"fuse_combine": False}),
    "kv f32": ("triton_kv_float32", {"kv_dtype": "float32"}),
}
# Folds that claim the defaults' bits (graphed steps, logits) or tokens: stage name -> (label, fields)
SAME_BITS = {
    "norope same bits": ("QK-norm/rope as its own kernel", {"rope_in_attention": False}),
    "noglu same bits": ("the GLU as its own kernel", {"fuse_glu": False}),
    "unfused combine same bits": ("the attention combine as its own kernel", {"fuse_combine": False}),
    "nopdl same bits": ("no PDL", {"pdl": False}),
}
SAME_TOKENS = {"noargmax same tokens": ("the argmax after the head", {"argmax_in_head": False})}


def main_stage(args) -> None:
    from workbench.model import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump(out, "fingerprint.json", fingerprint())
    t0 = time.perf_counter()
    m = load_model(args.model, dtype="bfloat16")
    log(f"model loaded in {time.perf_counter() - t0:.1f}s; options {options().changed() or 'the defaults'}")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    rows: list = [dict(stage="copy_bw", copy_bw_gbs=bw / 1e9)]
    dump(out, "bench.json", rows)
    exact_rows: list = []
    prof_rows: list = []
    stages = [
        *[(name, (lambda label=label, kw=kw: bench_runner(m, label, SLOTS, out, rows, bw, options(**kw))))
          for name, (label, kw) in VARIANTS.items()],
        ("exact", lambda: stage_exact(m, out, exact_rows)),
        ("exact 32", lambda: stage_exact(m, out, exact_rows, EXACT_32)),
        ("dense head exact", lambda: stage_exact(m, out, exact_rows, EXACT_32, options(head_matmul="dense"))),
        *[(name, (lambda label=label, kw=kw: stage_same_bits(m, out, exact_rows, label, options(**kw))))
          for name, (label, kw) in SAME_BITS.items()],
        *[(name, (lambda label=label, kw=kw: stage_same_tokens(m, out, exact_rows, label, options(**kw))))
          for name, (label, kw) in SAME_TOKENS.items()],
        ("engine", lambda: bench_engine(m, (1, 4, 16, 32), out, rows)),
        ("profile", lambda: stage_profile(m, out, prof_rows)),
        ("vs torch", lambda: stage_vs_torch(args.model, m, out, exact_rows)),
        ("torch path", lambda: stage_torch_path(args.model, out, rows)),
        ("mma sweep", lambda: stage_mma_sweep(m, out, rows, bw)),
        ("tile sweep", lambda: stage_tile_sweep(m, out, rows, bw)),
        ("form sweep", lambda: stage_form_sweep(m, out, rows, bw)),
        ("m32", lambda: stage_m32(m, out, rows, bw)),
    ]
    wanted = [s for s in os.environ.get("STAGES", "").split(",") if s]
    unknown = sorted(set(wanted) - {name for name, _ in stages})
    if unknown:
        log(f"unknown stage(s) {', '.join(unknown)}: allowed {', '.join(name for name, _ in stages)}")
    for name, fn in stages:
        if wanted and name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001
            log(f"STAGE {name} FAILED\n{traceback.format_exc()}")
            exact_rows.append(dict(stage=name, error=traceback.format_exc()[-1500:]))
            dump(out, "exact.json", exact_rows)
        log(f"stage {name}: {time.perf_counter() - t0:.1f}s")


# ---- transformers -------------------------------------------------------------------------------

def hf_stage(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    rows: list = []
    path = Path(args.model)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    log(f"hf loaded in {time.perf_counter() - t0:.1f}s")
    V = model.config.vocab_size
    modes = ["static_compile"] if args.compile else ["eager"]
    hf_slots = tuple(int(x) for x in os.environ.get("HF_SLOTS", ",".join(map(str, SLOTS))).split(","))
    for mode in modes:
        for N in hf_slots:
            try:
                ids = torch.tensor(prompts_for(N, V, 100 + N), device="cuda")
                kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
                if mode == "static_compile":
                    kw["cache_implementation"] = "static"
                def gen(n):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    with torch.no_grad():
                        o = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                    torch.cuda.synchronize()
                    assert o.shape[1] == ids.shape[1] + n
                    return time.perf_counter() - t
                if mode == "static_compile":
                    # one shape only (the static cache is sized by max_new_tokens): compile, then
                    # time the whole generate (prefill included: a slight underestimate)
                    tc = gen(GEN)
                    t1, t128 = 0.0, gen(GEN)
                    log(f"hf static N={N}: first generate (compile) {tc:.1f}s")
                else:
                    gen(4)  # warm up
                    t1, t128 = gen(1), gen(GEN)
                n = GEN if mode == "static_compile" else GEN - 1
                row = dict(stage="bench", variant=f"hf_{mode}_bf16", slots=N, prompt=PROMPT, steps=GEN,
                           tok_s=N * n / (t128 - t1), step_ms=1e3 * (t128 - t1) / n,
                           includes_prefill=mode == "static_compile")
                log("BENCH", row)
                rows.append(row)
                dump(out, f"hf_{mode}.json", rows)
            except Exception:  # noqa: BLE001
                log(f"HF {mode} N={N} FAILED\n{traceback.format_exc()}")
                rows.append(dict(stage="bench", variant=f"hf_{mode}_bf16", slots=N, error=traceback.format_exc()[-800:]))
                dump(out, f"hf_{mode}.json", rows)


# ---- reporting ----------------------------------------------------------------------------------

def load_rows(d: Path) -> list[dict]:
    rows = []
    for f in sorted(d.glob("*.json")):
        if f.name == "fingerprint.json" or f.name.startswith("launches_"):  # (per-launch timelines, kept raw)
            continue
        try:
            obj = json.loads(f.read_text())
        except Exception:  # noqa: BLE001
            continue
        if isinstance(obj, list):  # (a run's row files; other JSON, e.g. gpu_sync_bench's, stays raw)
            if f.name == "head_bench.json":  # (scripts/head_bench.py: the head alone)
                obj = [{"stage": "head", **r} for r in obj]
            rows += obj
    return rows + llamacpp_rows(d / "llamacpp.jsonl")


def llamacpp_rows(path: Path) -> list[dict]:
    """Bench rows from scripts/gpu_llamacpp.sh's llama-batched-bench JSON lines (speed_tg: the
    aggregate decode tok/s of pl sequences generating tg tokens each after pp-token prompts)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.append(dict(stage="bench", variant="llamacpp_cuda_fa_kvu", slots=r["pl"], prompt=r["pp"], steps=r["tg"],
                         tok_s=r["speed_tg"], step_ms=1e3 * r["t_tg"] / r["tg"], prefill_tok_s=r["speed_pp"]))
    return rows


def table(args) -> None:
    rows = load_rows(Path(args.dir))
    for r in rows:
        if r.get("stage") in ("exact", "vs_torch") or "error" in r:
            log({k: v for k, v in r.items() if k not in ("prompt_lens",)} if "error" not in r else
                {"stage": r.get("stage"), "variant": r.get("variant"), "slots": r.get("slots"), "error": r["error"][-200:]})
    log(f"{'variant':<22}{'slots':>6}{'tok/s':>10}{'ms/step':>9}{'launch':>7}{'x floor':>8}")
    for r in rows:
        if r.get("stage") == "bench" and "tok_s" in r:
            log(f"{r['variant']:<22}{r['slots']:>6}{r['tok_s']:>10.0f}{r['step_ms']:>9.3f}"
                f"{r.get('launches_per_step', ''):>7}{(format(r['x_floor'], '.1f') if 'x_floor' in r else ''):>8}")
        elif r.get("stage") == "copy_bw":
            log(f"copy bandwidth {r['copy_bw_gbs']:.0f} GB/s")


def to_parquet(args) -> None:
    """Tidy parquet of every run directory's bench rows (one row per variant x slots x run, with
    the run's hardware fingerprint), plus the exactness, profile and head-bench rows beside it."""
    import polars as pl

    bench, exact, prof, head = [], [], [], []
    for dname in args.dirs:
        d = Path(dname)
        fp = json.loads((d / "fingerprint.json").read_text()) if (d / "fingerprint.json").exists() else {}
        for r in load_rows(d):
            r = {**r, "run": d.name, "hardware_id": fp.get("hardware_id"), "gpu_name": fp.get("gpu_name"),
                 "fingerprint": json.dumps(fp, default=str)}
            if "error" in r:
                r["error"] = r["error"][-300:]
            {"bench": bench, "copy_bw": bench, "profile": prof, "head": head}.get(r.get("stage"), exact).append(r)
    dest = Path(args.dest)
    if not any("variant" in r for r in bench):  # (every run directory, not the new one alone: the files are rebuilt from them all)
        sys.exit(f"parquet: no bench rows in {', '.join(args.dirs)}: give every run directory "
                 f"(data/gpu/run*), the files are rebuilt from them all; nothing written")

    def frame(rows):
        cols = sorted({k for r in rows for k in r})
        return pl.DataFrame([{k: (json.dumps(r.get(k)) if isinstance(r.get(k), (list, dict)) else r.get(k))
                              for k in cols} for r in rows], infer_schema_length=None)

    from workbench.atomic import atomic_write_parquet, atomic_write_text

    df = frame(bench)
    atomic_write_parquet(dest, df)
    atomic_write_parquet(dest.with_name(dest.stem.replace("bench", "profile") + ".parquet"), frame(prof))
    if head:
        atomic_write_parquet(dest.with_name(dest.stem.replace("bench", "head") + ".parquet"), frame(head))
    atomic_write_text(dest.with_name(dest.stem.replace("bench", "exact") + ".json"), json.dumps(exact, indent=1, default=str))
    print(df.select([c for c in ("run", "variant", "slots", "tok_s", "step_ms", "launches_per_step", "x_floor") if c in df.columns])
          .filter(pl.col("variant").is_not_null()).sort("variant", "slots", "run"))


def synth(args) -> None:
    """A random-weight GGUF with Gemma 3 270M's layer shapes (a tiny vocabulary): a dress rehearsal."""
    from workbench.synthetic import SyntheticSpec, write_random_gguf

    write_random_gguf(args.path, SyntheticSpec(arch="gemma3", n_layers=int(args.layers), n_embd=640, n_heads=4,
                                               n_kv_heads=1, head_dim=256, n_ff=2048, context_length=32768,
                                               sliding_window=512, weight_type="Q8_0"))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    y = sub.add_parser("synth")
    y.add_argument("path")
    y.add_argument("--layers", default=6)
    a = sub.add_parser("main")
    a.add_argument("--model", required=True)
    a.add_argument("--out", required=True)
    h = sub.add_parser("hf")
    h.add_argument("--model", required=True)
    h.add_argument("--out", required=True)
    h.add_argument("--compile", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("dir")
    p = sub.add_parser("parquet")
    p.add_argument("dest")
    p.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    {"main": main_stage, "hf": hf_stage, "table": table, "parquet": to_parquet, "synth": synth}[args.cmd](args)


if __name__ == "__main__":
    main()
