"""What a speculative verify step costs on the device, by rows per slot and by runner option
variants (`--variants`, e.g. `TritonOptions.attention_runs`): C slots at L positions each, a
verify of r rows per slot (every row scored, as the speculator sends it) replayed as its chunk
graph (r = 1: the decode graph), on the Triton runner with the real model.

For each variant: the device time of one replay (CUDA events, median of --replays), the wall
time of `TritonRunner.run` on the same forward (host + device, greedy tokens to the host), a
per-kernel profile of the widest verify, and every row's logits checked bitwise against the
first variant's (variants that claim the same bits, as attention_runs does). One row per
(variant, r) into verify_step.parquet (and .json) under --out.

    python3 scripts/verify_step_bench.py --model model.gguf --out /tmp/out
    python3 scripts/verify_step_bench.py --shapes gemma3-270m --out /tmp/out   # no GGUF to upload
    python3 scripts/verify_step_bench.py --dry-run   # a tiny random model under the interpreter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--shapes", choices=["gemma3-270m"], default=None,
                    help="instead of --model: random weights in the real model's layer shapes, Q5_0 with Q8_0 V "
                         "projections (the file's K-quants as Q5_0: workbench.synthetic writes none; its tiny vocabulary "
                         "leaves out the real head)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rows", default="1,2,3,5,8", type=_positive_ints, help="rows per slot (1: a plain decode step)")
    ap.add_argument("--variants", default="default;attention_runs=true", type=_variants,
                    help="';'-separated TritonOptions overrides (TritonOptions.parse's name=value,...; "
                         "'default': none), each timed and checked bitwise against the first")
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--profile", type=int, default=10, metavar="REPLAYS", help="0: no kernel profile")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from workbench.errors import WorkbenchError
    from workbench.runners.direct_pages import DirectPages
    from workbench.runners.triton_options import TritonOptions
    from workbench.runners.triton_runner import TritonRunner

    rows_per_slot, settings = a.rows, a.variants
    from workbench.model import load_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="verify_step_"))  # random models stay out of --out (a device call returns it)
    if a.dry_run:
        from workbench.synthetic import SyntheticSpec, write_random_gguf

        a.model = str(write_random_gguf(scratch / "tiny.gguf", SyntheticSpec(
            n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, head_dim=32, n_ff=128, weight_type="Q5_0")))
        a.slots, a.context, a.replays, a.profile = min(a.slots, 3), min(a.context, 40), 2, 0
        base = TritonOptions(graphs="emulate", page_size=64, attn_segment=32)
    else:
        base = TritonOptions()
    if a.shapes:
        from workbench.synthetic import GEMMA3_270M_SHAPES, write_random_gguf

        spec = replace(GEMMA3_270M_SHAPES, weight_type="Q5_0", tensor_types=(("attn_v.weight", "Q8_0"),))
        a.model = str(write_random_gguf(scratch / "shapes.gguf", spec))
    try:
        m = load_model(a.model, dtype="bfloat16")
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    C, L, V = a.slots, a.context, m.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, V, (L,), generator=gen).tolist() for _ in range(C)]
    drafts = {r: [torch.randint(10, V, (r,), generator=gen).tolist() for _ in range(C)] for r in rows_per_slot}
    cuda = torch.cuda.is_available()
    results, reference = [], {}
    for rt in settings:
        try:
            runner = TritonRunner(m, L + 64, replace(base, **settings[rt]))
        except WorkbenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        page = runner.state_layout.page_size  # each slot's pages round up on their own
        pages = DirectPages(runner, C * page * (-(-(L + 64) // page) + 1))
        runner.expect_steps(C, True)
        ctx = {sl: L + 64 for sl in range(C)}
        for sl, p in enumerate(prompts):
            runner.run([pages.segment(sl, sl, tuple(p), 0)], ctx)
        for r in rows_per_slot:
            fwd = [pages.segment(sl, sl, tuple(drafts[r][sl]), L, scored=r) for sl in range(C)]
            logits = runner.run(fwd, ctx)  # (captures; host logits of every row)
            got = torch.stack([logits[sl] if r > 1 else logits[sl][None] for sl in range(C)])
            same = None
            if (r,) in reference:
                same = bool(torch.equal(got, reference[(r,)]))
            else:
                reference[(r,)] = got
            greedy = frozenset(range(C))
            walls = []
            for _ in range(a.replays):
                t0 = time.perf_counter()
                runner.run(fwd, ctx, argmax=greedy)
                walls.append((time.perf_counter() - t0) * 1e3)
            dev = _device_ms(runner, fwd, r, C, L, a.replays) if cuda else None
            row = dict(variant=rt, slots=C, context=L, rows_per_slot=r, rows=C * r,
                       device_ms=dev, wall_ms=statistics.median(walls), launches=runner.launches,
                       bitwise_first_setting=same)
            results.append(row)
            print("VERIFY_STEP " + json.dumps(row), flush=True)
        if cuda and a.profile:
            r = max(rows_per_slot)
            fwd = [pages.segment(sl, sl, tuple(drafts[r][sl]), L, scored=r) for sl in range(C)]
            _profile(runner, fwd, C * r, L, a.profile, rt)
        del runner, pages
        if cuda:
            torch.cuda.empty_cache()
    bad = [x for x in results if x["bitwise_first_setting"] is False]
    _write(out, results)
    if bad:
        print(f"error: {len(bad)} verify shapes changed bits with the variant: {bad}", file=sys.stderr)
        return 1
    return 0


def _variants(raw: str) -> dict[str, dict]:
    """';'-separated TritonOptions overrides -> {label: {name: value}} ('default': none), each
    checked by TritonOptions (argparse's type: a bad one is one line, exit 2)."""
    from workbench.errors import WorkbenchError
    from workbench.runners.triton_options import TritonOptions

    out = {}
    for label in filter(None, (v.strip() for v in raw.split(";"))):
        try:
            opts = TritonOptions() if label == "default" else TritonOptions.parse(label)
        except WorkbenchError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        names = [] if label == "default" else [item.partition("=")[0].strip() for item in label.split(",") if item.strip()]
        out[label] = {n: getattr(opts, n) for n in names}
    if not out:
        raise argparse.ArgumentTypeError(f"{raw!r} names no variant: e.g. 'default;attention_runs=true'")
    return out


def _positive_ints(raw: str) -> list[int]:
    """A comma-separated list of positive integers (argparse's type: its error is one line, exit 2)."""
    try:
        vals = [int(v) for v in raw.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not allowed: allowed comma-separated positive integers")
    return vals


def _graph(runner, rows: int, r: int, L: int):
    g = runner.graphs
    max_pos = L + r - 1
    return g.graph_for(rows, max_pos) if r == 1 else g.chunk_graph_for(rows, rows, max_pos)


def _device_ms(runner, fwd, r: int, C: int, L: int, replays: int) -> float:
    """Median device time of the forward's graph, replayed on the inputs the last run left."""
    from graph_timing import replay_us  # (scripts/, the script's own folder)

    import torch

    # (the graphs' input buffers are inference tensors; a graph the run did not capture, e.g.
    # 144 rows' sampled bucket, is captured here)
    with torch.inference_mode():
        g = _graph(runner, C * r, r, L)
        if r == 1:
            runner.graphs.fill(fwd, g.bucket)
        else:
            runner.graphs.fill_chunk(fwd, g.bucket)
    return statistics.median(replay_us(g, replays)) / 1e3


def _profile(runner, fwd, rows: int, L: int, replays: int, rt: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    r = rows // len(fwd)
    with torch.inference_mode():  # (the graphs' input buffers are inference tensors)
        g = _graph(runner, rows, r, L)
        runner.graphs.fill_chunk(fwd, g.bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    kern = sorted(((e.key, e.count, getattr(e, "device_time_total", 0) or 0) for e in prof.key_averages()),
                  key=lambda k: -k[2])
    total = sum(k[2] for k in kern) / replays
    print(f"PROFILE variant={rt} rows={rows}: kernel time {total:.0f} us per replay", flush=True)
    for name, count, dt in kern[:16]:
        print(f"  {dt / replays:9.1f} us  x{count // replays:<4d} {name[:100]}", flush=True)


def _write(out: Path, rows: list) -> None:
    from workbench.atomic import atomic_write_text

    atomic_write_text(out / "verify_step.json", json.dumps(rows, indent=1))
    try:
        import polars as pl
    except ImportError:  # (the device image may lack polars: the JSON and the log are the record)
        return
    from workbench.atomic import atomic_write_parquet

    atomic_write_parquet(out / "verify_step.parquet", pl.DataFrame(rows))


if __name__ == "__main__":
    sys.exit(main())
