"""Exactness check and decode benchmarks of the Triton backend on a CUDA GPU (scripts/gpu_run.sh).

    python scripts/gpu_bench.py main  --model M.gguf --out DIR   # exactness + triton/cuBLAS/engine
    python scripts/gpu_bench.py hf    --model M.gguf --out DIR   # transformers on the same GGUF
    python scripts/gpu_bench.py table DIR                         # print the summary table
    python scripts/gpu_bench.py parquet data/gpu/h200_bench.parquet DIR...   # here, with polars

Every stage writes JSON into DIR as soon as it has a result, so a stage that fails or runs out
of time leaves what came before. Decode rates: N slots, 128-token random prompts, 128 greedy
tokens; "tok/s" is aggregate (N * steps / decode time; prefill excluded).
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


def stage_exact(m, out: Path, rows: list, sizes=EXACT_SIZES) -> None:
    """Engine batches of N requests (prompts 3..700 tokens) against each request alone: tokens and
    float32 logits bitwise, for each (N, sampling) of ``sizes``."""
    import torch

    from workbench import Engine, EngineConfig

    V = m.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = [600, 5, 37, 128, 300, 64, 17, 520, 200, 90, 3, 256, 700, 45, 11, 150]
    lens += [n + 7 for n in lens]  # (32 requests at most)
    prompts = [torch.randint(10, V, (n,), generator=g).tolist() for n in lens]
    for N, kw in sizes:
        ps = prompts[:N]
        cfg = EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=N, max_context=1024,
                           memory_budget_bytes=64 << 30, chunk_size=256)
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
        graphs = sorted(eng.runner._graphs)
        row = dict(stage="exact", check=f"{N} slots vs solo", slots=N, prompt_lens=lens[:N], sampling=str(kw),
                   tokens_equal=all(tok_eq), logits_equal=all(lg_eq), requests_differing=[i for i, (a, b) in enumerate(zip(tok_eq, lg_eq)) if not (a and b)],
                   batched_s=tb, solo_s=ts, graphs=str(graphs))
        log("EXACT", row)
        rows.append(row)
        dump(out, "exact.json", rows)
        del eng, solo_eng, batched, solo
        torch.cuda.empty_cache()


def stage_persistent_exact(m, out: Path, rows: list, slots: int = 16, steps: int = 8) -> None:
    """The persistent step against the chain of launches (same warps), on the real model: 16
    slots prefilled (prompts 3..700), then graphed decode steps; logits bitwise equal?"""
    import torch

    from workbench.triton_runner import PERSISTENT_WARPS

    got, info = {}, {}
    for pers in (False, True):
        got[pers], info[pers] = _graphed_logits(m, slots, steps, persistent=pers, uniform_warps=PERSISTENT_WARPS)
    row = dict(stage="persistent exact", check=f"persistent vs chain, {slots} slots x {steps} graphed steps",
               logits_equal=bool(torch.equal(got[True], got[False])),
               max_abs_diff=float((got[True] - got[False]).abs().max()), chain=info[False], persistent=info[True])
    log("EXACT", row)
    rows.append(row)
    dump(out, "exact.json", rows)


def _prefill(m, r, slots: int) -> tuple[list[int], list[int]]:
    """Prefill slots 0..slots-1 of runner r with seeded prompts of 3..700 tokens: (their
    lengths, each slot's first greedy token)."""
    import torch

    from workbench.scheduler import Segment

    g = torch.Generator().manual_seed(0)
    lens = [600, 5, 37, 128, 300, 64, 17, 520, 200, 90, 3, 256, 700, 45, 11, 150][:slots]
    prompts = [torch.randint(10, m.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    toks = [int(r.run([Segment(sl, f"p{sl}", tuple(p), 0, True)], {sl: 1024})[sl].argmax())
            for sl, p in enumerate(prompts)]
    return lens, toks


def _graphed_logits(m, slots: int = 16, steps: int = 8, uniform_warps: int | None = None, **kw):
    """Logits [steps, slots, vocab] of graphed decode steps after prefilling prompts 3..700
    (a TritonRunner(**kw)), and the runner's launches / persistent state; ``uniform_warps``
    set on the runner where given."""
    import torch

    from workbench.scheduler import Segment
    from workbench.triton_runner import TritonRunner

    r = TritonRunner(m, 1024, **kw)
    if uniform_warps:
        r.uniform_warps = uniform_warps
    lens, toks = _prefill(m, r, slots)
    logits = []
    for t in range(steps):
        o = r.run([Segment(sl, f"p{sl}", (toks[sl],), lens[sl] + t, True) for sl in range(slots)],
                  {sl: 1024 for sl in range(slots)})
        logits.append(torch.stack([o[sl].float().cpu() for sl in range(slots)]))
        toks = [int(o[sl].argmax()) for sl in range(slots)]
    info = dict(launches=r.launches, persistent=r.persistent, off=r.persistent_off)
    del r
    torch.cuda.empty_cache()
    return torch.stack(logits), info


def stage_same_bits(m, out: Path, rows: list, label: str, patched) -> None:
    """Options that claim to change no bit (ordering and prefetch only): the defaults' logits
    against ``patched(fn)``'s, 16 slots x 8 graphed steps, bitwise equal?"""
    import torch

    base = _graphed_logits(m)[0]
    got = patched(lambda: _graphed_logits(m)[0])
    row = dict(stage="same bits", check=f"{label} vs defaults, 16 slots x 8 graphed steps",
               logits_equal=bool(torch.equal(base, got)), max_abs_diff=float((base - got).abs().max()))
    log("EXACT", row)
    rows.append(row)
    dump(out, "exact.json", rows)


def stage_same_tokens(m, out: Path, rows: list, label: str, patched, slots: int = 16, steps: int = 32) -> None:
    """Options that claim the same greedy tokens from the graph's device argmax: the defaults'
    decode-loop tokens (16 slots after prompts 3..700) against ``patched(fn)``'s, equal?"""
    import torch

    from workbench.triton_runner import TritonRunner

    def tokens():
        r = TritonRunner(m, 1024)
        _, first = _prefill(m, r, slots)
        return r.decode_loop(list(range(slots)), first, steps).cpu(), r.launches

    (base, nb), (got, ng) = tokens(), patched(tokens)
    row = dict(stage="same tokens", check=f"{label} vs defaults, {slots} slots x {steps} graphed greedy steps",
               tokens_equal=bool(torch.equal(base, got)), launches=ng, launches_default=nb)
    log("EXACT", row)
    rows.append(row)
    dump(out, "exact.json", rows)


def stage_vs_torch(path: str, m, out: Path, rows: list) -> None:
    """Teacher-forced triton (bf16 KV, GGUF weights) vs the torch reference in float32 (CPU)."""
    import torch

    from workbench.model import Segment as MSeg
    from workbench.model import load_model
    from workbench.scheduler import Segment
    from workbench.triton_runner import TritonRunner

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    m32 = load_model(path, dtype="float32")
    toks = prompts_for(1, m.config.vocab_size, 5, 40)[0] + prompts_for(1, m.config.vocab_size, 6, 8)[0]
    for kv in (torch.float32, torch.bfloat16):
        r = TritonRunner(m32, 1024, kv_dtype=kv)
        st = m32.new_state(256)
        errs, agree = [], 0
        got = r.run([Segment(0, "a", tuple(toks[:40]), 0, True)], {0: 64})[0]
        ref = m32.forward([MSeg(st, toks[:40], "last")])[0][0]
        for i in range(40, 48):
            errs.append(float((got.cpu() - ref).norm() / ref.norm()))
            agree += int(got.argmax()) == int(ref.argmax())
            got = r.run([Segment(0, "a", (toks[i],), i, True)], {0: 64})[0]
            ref = m32.forward([MSeg(st, [toks[i]], "last")])[0][0]
        row = dict(stage="vs_torch", kv_dtype=str(kv), max_rel_err=max(errs), mean_rel_err=sum(errs) / len(errs),
                   argmax_agree=f"{agree}/8")
        log("VS_TORCH", row)
        rows.append(row)
        dump(out, "exact.json", rows)
    del m32


# ---- decode benchmarks --------------------------------------------------------------------------

def bench_runner(m, variant: str, slots_list, out: Path, rows: list, bw: float, **kw) -> None:
    import torch

    from workbench.scheduler import Segment
    from workbench.triton_runner import TritonRunner

    setup = kw.pop("setup", None)
    r = TritonRunner(m, 1024, **kw)
    if setup is not None:
        setup(r)
    V = m.config.vocab_size
    wbytes = weight_bytes(r)
    elem = r._elem
    for N in slots_list:
        try:
            ps = prompts_for(N, V, 100 + N)

            def prefill(tag, r=r):
                first = []
                for sl, p in enumerate(ps):
                    o = r.run([Segment(sl, f"{tag}-{N}-{sl}", tuple(p), 0, True)], {sl: PROMPT + GEN + 8})
                    first.append(int(o[sl].argmax()))
                return first

            if r.use_graphs:
                first = prefill("warm")
                r.decode_loop(list(range(N)), first, GEN)  # captures the graph
                first = prefill("timed")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r.decode_loop(list(range(N)), first, GEN)
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
                    o = r.run([Segment(sl, f"timed-{N}-{sl}", (toks[sl],), PROMPT + t, True) for sl in range(N)],
                              {sl: PROMPT + GEN + 8 for sl in range(N)})
                    toks = torch.stack([o[sl] for sl in range(N)]).argmax(1).tolist()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            kvb = kv_bytes_step(m.config, [PROMPT + steps // 2] * N, elem)
            step_s = dt / steps
            floor_w = wbytes / bw
            row = dict(stage="bench", variant=variant, slots=N, prompt=PROMPT, steps=steps, tok_s=N * steps / dt,
                       step_ms=1e3 * step_s, launches_per_step=r.launches, weight_bytes=wbytes, kv_bytes_step=kvb,
                       floor_weights_us=1e6 * floor_w, floor_weights_kv_us=1e6 * (wbytes + kvb) / bw,
                       x_floor=step_s / floor_w, copy_bw_gbs=bw / 1e9,
                       persistent=bool(getattr(r, "persistent", False)), persistent_off=getattr(r, "persistent_off", None))
            log("BENCH", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
            rows.append(row)
            dump(out, "bench.json", rows)
        except Exception:  # noqa: BLE001
            log(f"BENCH {variant} N={N} FAILED\n{traceback.format_exc()}")
            rows.append(dict(stage="bench", variant=variant, slots=N, error=traceback.format_exc()[-800:]))
            dump(out, "bench.json", rows)
    del r
    torch.cuda.empty_cache()


def stage_profile(m, out: Path, rows: list, seg: int | None = None) -> None:
    """Per-kernel device time of decode steps (torch.profiler, CUPTI): graph replays, and eager."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workbench.scheduler import Segment
    from workbench.triton_runner import TritonRunner

    V = m.config.vocab_size
    for graphs in (True, False):
        r = TritonRunner(m, 1024, graphs=graphs, attn_segment=seg)
        for N in (1, 16):
            ps = prompts_for(N, V, 300 + N)
            toks = [int(r.run([Segment(sl, f"p{graphs}{N}-{sl}", tuple(p), 0, True)], {sl: 400})[sl].argmax())
                    for sl, p in enumerate(ps)]
            steps = 10 if graphs else 3
            if graphs:
                toks = r.decode_loop(list(range(N)), toks, 2)[-1].tolist()  # capture outside the profile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                if graphs:
                    r.decode_loop(list(range(N)), toks, steps)
                else:
                    for t in range(steps):
                        o = r.run([Segment(sl, f"p{graphs}{N}-{sl}", (toks[sl],), PROMPT + t, True) for sl in range(N)],
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


def bench_engine(m, slots_list, out: Path, rows: list) -> None:
    """End to end through Engine (host sampling each step, as served): aggregate decode tok/s."""

    from workbench import Engine, EngineConfig

    V = m.config.vocab_size
    for N in slots_list:
        try:
            cfg = EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=N, max_context=PROMPT + GEN + 8,
                               memory_budget_bytes=64 << 30)
            eng = Engine(m, cfg)
            eng.generate(prompts_for(N, V, 7), max_tokens=8, ignore_eos=True)  # warm: graphs
            res = eng.generate(prompts_for(N, V, 8 + N), max_tokens=GEN, ignore_eos=True)
            t0 = min(r.first_token_at for r in res)
            t1 = max(r.token_times[-1] for r in res)
            n = sum(len(r.token_ids) - 1 for r in res)
            row = dict(stage="bench", variant="engine_triton", slots=N, prompt=PROMPT, steps=GEN, tok_s=n / (t1 - t0),
                       step_ms=1e3 * (t1 - t0) / (GEN - 1))
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
    back mid-stage; they are put back on exit too. Sweeps change them between runners; each
    runner takes its configs when it launches."""
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


def _patched(module, name: str, value, fn):
    """Run fn with module.name = value (runners built inside take it), then put it back; fn's
    result."""
    return _patched_all(module, {name: value}, fn)


def _with(patches, fn):
    """Run fn with each (module, name, value) of ``patches`` set (None: none; one triple: it)."""
    patches = [] if patches is None else [patches] if isinstance(patches, tuple) else list(patches)
    if not patches:
        return fn()
    (mod, name, value), rest = patches[0], patches[1:]
    return _patched(mod, name, value, lambda: _with(rest, fn))


def _patched_all(module, values: dict, fn):
    """Run fn with module's attributes set to ``values``, then put them back."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        return fn()
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def stage_mma_sweep(m, out: Path, rows: list, bw: float) -> None:
    """End-to-end decode steps (graphs, 1 and 16 slots) for candidate tensor-core tilings: the
    layer products' config (all formats alike), then the head's. Each candidate is fixed per
    weight shape (never per M), as the runner requires."""
    from workbench.kernels import qmma

    C = qmma.MmaConfig
    layer_cands = {"n64k128w4": C(64, 128, 4), "n128k128w4": C(128, 128, 4), "n64k256w4": C(64, 256, 4),
                   "n32k128w4": C(32, 128, 4), "n128k128w8": C(128, 128, 8), "n64k128w4s2": C(64, 128, 4, 2)}
    head_cands = {"n64k128w4s3": C(64, 128, 4, 3), "n128k128w4s3": C(128, 128, 4, 3), "n128k128w8s3": C(128, 128, 8, 3),
                  "n64k128w4s1": C(64, 128, 4, 1), "n256k128w8s3": C(256, 128, 8, 3), "n64k64w4s4": C(64, 64, 4, 4)}
    with _config_tables() as (_, reset):
        for label, cfg in layer_cands.items():
            for k in qmma.QMMA_CONFIGS:
                qmma.QMMA_CONFIGS[k] = replace(cfg)
            bench_runner(m, f"mma_sweep layers {label}", (1, 16), out, rows, bw, matmul="mma")
        reset()
        for label, cfg in head_cands.items():
            qmma.QMMA_WIDE_CONFIGS["Q8_0"] = cfg
            bench_runner(m, f"mma_sweep head {label}", (1, 16), out, rows, bw, matmul="mma")


def stage_pdl_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Under PDL the products fetch and decode their first K step before waiting for x: a config
    whose K slice is ONE step has all its weights decoded before the wait. End-to-end graph
    steps (1 and 16 slots) for layer tilings of both forms and for the per-format form choice;
    each candidate fixed per weight shape (never per M)."""
    from workbench.kernels import qmma

    C = qmma.MmaConfig
    mma_cands = {"n64k256w4": C(64, 256, 4), "n64k256w8": C(64, 256, 8), "n32k256w4": C(32, 256, 4),
                 "n128k256w8": C(128, 256, 8), "n32k128w4": C(32, 128, 4)}
    gemv_cands = {"Q4_K k256": ("Q4_K", dict(block_k=256)), "Q4_K k256 w8": ("Q4_K", dict(block_k=256, num_warps=8)),
                  "Q4_K m8": ("Q4_K", dict(m_tile=8)), "Q8_0 n32": ("Q8_0", dict(block_n=32))}
    with _config_tables() as ((_, _, base_gemv), reset):
        for label, cfg in mma_cands.items():
            qmma.QMMA_CONFIGS["Q5_0"] = cfg
            bench_runner(m, f"pdl_sweep mma Q5_0 {label}", (1, 16), out, rows, bw)
        reset()
        _gemv_variants(m, "pdl_sweep gemv", gemv_cands, base_gemv, reset, out, rows, bw)
        bench_runner(m, "pdl_sweep forms all gemv, mma head", (1, 16), out, rows, bw, matmul="gemv",
                     head_matmul="mma", layer_forms={})
        bench_runner(m, "pdl_sweep forms all mma", (1, 16), out, rows, bw, matmul="mma")
        for label, cfg in mma_cands.items():
            for k in ("Q4_K", "Q6_K", "Q8_0"):
                qmma.QMMA_CONFIGS[k] = cfg
            qmma.QMMA_CONFIGS["Q5_0"] = cfg
            bench_runner(m, f"pdl_sweep forms all mma {label}", (1, 16), out, rows, bw, matmul="mma")


def _gemv_variants(m, prefix: str, cands: dict, base_gemv: dict, reset, out: Path, rows: list, bw: float) -> None:
    """One GEMV config change at a time ({label: (format, fields)}), each from the base tables."""
    from workbench.kernels import qmatmul

    for label, (fmt, kw) in cands.items():
        qmatmul.QGEMV_CONFIGS[fmt] = replace(base_gemv[fmt], **kw)
        bench_runner(m, f"{prefix} {label}", (1, 16), out, rows, bw)
        reset()


def stage_tile_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Around the session-4 defaults (under PDL, GLU folded): one format's tiling at a time."""
    from workbench.kernels import qmma

    mma = {"Q5_0 n16k128w4": dict(block_n=16), "Q5_0 n16k128w2": dict(block_n=16, num_warps=2),
           "Q5_0 n32k128w2": dict(num_warps=2)}
    gemv = {"Q4_K k256 m2": ("Q4_K", dict(m_tile=2)), "Q4_K k256 n16": ("Q4_K", dict(block_n=16)),
            "Q6_K m4": ("Q6_K", dict(m_tile=4)), "Q6_K m2": ("Q6_K", dict(m_tile=2)),
            "Q8_0 m4": ("Q8_0", dict(m_tile=4)), "Q8_0 m2": ("Q8_0", dict(m_tile=2))}
    with _config_tables() as ((base_mma, _, base_gemv), reset):
        for label, kw in mma.items():
            qmma.QMMA_CONFIGS["Q5_0"] = replace(base_mma["Q5_0"], **kw)
            bench_runner(m, f"tile_sweep mma {label}", (1, 16), out, rows, bw)
            reset()
        _gemv_variants(m, "tile_sweep gemv", gemv, base_gemv, reset, out, rows, bw)


def stage_form_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Under PDL a product's first K step is decoded before its wait, which hides most of the
    tensor-core form's costlier decode: which formats should take it now (1, 4, 16 slots)."""
    from workbench.kernels import qmatmul, qmma

    C = qmma.MmaConfig
    tiles = {"n64k128": C(64, 128, 4), "n32k128": C(32, 128, 4), "n64k256": C(64, 256, 4)}
    cands = [("Q4_K", "n64k128"), ("Q4_K", "n32k128"), ("Q4_K", "n64k256"), ("Q6_K", "n64k128"), ("Q8_0", "n64k128"),
             ("Q4_K+Q6_K", "n64k128"), ("Q4_K+Q6_K", "n32k128"), ("Q4_K+Q6_K+Q8_0", "n64k128"),
             ("Q4_K+Q6_K+Q8_0", "n32k128"), ("Q4_K+Q6_K+Q8_0", "n64k256")]
    with _config_tables() as ((_, _, base_gemv), reset):
        for fmts, tile in cands:
            for f in ("Q4_K", "Q6_K", "Q8_0"):
                qmma.QMMA_CONFIGS[f] = tiles[tile]
            forms = {"Q5_0": "mma", **{f: "mma" for f in fmts.split("+")}}
            bench_runner(m, f"form_sweep {fmts} mma {tile}", (1, 4, 16), out, rows, bw, layer_forms=forms)
        reset()
        qmatmul.QGEMV_CONFIGS["Q8_0"] = replace(base_gemv["Q8_0"], m_tile=4)
        bench_runner(m, "form_sweep gemv Q8_0 m4", (1, 4, 16), out, rows, bw)


def stage_m32(m, out: Path, rows: list, bw: float) -> None:
    """32-row tensor-core tiles for the layers (then the head too): fixed per weight, so 1..16
    rows pay a 32-wide MMA and 32 rows take one tile instead of two."""
    from workbench.kernels import qmma

    with _config_tables() as ((base, base_wide, _), _reset):
        for k, cfg in base.items():
            qmma.QMMA_CONFIGS[k] = replace(cfg, block_m=32)
        bench_runner(m, "m32 layers", SLOTS, out, rows, bw)
        for k, cfg in base_wide.items():
            qmma.QMMA_WIDE_CONFIGS[k] = replace(cfg, block_m=32)
        bench_runner(m, "m32 layers and head", SLOTS, out, rows, bw)


def stage_head_prefetch(m, out: Path, rows: list, bw: float) -> None:
    """The head (unsplit Q8_0, 178 MB, 150-200 us per step in session 4's timelines: ~1 TB/s)
    with L2 prefetch of each program's tile and of the tile ``prefetch`` programs ahead, and two
    wider tiles with it; end to end at every slot count."""
    from workbench.kernels import qmma

    with _config_tables() as ((_, base_wide, _), reset):
        head = base_wide["Q8_0"]
        for label, cfg in (("none", head), *[(f"pf{p}", replace(head, prefetch=p)) for p in (0, 132, 264, 528, 1056)],
                           ("n128w8 pf264", replace(head, block_n=128, num_warps=8, prefetch=264)),
                           ("k256w8 pf264", replace(head, block_k=256, num_warps=8, prefetch=264))):
            reset()
            qmma.QMMA_WIDE_CONFIGS["Q8_0"] = cfg
            bench_runner(m, f"head {label}", SLOTS, out, rows, bw)


def stage_head_dense(m, out: Path, rows: list, bw: float) -> None:
    """The head on its dequantized bf16 copy (kernels.dense_mma: 335 MB of plain loads, no
    decode) in six tilings, beside the packed tensor-core head; end to end at every slot count."""
    from workbench.kernels import dense_mma as dm

    bench_runner(m, "head mma", SLOTS, out, rows, bw, matmul="mma", head_matmul="mma")
    saved = dm.DENSE_CONFIG
    try:
        for cfg in (dm.DenseConfig(64, 128, 4, 3), dm.DenseConfig(128, 128, 4, 3), dm.DenseConfig(128, 64, 4, 4),
                    dm.DenseConfig(64, 64, 4, 4), dm.DenseConfig(256, 64, 8, 3), dm.DenseConfig(128, 128, 8, 4),
                    dm.DenseConfig(64, 128, 4, 3, block_m=32)):
            dm.DENSE_CONFIG = cfg
            bench_runner(m, f"head dense n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                         f" m{cfg.block_m}", SLOTS, out, rows, bw, matmul="mma", head_matmul="dense")
    finally:
        dm.DENSE_CONFIG = saved


def _head_sweep(m, out: Path, rows: list, bw: float, cases) -> tuple | None:
    """Each (variant, head form, DenseConfig fields) at 1 / 16 / 32 slots; the fastest at 16
    slots as (step ms, head form, config, variant), or None."""
    import workbench.triton_runner as tr
    from workbench.kernels import dense_mma as dm

    best = None
    for variant, head, fields in cases:
        cfg = replace(dm.DENSE_CONFIG, **fields)
        _patched(tr, "HEAD_MATMUL", head, lambda cfg=cfg, variant=variant: _patched(
            dm, "DENSE_CONFIG", cfg, lambda: bench_runner(m, variant, (1, 16, 32), out, rows, bw)))
        ms = [r["step_ms"] for r in rows if r.get("variant") == variant and r.get("slots") == 16 and "step_ms" in r]
        if ms and (best is None or ms[0] < best[0]):
            best = (ms[0], head, cfg, variant)
    return best


def stage_q8_head_sweep(m, out: Path, rows: list, bw: float) -> None:
    """The head from its Q8_0 planes (``q8_dense_mma``), one program per tile, at a few tilings."""
    _head_sweep(m, out, rows, bw, [
        (f"triton_q8_head_n{bn}_k{bk}_s{st}_w{w}", "q8dense",
         dict(block_n=bn, block_k=bk, num_stages=st, num_warps=w, programs_per_sm=0))
        for bn, bk, st, w in ((128, 128, 3, 4), (64, 128, 4, 4), (64, 256, 3, 4), (128, 128, 4, 8), (64, 64, 6, 4))])


def stage_head_stream(m, out: Path, rows: list, exact_rows: list, bw: float) -> None:
    """The head in the streaming form (``DenseConfig.programs_per_sm``), from its Q8_0 planes
    and from the dequantized copy, at a few tilings; then the exactness stage with the fastest
    at 16 slots."""
    import workbench.triton_runner as tr
    from workbench.kernels import dense_mma as dm

    best = _head_sweep(m, out, rows, bw, [
        (f"triton_{head}_stream_n{bn}_k{bk}_s{st}_p{p}", head,
         dict(block_n=bn, block_k=bk, num_stages=st, programs_per_sm=p))
        for head, bn, bk, st, p in (("q8dense", 64, 128, 3, 2), ("q8dense", 64, 128, 4, 3), ("q8dense", 128, 128, 3, 2),
                                    ("q8dense", 128, 64, 4, 2), ("q8dense", 64, 256, 3, 2), ("q8dense", 64, 64, 6, 3),
                                    ("dense", 64, 128, 3, 2), ("dense", 128, 64, 4, 1))])
    if best is not None:
        log(f"head stream: fastest at 16 slots {best[3]} ({best[0]:.3f} ms); exactness with it")
        _patched(tr, "HEAD_MATMUL", best[1], lambda: _patched(dm, "DENSE_CONFIG", best[2], lambda: stage_exact(
            m, out, exact_rows)))


def _mma_configs(**per_format) -> dict:
    """kernels.qmma.QMMA_CONFIGS with some formats' fields changed (format=dict of fields)."""
    from workbench.kernels import qmma as QM

    return {**QM.QMMA_CONFIGS, **{f: replace(QM.QMMA_CONFIGS[f], **kw) for f, kw in per_format.items()}}


def _gemv_configs(**per_format) -> dict:
    """kernels.qmatmul.QGEMV_CONFIGS likewise."""
    from workbench.kernels import qmatmul as QMm

    return {**QMm.QGEMV_CONFIGS, **{f: replace(QMm.QGEMV_CONFIGS[f], **kw) for f, kw in per_format.items()}}


def stage_sweep(m, out: Path, rows: list, bw: float, prefix: str, variants, slots=(1, 16)) -> None:
    """Options one at a time against the defaults: each variant is (label, patch, kw), patch a
    (module, name, value) set for the variant's runner (or a list of them, or None), kw the
    runner's arguments."""
    for label, patch, kw in variants:
        def go(kw=kw, name=f"{prefix} {label}"):
            bench_runner(m, name, slots, out, rows, bw, **kw)

        _with(patch, go)


def stage_s7_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Session 7's small options one at a time against the defaults (1 and 16 slots): the mixed
    q|k|v as one launch, the per-row kernels' warps, attention at 4 warps, product tilings."""
    from workbench.kernels import attention as A
    from workbench.kernels import qmma as QM
    from workbench.kernels import step_fused as SF

    def mma(fmt, **kw):
        return QM, "QMMA_CONFIGS", _mma_configs(**{fmt: kw})

    stage_sweep(m, out, rows, bw, "s7", [
        ("pair", None, {"pair_launch": True}),
        ("norm w1", (SF, "ADD_NORM_WARPS", 1), {}), ("norm w2", (SF, "ADD_NORM_WARPS", 2), {}),
        ("norm w8", (SF, "ADD_NORM_WARPS", 8), {}),
        ("rope w1", (SF, "QK_ROPE_WARPS", 1), {}), ("rope w2", (SF, "QK_ROPE_WARPS", 2), {}),
        ("attn w4", (A, "ATTENTION_SMALL_TILE", 1 << 30), {}),
        ("Q4_K n32", mma("Q4_K", block_n=32), {}), ("Q4_K n128", mma("Q4_K", block_n=128), {}),
        ("Q4_K w8", mma("Q4_K", num_warps=8), {}),
        ("Q6_K n32", mma("Q6_K", block_n=32), {}), ("Q6_K n128", mma("Q6_K", block_n=128), {}),
        ("Q6_K w8", mma("Q6_K", num_warps=8), {}),
        ("Q5_0 n16", mma("Q5_0", block_n=16), {}), ("Q5_0 n64", mma("Q5_0", block_n=64), {}),
        ("Q5_0 w8", mma("Q5_0", num_warps=8), {}),
    ])


def stage_s8_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Session 8: the QK-norm/rope/KV prologue in attention with attention's warps and segment
    around it, and the same knobs without it."""
    import workbench.triton_runner as tr

    from workbench.kernels import step_fused as SF

    on = {"rope_in_attention": True}
    stage_sweep(m, out, rows, bw, "s8", [
        ("rope attn", None, on), ("rope attn w8", (tr, "ATTN_WARPS", 8), on),
        ("rope attn seg64", None, {**on, "attn_segment": 64}), ("seg64", None, {"attn_segment": 64}),
        ("rope w8", (SF, "QK_ROPE_WARPS", 8), {}),
    ])


def stage_q8f16_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Session 9: the Q8_0 head from its planes with float16 operands (no conversion instruction
    per weight) in tilings around the dense head's (64 outputs x 128 weights, 3 stages, 2
    programs per multiprocessor, 32 rows)."""
    from workbench.kernels import dense_mma as DM

    def cfg(**kw):
        return DM, "DENSE_CONFIG", replace(DM.DenseConfig(), **kw)

    stage_sweep(m, out, rows, bw, "s9 q8f16", [
        (label, cfg(**kw), {"head_matmul": "q8f16"}) for label, kw in (
            ("n128", dict(block_n=128)), ("k256", dict(block_k=256)), ("k64 s6", dict(block_k=64, num_stages=6)),
            ("s4", dict(num_stages=4)), ("s2", dict(num_stages=2)), ("p3", dict(programs_per_sm=3)),
            ("p1", dict(programs_per_sm=1)), ("w8 n128", dict(block_n=128, num_warps=8)))])


def _q8_head(p: int | None = None, **kw) -> list:
    """Patches for a Q8_0-plane head's tiling: DenseConfig fields changed from the defaults, and
    (p) the programs per multiprocessor those forms take (``Q8_PROGRAMS_PER_SM``)."""
    from workbench.kernels import dense_mma as DM

    return [(DM, "DENSE_CONFIG", replace(DM.DenseConfig(), **kw))] + ([(DM, "Q8_PROGRAMS_PER_SM", p)] if p else [])


def stage_q8i8_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Session 10: the Q8_0 head as integer MMAs on x's Q8_0 blocks (``head_matmul="q8i8"``) in
    tilings around the Q8_0 forms' (64 outputs x 128 weights, 3 stages, 3 programs per SM)."""
    stage_sweep(m, out, rows, bw, "s10 q8i8", [
        (label, _q8_head(**kw), {"head_matmul": "q8i8"}) for label, kw in (
            ("p2", dict(p=2)), ("p4", dict(p=4)), ("n128 p2", dict(block_n=128, p=2)), ("k256", dict(block_k=256)),
            ("k64 s4", dict(block_k=64, num_stages=4)), ("s4", dict(num_stages=4)), ("m16", dict(block_m=16)))])


def stage_attn_sweep(m, out: Path, rows: list, bw: float) -> None:
    """Session 9 (run 47, against session 8's attention: 16-key blocks, two per 32-key segment):
    keys per block at D = 256 and per segment, and the attention warps."""
    import workbench.triton_runner as tr

    from workbench.kernels import attention as A

    def n(bn, seg=32):  # (run 47 against session 8's defaults: 16-key blocks, 32-key segments)
        return [(A, "ATTENTION_BLOCK_N_16BIT", {**A.ATTENTION_BLOCK_N_16BIT, 256: bn}), (tr, "ATTN_SEGMENT", seg)]

    stage_sweep(m, out, rows, bw, "s9", [
        ("attn n32", n(32), {}), ("attn n32 w8", [*n(32), (tr, "ATTN_WARPS", 8)], {}),
        ("seg64", n(16, 64), {}), ("attn n32 seg64", n(32, 64), {}), ("attn n64 seg64", n(64, 64), {})])


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


def main_stage(args) -> None:
    import workbench.triton_runner as tr
    from workbench.kernels import attention as A
    from workbench.kernels import dense_mma as dm
    from workbench.kernels import persistent as ps
    from workbench.model import load_model

    FOLDS = {"FUSE_ADD_NORM": True, "FUSE_QK_ROPE": True}  # the two close (not bitwise) folds together
    N64 = [(A, "ATTENTION_BLOCK_N_16BIT", {**A.ATTENTION_BLOCK_N_16BIT, 256: 64}), (tr, "ATTN_SEGMENT", 64)]  # (s9)
    OLD_ATTN = [(A, "ATTENTION_BLOCK_N_16BIT", {**A.ATTENTION_BLOCK_N_16BIT, 256: 16}), (tr, "ATTN_SEGMENT", 32)]  # (s8)
    from workbench.kernels import pdl
    from workbench.kernels import qmatmul as QMm
    from workbench.kernels import qmma as QM

    from workbench.kernels import step_fused as SFm

    cfgs, gemv_cfgs = _mma_configs, _gemv_configs
    S10_QKV = [(QMm, "QMATMUL_NARROW_N", 2048)]  # q|k|v in 128-weight slices (s10)
    S10_ARG = [(tr, "ARGMAX_IN_HEAD", True)]
    S10_ROPE8 = [(tr, "ROPE_IN_ATTENTION", True), (tr, "ATTN_WARPS", 8)]  # (s10)
    S10_GLU = [(tr, "GLU_IN_DOWN", True)]  # the down product forms the GLU from gate|up's partials (s10)
    S11_PRE = [(A, "ATTENTION_PRELOAD", True)]  # older K/V rows loaded before the attention's PDL wait (s11)
    S11_I8 = [(dm, "I8_STEP", "batched"), (tr, "HEAD_MATMUL", "q8i8")]  # q8i8 head, batched step, tiles by M (s11)
    S12_I8_ARG = [(tr, "ARGMAX_IN_HEAD_FORMS", {"dense": 64, "q8i8": 64})]  # (s12: the int8 head's at any rows)
    S11_32 = ((32, dict(temperature=0.0)),)  # (32 rows take the q8i8 head's 32-row tiles, one row alone 16)

    # K slices of 128 weights (every format's step at 128, so one step per program)
    split128 = [(QMm, "QMATMUL_SPLIT_K", 128),
                (QM, "QMMA_CONFIGS", cfgs(**{f: {"block_k": 128} for f in ("Q4_K", "Q6_K", "Q8_0")})),
                (QMm, "QGEMV_CONFIGS", gemv_cfgs(**{f: {"block_k": 128} for f in ("Q4_K", "Q6_K", "Q8_0")}))]
    # per-format K slices (kernels.qmatmul.QMATMUL_FORMAT_SPLIT_K): the Q5_0-led products (q|k|v,
    # gate|up), the K-quant ones (attention output, FFN down), all
    SLICES = {"q5 128": {"Q5_0": 128}, "k 128": {"Q4_K": 128, "Q6_K": 128},
              "all 128": {f: 128 for f in ("Q5_0", "Q4_K", "Q6_K", "Q8_0")}}
    k128 = cfgs(Q5_0={"preload": True}, Q4_K={"block_k": 128, "preload": True}, Q6_K={"block_k": 128, "preload": True})

    def tuned(fn):  # session 7's three step options together (kernels/pdl EARLY, attention prefetch, Q5_0 k256)
        return _with([(pdl, "EARLY", True), (A, "ATTENTION_PREFETCH", True),
                      (QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_k": 256}))], fn)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump(out, "fingerprint.json", fingerprint())
    t0 = time.perf_counter()
    m = load_model(args.model, dtype="bfloat16")
    log(f"model loaded in {time.perf_counter() - t0:.1f}s")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    rows: list = [dict(stage="copy_bw", copy_bw_gbs=bw / 1e9)]
    dump(out, "bench.json", rows)
    exact_rows: list = []
    prof_rows: list = []
    fsweep = [("f " + "+".join(fs), fs) for fs in (("Q5_0",), ("Q4_K",), ("Q6_K",), ("Q8_0",), ("Q5_0", "Q4_K"),
                                                   ("Q5_0", "Q6_K", "Q8_0"), ("Q4_K", "Q6_K", "Q8_0"))]
    for name, fn in (
        *[(label, (lambda fs=fs, label=label: bench_runner(
            m, f"gemv_mmahead_{label.replace(' ', '_')}_mma", (1, 16), out, rows, bw, matmul="gemv", head_matmul="mma",
            layer_forms={f: "mma" for f in fs}))) for label, fs in fsweep],
        ("default", lambda: bench_runner(m, "triton_default", SLOTS, out, rows, bw)),
        ("nopdl", lambda: bench_runner(m, "triton_default_nopdl", SLOTS, out, rows, bw, pdl=False)),
        ("cublas nopdl", lambda: bench_runner(m, "cublas_bf16_seg32_nopdl", SLOTS, out, rows, bw, dense="cublas_bf16",
                                              pdl=False)),
        ("torch path", lambda: stage_torch_path(args.model, out, rows)),
        ("unfused combine", lambda: bench_runner(m, "triton_default_unfused_combine", SLOTS, out, rows, bw, fuse_combine=False)),
        ("v32 mma", lambda: bench_runner(m, "mma_seg32", SLOTS, out, rows, bw, matmul="mma")),
        ("v32 gemv", lambda: bench_runner(m, "gemv_seg32", SLOTS, out, rows, bw, matmul="gemv")),
        ("v32 mma+gemv head", lambda: bench_runner(m, "mma_gemvhead_seg32", SLOTS, out, rows, bw, matmul="mma", head_matmul="gemv")),
        ("v32 gemv+mma head", lambda: bench_runner(m, "gemv_mmahead_seg32", SLOTS, out, rows, bw, matmul="gemv", head_matmul="mma")),
        ("v32 cublas", lambda: bench_runner(m, "cublas_bf16_seg32", SLOTS, out, rows, bw, dense="cublas_bf16")),
        ("v32 profile", lambda: stage_profile(m, out, prof_rows)),
        ("mma graphs", lambda: bench_runner(m, "triton_mma_graphs", SLOTS, out, rows, bw, matmul="mma")),
        ("cublas bf16 graphs", lambda: bench_runner(m, "cublas_bf16_graphs", SLOTS, out, rows, bw, dense="cublas_bf16")),
        ("gemv graphs", lambda: bench_runner(m, "triton_gemv_graphs", SLOTS, out, rows, bw, matmul="gemv")),
        ("mma seg64", lambda: bench_runner(m, "triton_mma_graphs_seg64", SLOTS, out, rows, bw, matmul="mma", attn_segment=64)),
        ("mma seg32", lambda: bench_runner(m, "triton_mma_graphs_seg32", SLOTS, out, rows, bw, matmul="mma", attn_segment=32)),
        ("mma exact", lambda: stage_exact(m, out, exact_rows)),
        ("mma engine", lambda: bench_engine(m, (1, 4, 16), out, rows)),
        ("mma profile", lambda: stage_profile(m, out, prof_rows)),
        ("mma sweep", lambda: stage_mma_sweep(m, out, rows, bw)),
        ("pdl sweep", lambda: stage_pdl_sweep(m, out, rows, bw)),
        ("tile sweep", lambda: stage_tile_sweep(m, out, rows, bw)),
        ("form sweep", lambda: stage_form_sweep(m, out, rows, bw)),
        ("m32", lambda: stage_m32(m, out, rows, bw)),
        ("head prefetch", lambda: stage_head_prefetch(m, out, rows, bw)),
        ("head dense", lambda: stage_head_dense(m, out, rows, bw)),
        ("head m32", lambda: _patched(dm, "DENSE_CONFIG", dm.DenseConfig(block_m=32),
                                      lambda: bench_runner(m, "head dense m32", SLOTS, out, rows, bw))),
        ("head m32 exact", lambda: _patched(dm, "DENSE_CONFIG", dm.DenseConfig(block_m=32),
                                            lambda: stage_exact(m, out, exact_rows))),
        ("persistent exact", lambda: stage_persistent_exact(m, out, exact_rows)),
        ("persistent", lambda: bench_runner(m, "triton_persistent", SLOTS, out, rows, bw, persistent=True)),
        ("chain w4", lambda: bench_runner(m, "triton_chain_uniform_warps", SLOTS, out, rows, bw,
                                          setup=lambda r: setattr(r, "uniform_warps", tr.PERSISTENT_WARPS))),
        ("persistent p1", lambda: _patched(ps, "PROGRAMS_PER_SM", 1, lambda: bench_runner(
            m, "triton_persistent_1_per_sm", SLOTS, out, rows, bw, persistent=True))),
        ("persistent static", lambda: _patched(ps, "ASSIGN", "static", lambda: bench_runner(
            m, "triton_persistent_static", SLOTS, out, rows, bw, persistent=True))),
        ("persistent atomic", lambda: _patched(ps, "POLL", "atomic", lambda: bench_runner(
            m, "triton_persistent_atomic_poll", SLOTS, out, rows, bw, persistent=True))),
        ("persistent static atomic", lambda: _patched_all(ps, {"ASSIGN": "static", "POLL": "atomic"}, lambda: bench_runner(
            m, "triton_persistent_static_atomic_poll", SLOTS, out, rows, bw, persistent=True))),
        ("persistent static r168", lambda: _patched_all(ps, {"ASSIGN": "static", "MAXNREG": 168}, lambda: bench_runner(
            m, "triton_persistent_static_maxnreg168", SLOTS, out, rows, bw, persistent=True))),
        ("persistent r168", lambda: _patched(ps, "MAXNREG", 168, lambda: bench_runner(
            m, "triton_persistent_maxnreg168", SLOTS, out, rows, bw, persistent=True))),
        ("persistent static exact", lambda: _patched(ps, "ASSIGN", "static", lambda: stage_persistent_exact(
            m, out, exact_rows))),
        ("persistent engine exact", lambda: _patched(tr, "PERSISTENT", True, lambda: stage_exact(m, out, exact_rows))),
        ("persistent profile", lambda: _patched(tr, "PERSISTENT", True, lambda: stage_profile(m, out, prof_rows))),
        ("early", lambda: _patched(pdl, "EARLY", True, lambda: bench_runner(
            m, "triton_pdl_early", SLOTS, out, rows, bw))),
        ("attn prefetch", lambda: _patched(A, "ATTENTION_PREFETCH", True, lambda: bench_runner(
            m, "triton_attention_prefetch", SLOTS, out, rows, bw))),
        ("q5 k256", lambda: _patched(QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_k": 256}), lambda: bench_runner(
            m, "triton_q5_k256", SLOTS, out, rows, bw))),
        ("q5 n64 k256", lambda: _patched(QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_n": 64, "block_k": 256}),
                                    lambda: bench_runner(
            m, "triton_q5_n64_k256", SLOTS, out, rows, bw))),
        ("tuned", lambda: tuned(lambda: bench_runner(m, "triton_tuned", SLOTS, out, rows, bw))),
        ("q8 head", lambda: _patched(tr, "HEAD_MATMUL", "q8dense", lambda: bench_runner(
            m, "triton_q8_head", SLOTS, out, rows, bw))),
        ("q8 head sweep", lambda: stage_q8_head_sweep(m, out, rows, bw)),
        ("head stream", lambda: stage_head_stream(m, out, rows, exact_rows, bw)),
        ("q8 head exact", lambda: _patched(tr, "HEAD_MATMUL", "q8dense", lambda: stage_exact(m, out, exact_rows))),
        ("s7 sweep", lambda: stage_s7_sweep(m, out, rows, bw)),
        ("s7 more", lambda: [_patched(mod, name, v, lambda label=label: bench_runner(
            m, f"s7 {label}", (1, 16), out, rows, bw)) for label, mod, name, v in (
            ("norm w16", SFm, "ADD_NORM_WARPS", 16), ("rope w8", SFm, "QK_ROPE_WARPS", 8),
            ("rope w1", SFm, "QK_ROPE_WARPS", 1), ("attn w8", tr, "ATTN_WARPS", 8))]),
        ("rope attn", lambda: bench_runner(m, "triton_rope_in_attention", SLOTS, out, rows, bw,
                                           rope_in_attention=True)),
        ("rope attn same bits", lambda: stage_same_bits(m, out, exact_rows, "QK-norm/rope/KV in attention",
                                                        lambda fn: _patched(tr, "ROPE_IN_ATTENTION", True, fn))),
        ("s8 sweep", lambda: stage_s8_sweep(m, out, rows, bw)),
        ("q8f16", lambda: bench_runner(m, "triton_q8f16_head", SLOTS, out, rows, bw, head_matmul="q8f16")),
        ("q8f16 sweep", lambda: stage_q8f16_sweep(m, out, rows, bw)),
        ("attn sweep", lambda: stage_attn_sweep(m, out, rows, bw)),
        ("attn n32 exact", lambda: _with([(A, "ATTENTION_BLOCK_N_16BIT", {**A.ATTENTION_BLOCK_N_16BIT, 256: 32}),
                                          (tr, "ATTN_SEGMENT", 32)], lambda: stage_exact(m, out, exact_rows))),
        ("attn n64", lambda: _with(N64, lambda: bench_runner(m, "triton_attn_n64_seg64", SLOTS, out, rows, bw))),
        ("attn old", lambda: _with(OLD_ATTN, lambda: bench_runner(m, "triton_attn_n16_seg32", SLOTS, out, rows, bw))),
        ("attn n64 more", lambda: stage_sweep(m, out, rows, bw, "s9", [
            ("attn n64 seg64 w8", N64 + [(tr, "ATTN_WARPS", 8)], {}),
            ("attn n64 seg128", [(A, "ATTENTION_BLOCK_N_16BIT", {**A.ATTENTION_BLOCK_N_16BIT, 256: 64}),
                                 (tr, "ATTN_SEGMENT", 128)],
             {})])),
        ("attn n64 exact", lambda: _with(N64, lambda: stage_exact(m, out, exact_rows))),
        ("attn stages", lambda: stage_sweep(m, out, rows, bw, "s10", [
            (f"attn stages {n}", (A, "ATTENTION_NUM_STAGES", n), {}) for n in (1, 2)], slots=SLOTS)),
        ("narrow 2048", lambda: stage_sweep(m, out, rows, bw, "s10", [
            ("q|k|v in 128-weight slices", (QMm, "QMATMUL_NARROW_N", 2048), {}),
            ("every product in 128-weight slices", (QMm, "QMATMUL_NARROW_N", 4096), {}),
            ("every product in 128-weight slices, Q5_0 64-output tiles", [
                (QMm, "QMATMUL_NARROW_N", 4096), (QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_n": 64}))], {}),
        ], slots=SLOTS)),
        ("glu down", lambda: stage_sweep(m, out, rows, bw, "s10", [
            ("GLU formed by the down product", S10_GLU, {}),
            ("GLU by down, gate|up in 128-weight slices", S10_GLU + [(QMm, "QMATMUL_NARROW_N", 4096)], {}),
            ("GLU by down, gate|up 128, Q5_0 n64", S10_GLU + [(QMm, "QMATMUL_NARROW_N", 4096), (QM, "QMMA_CONFIGS", cfgs(
                Q5_0={"block_n": 64}))], {}),
            ("GLU by down + rope in attention", S10_GLU + [(tr, "ROPE_IN_ATTENTION", True)], {}),
        ], slots=SLOTS)),
        ("glu down same bits", lambda: stage_same_bits(m, out, exact_rows, "GLU formed by the down product",
                                                       lambda fn: _with(S10_GLU, fn))),
        ("glu down exact", lambda: _with(S10_GLU, lambda: stage_exact(m, out, exact_rows))),
        ("glu down profile", lambda: _with(S10_GLU, lambda: stage_profile(m, out, prof_rows))),
        ("s10 knobs", lambda: stage_sweep(m, out, rows, bw, "s10", [
            ("add+norm at 4 warps", (SFm, "ADD_NORM_WARPS", 4), {}),
            ("add+norm at 16 warps", (SFm, "ADD_NORM_WARPS", 16), {}),
            ("QK-norm/rope at 4 warps", (SFm, "QK_ROPE_WARPS", 4), {}),
            ("QK-norm/rope at 16 warps", (SFm, "QK_ROPE_WARPS", 16), {}),
            ("rope in attention", (tr, "ROPE_IN_ATTENTION", True), {}),
            ("q8i8 head, 16-row tiles, 4 programs per SM", _q8_head(4, block_m=16), {"head_matmul": "q8i8"}),
        ], slots=SLOTS)),
        ("rope attn w8", lambda: stage_sweep(m, out, rows, bw, "s10", [
            ("rope in attention, attention at 8 warps", S10_ROPE8, {}),
            ("rope in attention", (tr, "ROPE_IN_ATTENTION", True), {}),
        ], slots=SLOTS)),
        ("rope attn w8 exact", lambda: _with(S10_ROPE8, lambda: stage_exact(m, out, exact_rows))),
        ("s14", lambda: stage_sweep(m, out, rows, bw, "s14", [  # (run 68's s14: at a21c4dc)
            (f"weight loads {w}", [(SFm, "WEIGHT_LOADS", w)], {}) for w in ("in_order", "before_wait")], slots=SLOTS)),
        ("s14 same bits", lambda: stage_same_bits(
            m, out, exact_rows, "weight loads in order vs after the wait", lambda fn: _patched(SFm, "WEIGHT_LOADS", "in_order", fn))),
        ("s13", lambda: stage_sweep(m, out, rows, bw, "s13", [  # (run 66's s13: at d61d640)
            ("head: the dequantized bf16 copy (the default until session 12)", [(tr, "HEAD_MATMUL", "dense")], {}),
            ("q8i8 head, its argmax after it at every row count", [(tr, "ARGMAX_IN_HEAD_FORMS", {"dense": 64})], {}),
        ], slots=SLOTS)),
        ("s13 exact", lambda: stage_exact(m, out, exact_rows, EXACT_SIZES + S11_32)),
        ("s12", lambda: stage_sweep(m, out, rows, bw, "s12", [
            ("q8i8 head, argmax after it", S11_I8, {}),
            ("q8i8 head, argmax in it (best in the store's layout)", S11_I8 + S12_I8_ARG, {}),
            ("the same, best in tl.full's layout", S11_I8 + S12_I8_ARG + [(dm, "I8_BEST_IN_STORE_LAYOUT", False)], {}),
        ], slots=SLOTS)),
        ("s12 same tokens", lambda: _with(S11_I8, lambda: stage_same_tokens(
            m, out, exact_rows, "q8i8 head's argmax in the head vs after it", lambda fn: _with(S12_I8_ARG, fn)))),
        ("s12 i8 exact", lambda: _with(S11_I8 + S12_I8_ARG, lambda: stage_exact(m, out, exact_rows, EXACT_SIZES + S11_32))),
        ("s11c", lambda: stage_sweep(m, out, rows, bw, "s11c", [
            ("embedding and norm as two launches (EMBED_NORM off)", [(tr, "EMBED_NORM", False)], {}),
            ("q8i8 head, argmax after it", S11_I8, {}),
        ], slots=SLOTS)),
        ("s11c embed same bits", lambda: stage_same_bits(
            m, out, exact_rows, "embedding + norm in one launch vs two (EMBED_NORM off)",
            lambda fn: _patched(tr, "EMBED_NORM", False, fn))),
        ("s11b", lambda: stage_sweep(m, out, rows, bw, "s11b", [
            ("attention K/V after the wait (preload off)", [(A, "ATTENTION_PRELOAD", False)], {}),
            ("decode_loop copies each step's tokens (GRAPH_HISTORY 0)", [(tr, "GRAPH_HISTORY", 0)], {}),
            ("q8i8 head, batched step, argmax after it", S11_I8 + [(tr, "ARGMAX_IN_HEAD", False)], {}),
        ], slots=SLOTS)),
        ("s11b i8 exact", lambda: _with(S11_I8 + [(tr, "ARGMAX_IN_HEAD", False)], lambda: stage_exact(
            m, out, exact_rows, EXACT_SIZES + S11_32))),
        ("s11", lambda: stage_sweep(m, out, rows, bw, "s11", [
            ("attention K/V preloaded", S11_PRE, {}),
            ("q8i8 head, batched step, tiles by M", S11_I8, {}),
            ("both", S11_PRE + S11_I8, {}),
        ], slots=SLOTS)),
        ("s11 preload same bits", lambda: stage_same_bits(
            m, out, exact_rows, "attention K/V preloaded before the wait vs the defaults", lambda fn: _with(S11_PRE, fn))),
        ("s11 i8 exact", lambda: _with(S11_I8, lambda: stage_exact(m, out, exact_rows, EXACT_SIZES + S11_32))),
        ("s11 both exact", lambda: _with(S11_PRE + S11_I8, lambda: stage_exact(
            m, out, exact_rows, EXACT_SIZES + S11_32))),
        ("s11 both profile", lambda: _with(S11_PRE + S11_I8, lambda: stage_profile(m, out, prof_rows))),
        ("s11 preload profile", lambda: _with(S11_PRE, lambda: stage_profile(m, out, prof_rows))),
        ("q8i8 batched", lambda: stage_sweep(m, out, rows, bw, "s11 q8i8 batched", [
            (label, [(dm, "I8_STEP", "batched")] + patches, {"head_matmul": "q8i8"}) for label, patches in (
                ("p3", []), ("p4", _q8_head(4)), ("m16 p4", _q8_head(4, block_m=16)),
                ("n128 p2", _q8_head(2, block_n=128)),
            )], slots=SLOTS)),
        ("q8i8 batched same bits", lambda: _patched(tr, "HEAD_MATMUL", "q8i8", lambda: stage_same_bits(
            m, out, exact_rows, "q8i8 head, a step's blocks in one batched dot, vs q8i8 (its base)",
            lambda fn: _patched(dm, "I8_STEP", "batched", fn)))),
        ("q8i8", lambda: bench_runner(m, "s10 q8i8 head", SLOTS, out, rows, bw, head_matmul="q8i8")),
        ("q8i8 sweep", lambda: stage_q8i8_sweep(m, out, rows, bw)),
        ("q8i8 exact", lambda: _patched(tr, "HEAD_MATMUL", "q8i8", lambda: stage_exact(m, out, exact_rows))),
        ("q8i8 profile", lambda: _patched(tr, "HEAD_MATMUL", "q8i8", lambda: stage_profile(m, out, prof_rows))),
        ("s10 combos", lambda: stage_sweep(m, out, rows, bw, "s10", [
            ("q|k|v 128 + argmax head", S10_QKV + S10_ARG, {}),
            ("q|k|v 128 + argmax head + Q5_0 n64", S10_QKV + S10_ARG + [(QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_n": 64}))], {}),
            ("all 128 + Q5_0 n64 + argmax head", [(QMm, "QMATMUL_NARROW_N", 4096), (QM, "QMMA_CONFIGS", cfgs(
                Q5_0={"block_n": 64}))] + S10_ARG, {}),
            ("q|k|v 128 + argmax head + Q5_0 n16", S10_QKV + S10_ARG + [(QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_n": 16}))], {}),
        ], slots=SLOTS)),
        ("s10 combo exact", lambda: _with(S10_QKV + S10_ARG, lambda: stage_exact(m, out, exact_rows))),
        ("narrow 2048 exact", lambda: _patched(QMm, "QMATMUL_NARROW_N", 2048, lambda: stage_exact(m, out, exact_rows))),
        ("argmax head", lambda: _patched(tr, "ARGMAX_IN_HEAD", True, lambda: bench_runner(
            m, "s10 argmax kept by the head's programs", SLOTS, out, rows, bw))),
        ("argmax head same tokens", lambda: stage_same_tokens(m, out, exact_rows, "argmax kept by the head's programs",
                                                              lambda fn: _patched(tr, "ARGMAX_IN_HEAD", True, fn))),
        ("v mma", lambda: bench_runner(m, "s10 Q8_0 layers on tensor cores", SLOTS, out, rows, bw, layer_forms={})),
        ("attn stages same bits", lambda: stage_same_bits(m, out, exact_rows, "attention at 1 pipelining stage",
                                                          lambda fn: _patched(A, "ATTENTION_NUM_STAGES", 1, fn))),
        ("attn n64 profile", lambda: _with(N64, lambda: stage_profile(m, out, prof_rows))),
        ("x f32", lambda: _patched(tr, "HEAD_X_HALF", False, lambda: bench_runner(
            m, "triton_head_x_f32", SLOTS, out, rows, bw))),
        ("q8f16 x f32", lambda: _patched(tr, "HEAD_X_HALF", False, lambda: bench_runner(
            m, "triton_q8f16_head_x_f32", SLOTS, out, rows, bw, head_matmul="q8f16"))),
        ("x half same bits", lambda: stage_same_bits(m, out, exact_rows, "head input in float32 (HEAD_X_HALF off)",
                                                     lambda fn: _patched(tr, "HEAD_X_HALF", False, fn))),
        ("q8f16 exact", lambda: _patched(tr, "HEAD_MATMUL", "q8f16", lambda: stage_exact(m, out, exact_rows))),
        ("q8f16 profile", lambda: _patched(tr, "HEAD_MATMUL", "q8f16", lambda: stage_profile(m, out, prof_rows))),
        ("preload sweep", lambda: stage_sweep(m, out, rows, bw, "s8", [
            ("q5 preload", (QM, "QMMA_CONFIGS", cfgs(Q5_0={"preload": True})), {}),
            ("q5 k64 preload", (QM, "QMMA_CONFIGS", cfgs(Q5_0={"block_k": 64, "preload": True})), {}),
            ("k128 preload", (QM, "QMMA_CONFIGS", k128), {}),
            ("q4k k128 preload", (QM, "QMMA_CONFIGS", cfgs(Q4_K={"block_k": 128, "preload": True})), {}),
            ("q6k k128 preload", (QM, "QMMA_CONFIGS", cfgs(Q6_K={"block_k": 128, "preload": True})), {}),
        ])),
        ("split sweep", lambda: stage_sweep(m, out, rows, bw, "s8", [
            ("split512", (QMm, "QMATMUL_SPLIT_K", 512), {}),
            ("split512 preload", [(QMm, "QMATMUL_SPLIT_K", 512), (QM, "QMMA_CONFIGS", cfgs(
                **{f: {"preload": True} for f in ("Q5_0", "Q4_K", "Q6_K", "Q8_0")}))], {}),
        ], slots=SLOTS)),
        ("split128", lambda: stage_sweep(m, out, rows, bw, "s8", [
            ("split128", split128, {}),
            ("split128 n32", split128[:2] + [(QM, "QMMA_CONFIGS", cfgs(
                Q4_K={"block_k": 128, "block_n": 32}, Q6_K={"block_k": 128, "block_n": 32}, Q8_0={"block_k": 128}))]
             + split128[2:], {}),
        ], slots=SLOTS)),
        ("slice sweep", lambda: stage_sweep(m, out, rows, bw, "s8", [
            (f"slices {label}", (QMm, "QMATMUL_FORMAT_SPLIT_K", v), {}) for label, v in SLICES.items()], slots=SLOTS)),
        *[(f"slices {label} exact", lambda v=v: _patched(QMm, "QMATMUL_FORMAT_SPLIT_K", v, lambda: stage_exact(
            m, out, exact_rows))) for label, v in SLICES.items()],
        ("narrow sweep", lambda: stage_sweep(m, out, rows, bw, "s8", [
            ("narrow 64", (QMm, "QMATMUL_NARROW_SPLIT_K", 64), {}),
            ("narrow n32", (QM, "QMMA_CONFIGS", cfgs(Q4_K={"block_n": 32}, Q6_K={"block_n": 32})), {}),
        ], slots=SLOTS)),
        ("narrow 64 exact", lambda: _patched(QMm, "QMATMUL_NARROW_SPLIT_K", 64, lambda: stage_exact(m, out, exact_rows))),
        ("split128 exact", lambda: _with(split128, lambda: stage_exact(m, out, exact_rows))),
        ("split512 exact", lambda: _patched(QMm, "QMATMUL_SPLIT_K", 512, lambda: stage_exact(m, out, exact_rows))),
        ("preload same bits", lambda: stage_same_bits(m, out, exact_rows, "Q5_0 preload", lambda fn: _patched(
            QM, "QMMA_CONFIGS", cfgs(Q5_0={"preload": True}), fn))),
        # (Q4_K / Q6_K at 128-weight steps add their K in another order: other bits, so the exactness stage)
        ("k128 exact", lambda: _patched(QM, "QMMA_CONFIGS", k128, lambda: stage_exact(m, out, exact_rows))),
        ("rope attn profile", lambda: _patched(tr, "ROPE_IN_ATTENTION", True, lambda: stage_profile(m, out, prof_rows))),
        ("rope w8 exact", lambda: _patched(SFm, "QK_ROPE_WARPS", 8, lambda: stage_exact(m, out, exact_rows))),
        ("rope attn exact", lambda: _patched(tr, "ROPE_IN_ATTENTION", True, lambda: stage_exact(m, out, exact_rows))),
        ("pair exact", lambda: _patched(tr, "PAIR_LAUNCH", True, lambda: stage_exact(m, out, exact_rows))),
        ("early prefetch same bits", lambda: stage_same_bits(
            m, out, exact_rows, "PDL early + attention K/V prefetch", lambda fn: _patched(
                pdl, "EARLY", True, lambda: _patched(A, "ATTENTION_PREFETCH", True, fn)))),
        ("tuned exact", lambda: tuned(lambda: stage_exact(m, out, exact_rows))),
        ("tuned profile", lambda: tuned(lambda: stage_profile(m, out, prof_rows))),
        ("attn fma", lambda: bench_runner(m, "triton_attention_fma", SLOTS, out, rows, bw, attn_dot=False)),
        ("qkrope", lambda: bench_runner(m, "triton_qk_rope_fold", SLOTS, out, rows, bw, fuse_qk_rope=True)),
        ("qkrope exact", lambda: _patched(tr, "FUSE_QK_ROPE", True, lambda: stage_exact(m, out, exact_rows))),
        ("attn bf16", lambda: bench_runner(m, "triton_attention_bf16", SLOTS, out, rows, bw, attn_bf16=True)),
        ("attn tf32x3", lambda: bench_runner(m, "triton_attention_tf32x3", SLOTS, out, rows, bw, attn_bf16=False)),
        ("addnorm", lambda: bench_runner(m, "triton_add_norm_fold", SLOTS, out, rows, bw, fuse_add_norm=True)),
        ("folds", lambda: bench_runner(m, "triton_folds", SLOTS, out, rows, bw, fuse_add_norm=True, fuse_qk_rope=True)),
        ("folds fma", lambda: bench_runner(m, "triton_folds_attention_fma", SLOTS, out, rows, bw, fuse_add_norm=True,
                                           fuse_qk_rope=True, attn_dot=False)),
        ("addnorm exact", lambda: _patched(tr, "FUSE_ADD_NORM", True, lambda: stage_exact(m, out, exact_rows))),
        ("folds exact", lambda: _patched_all(tr, FOLDS, lambda: stage_exact(m, out, exact_rows))),
        ("folds profile", lambda: _patched_all(tr, FOLDS, lambda: stage_profile(m, out, prof_rows))),
        ("alt q8 gemv", lambda: bench_runner(m, "alt_Q8_0_gemv", SLOTS, out, rows, bw, layer_forms={"Q8_0": "gemv"})),
        ("alt q4k q6k gemv", lambda: bench_runner(m, "alt_Q4_K_Q6_K_Q8_0_gemv", SLOTS, out, rows, bw,
                                                  layer_forms={"Q4_K": "gemv", "Q6_K": "gemv", "Q8_0": "gemv"})),
        ("noglu", lambda: bench_runner(m, "triton_default_unfused_glu", SLOTS, out, rows, bw, fuse_glu=False)),
        ("gemv seg32", lambda: bench_runner(m, "triton_gemv_graphs_seg32", SLOTS, out, rows, bw, matmul="gemv", attn_segment=32)),
        ("profile", lambda: stage_profile(m, out, prof_rows)),
        ("seg64", lambda: bench_runner(m, "triton_graphs_seg64", SLOTS, out, rows, bw, attn_segment=64)),
        ("seg32", lambda: bench_runner(m, "triton_graphs_seg32", SLOTS, out, rows, bw, attn_segment=32)),
        ("profile64", lambda: stage_profile(m, out, prof_rows, 64)),
        ("exact64", lambda: _patched(A, "ATTENTION_SEGMENT", 64, lambda: stage_exact(m, out, exact_rows))),
        ("triton graphs", lambda: bench_runner(m, "triton_graphs", SLOTS, out, rows, bw)),
        ("exact", lambda: stage_exact(m, out, exact_rows)),
        ("engine", lambda: bench_engine(m, (1, 4, 16), out, rows)),
        ("triton eager", lambda: bench_runner(m, "triton_eager", (1, 16), out, rows, bw, graphs=False)),
        ("vs torch", lambda: stage_vs_torch(args.model, m, out, exact_rows)),
    ):
        if os.environ.get("STAGES") and name not in os.environ["STAGES"].split(","):
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
