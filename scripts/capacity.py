"""Capacity (issue 19, item 7): how many sequences the scheduler holds at once, reserved vs paged.

The question: with the same memory for the KV, how many concurrent sequences does the engine
hold on a mixed-length workload (prompts 100-4,000 tokens, max_tokens 512) before paging (each
request reserves its whole prompt + max_tokens cache of every layer) and after it (pages per KV
group, admission by prompt + headroom, sliding layers keep only their window's pages,
preemption by recompute)? Concurrency is decided by `workbench.scheduler.Scheduler` alone, so
this drives the real scheduler with a stand-in runner and no device:

    .venv/bin/python scripts/capacity.py [--requests 256] [--kv-gib 1] [--seed 0] ...

The stand-in (`CapacityRunner`) is the Triton runner on an H200 as the scheduler sees it, built
from the real model's GGUF metadata (no weights are read): bfloat16 KV (2 bytes an element),
`cache_bytes(n)` = `kv_bytes_per_token(2)` x n rounded up to a 256-position page (the runner's
own formula), the runner's `StateLayout`, a fixed `kv_cache_key` (the prefix cache is off: the
prompts are random), and `fixed_bytes` = the GGUF file's size (the resident quantized weights
are about that; the real runner counts its device weights, which differ by the padding of its
layouts). `bytes_per_prefill_row` is an estimate from the runner's own formula
(`TritonRunner._bytes_per_prefill_row`) with every projection in one K slice (the split-K
partial buffers need the kernels' tile choices, which import triton; they add a few KiB a row,
against the ~1.1 MiB of the attention workspace that dominates it at a 4,608-token slot).

Same memory, how. Both forms run the same explicit prefill chunk (`--chunk-size`, default the
engine's chunk cap, which the auto sizer reaches on an H200) and get the same budget: the fixed
bytes + `--kv-gib` + one activation row for each of the `max_concurrency` slots (their decode
rows). With the chunk fixed, neither scheduler counts the chunk's rows against the budget, so
neither can trade prefill rows for KV. Had the budget included a chunk's activations (4,096 rows
of ~1.1 MiB: 4.7 GiB), the reserved form's admission (fixed + reservations + one row a slot
<= budget) would have spent that room on reservations while still running the full chunk,
i.e. used memory twice. The paged pool gets `EngineConfig(kv_resident_tokens=T)`, T the largest
page multiple whose pool bytes (`Scheduler.kv_pool_bytes`, found by asking the scheduler, so its
sizing rules are not copied here) are <= `--kv-gib`. Deriving the pool from the budget instead
(`kv_resident_tokens=None`) sets aside a chunk's activations that this budget does not hold.
The reserved form's admission can still reserve up to (max_concurrency - 1 - slots) rows beyond
`--kv-gib`; its peak reserved bytes are recorded (`kv_bytes`), so any advantage is visible and
goes to the reserved form.

`--kv-gib` default 1: a Gemma 3 270M request of this workload reserves ~2,560 positions x 18 KiB
(bf16, 18 layers, one 256-wide KV head) = ~46 MiB, so 1 GiB holds ~22 reserved requests: well
below max_concurrency=64, so that the paged form's gain is not hidden by the slot limit (it can
show up to 64/22 = 2.9x). `--max-context` default 4,608: the workload's longest request
(4,000 + 512) rounded up to a page; the Triton runner's per-row attention workspace grows with
the slot capacity, and a server for this workload would set it so.

The step loop is the engine's, synchronous: schedule(step) -> forwards(plan) -> commit(plan,
sampled) -> retire(step), every sampled slot given the same token (no stop ids: every request
runs its 512 tokens). Recorded per step: running and waiting requests, KV bytes in use (and
pages used per KV group), preemptions; per form: peak and time-mean concurrency (over the steps
with work waiting, the memory-bound regime, and over the whole run), steps, preemptions, tokens.
The capacity is the time-mean while work waits, not the peak: a paged request is admitted for its
prompt plus the headroom, and grows past that as it decodes, so with more slots than the memory
holds at full length the pool admits optimistically and preempts its way down (recorded: its
preemptions and re-prefilled rows). The recorded runs: `data/capacity/` at max_concurrency 48,
`data/capacity/slots64/` at 64 (over-subscribed).

Output: `data/capacity/capacity.parquet` (one row per form, config fields as columns, ratios to
the reserved form as `*_ratio` columns), `capacity_steps.parquet` (one row per form and step)
and `capacity.md` (the table, also printed). All written atomically.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from workbench.atomic import atomic_write_parquet, atomic_write_text
from workbench.engine_config import MAX_CONCURRENCY, EngineConfig
from workbench.errors import WorkbenchError
from workbench.gguf_file import GGUFFile
from workbench.model_config import ModelConfig
from workbench.planner import SlotView
from workbench.scheduler import Request, Scheduler
from workbench.state import StateLayout

KV_BYTES_PER_ELEM = 2  # bfloat16 KV, the Triton runner's on an H200
ATTN_SEGMENT = 64  # TritonOptions.attn_segment's default: keys per attention partial
GIB = 1 << 30
SAMPLED_TOKEN = 1  # what every sampled row "samples" (there are no stop ids)
FORMS = ("reserved", "paged")


@dataclass(frozen=True)
class CapacityRunner:
    """The scheduler's RunnerInfo for the Triton runner on an H200, without a device.

    `paged=False` gives the pre-paging admission (whole reservations), `paged=True` the pages."""

    config: ModelConfig
    slot_capacity: int
    fixed_bytes: int
    paged: bool
    supports_fused_step: bool = True
    kv_cache_key: bytes = b"capacity-stand-in\x00bfloat16"
    state_layout: StateLayout = field(init=False)
    bytes_per_prefill_row: int = field(init=False)

    def __post_init__(self):
        layout = StateLayout.from_model_config(self.config, kv_bytes_per_elem=KV_BYTES_PER_ELEM)
        object.__setattr__(self, "state_layout", layout)
        object.__setattr__(self, "bytes_per_prefill_row", prefill_row_bytes(self.config, self.slot_capacity))

    def cache_bytes(self, num_tokens: int) -> int:
        P = self.state_layout.page_size
        return self.config.kv_bytes_per_token(KV_BYTES_PER_ELEM) * (-(-num_tokens // P) * P)

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        return True, None  # the quant products are batch-invariant


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def prefill_row_bytes(c: ModelConfig, slot_capacity: int) -> int:
    """TritonRunner._bytes_per_prefill_row on a GPU (tl.dot: at least 16 query rows a KV head),
    every projection in one K slice: float32 residual, normed input, qkv, q, attention output,
    gate|up, GLU output, down, plus the attention workspace of a row at full slot capacity."""
    qrows = max(16, _pow2(c.n_heads // c.n_kv_heads))
    nseg = -(-slot_capacity // ATTN_SEGMENT)
    ws = c.n_kv_heads * nseg * qrows * (max(16, _pow2(c.head_dim)) + 2)
    qkv = c.q_dim + 2 * c.kv_dim
    per_row = 2 * c.n_embd + qkv + 2 * c.q_dim + 2 * c.n_ff + c.n_ff + c.n_embd + ws
    return 4 * per_row


def load_config(model: Path | None) -> tuple[ModelConfig, Path, int]:
    """The model's config from its GGUF metadata (the CLI's default model when None)."""
    if model is None:
        from workbench.default_model import default_model_path

        model = default_model_path()
    g = GGUFFile.open(model)
    return ModelConfig.from_metadata(g.metadata, set(g.tensors)), Path(g.path), g.index.size


def workload(args) -> list[Request]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        out.append(Request(i, tuple(rng.randrange(args.vocab) for _ in range(n)), args.max_tokens))
    return out


def engine_config(args, **kw) -> EngineConfig:
    return EngineConfig(max_concurrency=args.max_concurrency, chunk_size=args.chunk_size, policy=args.policy,
                        prefix_cache=False, admission_headroom_tokens=args.headroom, **kw)


def pool_tokens_for(args, runner: CapacityRunner, kv_bytes: int) -> tuple[int, int]:
    """The largest kv_resident_tokens (a page multiple) whose pool the scheduler sizes at <= kv_bytes,
    and that pool's bytes; found by bisection on the scheduler's own `kv_pool_bytes` (probed
    with an unbounded budget: with explicit kv_resident_tokens the budget only checks the pool)."""
    P = runner.state_layout.page_size

    def pool_bytes(pages: int) -> int:
        config = engine_config(args, kv_resident_tokens=pages * P)
        return Scheduler(config, runner, budget_bytes=1 << 62).kv_pool_bytes

    page_bytes = [runner.state_layout.page_bytes(g) for g in runner.state_layout.group_names]
    smallest = min(page_bytes)
    lo, hi = 0, kv_bytes // smallest + 1  # pool_bytes(hi) > kv_bytes: every group has >= 1 page of each
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pool_bytes(mid) <= kv_bytes else (lo, mid)
    if lo == 0:
        raise WorkbenchError(f"--kv-gib={args.kv_gib} holds no page of every KV group: allowed at least "
                             f"{sum(page_bytes) / GIB:.4f}")
    return lo * P, pool_bytes(lo)


def drive(sched: Scheduler, requests: list[Request], form: str, max_steps: int) -> tuple[list[dict], dict]:
    """Run the engine loop to completion; per-step records and per-run totals."""
    for r in requests:
        sched.add(r)
    steps, prefill_rows, decode_rows, generated, recomputed = [], 0, 0, 0, 0
    step = 0
    while sched.has_work():
        if step >= max_steps:
            raise WorkbenchError(f"{form}: not finished after {max_steps} steps (raise --max-steps)")
        plan = sched.schedule(step)
        if plan is None:
            raise WorkbenchError(f"{form}: work is waiting but nothing runs at step {step}")
        running, waiting = sched.num_running, sched.num_waiting  # after admission (and preemption)
        kv = sched.kv_bytes_in_use if sched.paged else sched.reserved_cache_bytes
        sampled = {seg.slot_id: SAMPLED_TOKEN for fwd in sched.forwards(plan) for seg in fwd if seg.samples}
        for ev in sched.commit(plan, sampled):
            generated += len(ev.output_ids)
            recomputed += ev.recomputed_tokens
        sched.retire(step)
        stats = sched.step_stats()
        prefill_rows += sum(c.length for c in plan.prefill_chunks)
        decode_rows += plan.num_decode_rows
        record = dict(form=form, step=step, num_running=running, num_waiting=waiting, kv_bytes_in_use=kv,
                      num_preemptions=stats["num_preemptions"] or 0)
        record.update((k, v) for k, v in stats.items() if k.startswith("pages_used_"))  # paged: per KV group
        steps.append(record)
        step += 1
    prompt = sum(len(r.prompt_ids) for r in requests)
    # recomputed_tokens is the scheduler's count (RequestEvent): what each re-admission had to
    # prefill again, counted at admission, so a request preempted before its prefill ran counts
    # its prompt again too; reprefill_rows is the prefill work actually repeated
    return steps, dict(generated_tokens=generated, prompt_tokens=prompt, prefill_rows=prefill_rows,
                       reprefill_rows=prefill_rows - prompt, recomputed_tokens=recomputed, decode_rows=decode_rows)


def summarize(steps: pl.DataFrame, totals: dict, kv_bytes: int) -> dict:
    busy = steps.filter(pl.col("num_waiting") > 0)
    return dict(
        kv_bytes=kv_bytes,
        peak_running=int(steps["num_running"].max()),
        mean_running_while_waiting=float(busy["num_running"].mean()) if busy.height else None,
        mean_running=float(steps["num_running"].mean()),
        num_steps=steps.height,
        num_steps_waiting=busy.height,
        num_preemptions=int(steps["num_preemptions"].sum()),
        peak_kv_bytes_in_use=int(steps["kv_bytes_in_use"].max()),
        **totals,
    )


RATIO_COLUMNS = ("peak_running", "mean_running_while_waiting", "mean_running", "num_steps")


def run(args) -> tuple[pl.DataFrame, pl.DataFrame]:
    cfg, path, file_bytes = load_config(args.model)
    if args.max_prompt + args.max_tokens > min(args.max_context, cfg.context_length):
        raise WorkbenchError(f"--max-prompt + --max-tokens = {args.max_prompt + args.max_tokens} exceeds the slot of "
                             f"{min(args.max_context, cfg.context_length)} tokens: allowed at most that")
    kv_bytes = int(args.kv_gib * GIB)
    requests = workload(args)
    rows, step_frames = [], []
    pool_tokens = None
    for form in FORMS:
        runner = CapacityRunner(cfg, args.max_context, file_bytes, paged=form == "paged")
        budget = runner.fixed_bytes + kv_bytes + runner.bytes_per_prefill_row * args.max_concurrency
        if form == "paged":
            pool_tokens, _ = pool_tokens_for(args, runner, kv_bytes)
            sched = Scheduler(engine_config(args, kv_resident_tokens=pool_tokens), runner, budget_bytes=budget)
        else:
            sched = Scheduler(engine_config(args), runner, budget_bytes=budget)
        t0 = time.perf_counter()
        records, totals = drive(sched, requests, form, args.max_steps)
        wall = time.perf_counter() - t0
        steps = pl.DataFrame(records)
        # the KV memory: the paged pool, or the most the reserved form ever reserved
        held = sched.kv_pool_bytes if form == "paged" else int(steps["kv_bytes_in_use"].max())
        summary = summarize(steps, totals, held)
        rows.append(dict(form=form, model=path.name, fixed_bytes=runner.fixed_bytes,
                         bytes_per_prefill_row=runner.bytes_per_prefill_row, budget_bytes=budget,
                         kv_gib=args.kv_gib, kv_resident_tokens=pool_tokens if form == "paged" else None,
                         num_requests=args.requests, seed=args.seed, min_prompt=args.min_prompt,
                         max_prompt=args.max_prompt, max_tokens=args.max_tokens,
                         max_concurrency=args.max_concurrency, max_context=args.max_context,
                         chunk_size=args.chunk_size, policy=args.policy, admission_headroom_tokens=args.headroom,
                         **summary, scheduler_wall_s=wall))
        step_frames.append(steps)
    if args.engine_backend != "none":
        row, steps = engine_run(args, path, pool_tokens, requests)
        rows.append({**rows[-1], **row})
        step_frames.append(steps)
    base = rows[0]
    for row in rows:
        for col in RATIO_COLUMNS:
            row[f"{col}_ratio"] = row[col] / base[col] if row[col] is not None and base[col] else None
    return pl.DataFrame(rows), pl.concat(step_frames, how="diagonal")


def markdown(frame: pl.DataFrame) -> str:
    r0 = frame.row(0, named=True)
    lines = [
        f"Capacity, reserved vs paged KV ({r0['model']}, bf16 KV of {r0['kv_gib']:g} GiB, {r0['num_requests']} "
        f"requests, prompts {r0['min_prompt']}-{r0['max_prompt']} tokens, max_tokens {r0['max_tokens']}, "
        f"max_concurrency {r0['max_concurrency']}, chunk {r0['chunk_size']}, headroom "
        f"{r0['admission_headroom_tokens']}, seed {r0['seed']}; scripts/capacity.py)",
        "",
        "| form | KV bytes | peak running | mean running (queue non-empty) | mean running (all steps) | steps "
        "| preemptions | re-prefilled rows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in frame.iter_rows(named=True):
        mw = "-" if r["mean_running_while_waiting"] is None else f"{r['mean_running_while_waiting']:.1f}"
        lines.append(f"| {r['form']} | {r['kv_bytes'] / GIB:.3f} GiB | {r['peak_running']} | {mw} | "
                     f"{r['mean_running']:.1f} | {r['num_steps']} | {r['num_preemptions']} | {r['reprefill_rows']} |")
    for p in frame.iter_rows(named=True):
        if p["form"] != "reserved":
            ratios = " | ".join(_ratio(p[f"{c}_ratio"]) for c in RATIO_COLUMNS)
            lines.append(f"| {p['form']} / reserved | | {ratios} | | |")
    return "\n".join(lines) + "\n"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is out of range: allowed > 0")
        return value
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = EngineConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the CLI's default model)")
    ap.add_argument("--requests", type=_positive(int), default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=_positive(float), default=1.0, help="memory for the KV, GiB")
    ap.add_argument("--min-prompt", type=_positive(int), default=100)
    ap.add_argument("--max-prompt", type=_positive(int), default=4000)
    ap.add_argument("--max-tokens", type=_positive(int), default=512)
    ap.add_argument("--max-concurrency", type=_positive(int), default=MAX_CONCURRENCY)
    ap.add_argument("--max-context", type=_positive(int), default=4608, help="slot capacity, tokens")
    ap.add_argument("--chunk-size", type=_positive(int), default=d.chunk_cap, help="prefill rows a step")
    ap.add_argument("--headroom", type=int, default=d.admission_headroom_tokens,
                    help="paged admission headroom, tokens (EngineConfig.admission_headroom_tokens)")
    ap.add_argument("--policy", choices=("decode-first", "prefill-first"), default=d.policy)
    ap.add_argument("--vocab", type=_positive(int), default=32000, help="random token ids below this")
    ap.add_argument("--max-steps", type=_positive(int), default=1_000_000)
    ap.add_argument("--out", type=Path, default=Path("data/capacity"))
    ap.add_argument("--engine-backend", choices=("none", "triton", "torch"), default="none",
                    help="also run the paged form on the real engine with this backend (a GPU for triton)")
    args = ap.parse_args(argv)
    if args.min_prompt > args.max_prompt:
        ap.error(f"--min-prompt={args.min_prompt} exceeds --max-prompt={args.max_prompt}: allowed min <= max")
    if args.max_concurrency > MAX_CONCURRENCY:
        ap.error(f"--max-concurrency={args.max_concurrency} is out of range: allowed 1..{MAX_CONCURRENCY}")
    if args.headroom < 0:
        ap.error(f"--headroom={args.headroom} is out of range: allowed >= 0")
    return args


def engine_run(args, path: Path, pool_tokens: int, requests: list[Request]) -> tuple[dict, pl.DataFrame]:
    """The paged form on the real engine (`--engine-backend`: the model's weights, its runner, the
    same pool of `pool_tokens` positions and the same workload): form "paged_engine", its running
    requests per step from the engine's telemetry (the step's slots) and the queue after the step."""
    from workbench.engine import Engine
    from workbench.model import load_model

    model = load_model(path, dtype="bfloat16")
    cfg = engine_config(args, kv_resident_tokens=pool_tokens, backend=args.engine_backend, max_context=args.max_context,
                        dtype="bfloat16")
    engine = Engine(model, cfg)
    t0 = time.perf_counter()
    handles = [engine.submit(list(r.prompt_ids), max_tokens=r.max_tokens, ignore_eos=True, request_id=r.request_id)
               for r in requests]
    waiting = []
    while engine.scheduler.has_work():
        before = len(engine.telemetry.step_records)
        engine.step()
        if len(engine.telemetry.step_records) > before:  # (a step ran)
            waiting.append(engine.scheduler.num_waiting)
    wall = time.perf_counter() - t0
    tele = engine.telemetry.steps()
    n = min(tele.height, len(waiting))
    steps = pl.DataFrame(dict(form=["paged_engine"] * n, step=tele["step"][:n], num_running=tele["num_slots"][:n],
                              num_waiting=waiting[:n], kv_bytes_in_use=tele["kv_bytes"][:n],
                              num_preemptions=tele["num_preemptions"].fill_null(0)[:n]))
    reqs = engine.telemetry.requests()
    prompt = sum(len(r.prompt_ids) for r in requests)
    prefill_rows = int(tele["prefill_rows"].sum())
    totals = dict(generated_tokens=sum(len(h.result().token_ids) for h in handles),
                  prompt_tokens=prompt, prefill_rows=prefill_rows, reprefill_rows=prefill_rows - prompt,
                  recomputed_tokens=int(reqs["recomputed_tokens"].sum()), decode_rows=int(tele["decode_rows"].sum()))
    row = dict(form="paged_engine", **summarize(steps, totals, engine.scheduler.kv_pool_bytes), scheduler_wall_s=wall,
               engine_backend=args.engine_backend)
    return row, steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        frame, steps = run(args)
    except WorkbenchError as e:
        print(f"capacity: {e}", file=sys.stderr)
        return 2
    atomic_write_parquet(args.out / "capacity.parquet", frame)
    atomic_write_parquet(args.out / "capacity_steps.parquet", steps)
    table = markdown(frame)
    atomic_write_text(args.out / "capacity.md", table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
