"""Decode step time of the torch runner at 8 slots under two page placements: the allocator's
(pages.py: a sequence's pages in runs of consecutive ids) and the lowest free id first (the
placement before it). Also counts the runs of consecutive pages in the slots' block tables:
the CPU attention reads a run of consecutive pages in place and gathers (copies) scattered ones.

One engine per placement ("arm") on one loaded model, run in lockstep: each timed step is one
`Engine.step()` of pure decode of every arm, in the order A B, then B A, so a shared, noisy
machine loads both arms alike; the ratio of paired steps is steadier than either time.

Scenarios (fresh engines each, bfloat16, the torch backend):

- bench: 8 prompts of --prompt-len tokens prefilled together, then decode steps;
- after-wave: 8 other prompts are served first (their full pages stay in the prefix cache,
  so the free pages are the gaps between them), then the 8 measured ones as in `bench`;
- growing: prompts of 500 tokens, timed once every slot has grown past position 512 (a third
  page each, taken while the other slots hold theirs).

Prints per scenario and arm: the median step time, the median of the paired ratios to the
first arm, the runs per table (global and sliding groups), and a digest of the generated
tokens (page ids never change a result: the digests must agree).

    python scripts/paged_decode_bench.py --scenarios bench,after-wave,growing --steps 40
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

POOL_TOKENS = 65_536  # per KV group and engine: room for every scenario, several engines at once


@dataclass(frozen=True)
class Arm:
    label: str
    placement: str  # "runs" (the allocator's) or "lowest-id"
    attend: Callable | None = None  # workbench.model's attend during this arm's steps (None: as is)


def runs_of(pages: list[int]) -> int:
    """How many runs of consecutive ids a table's pages form (holes skipped)."""
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


def lowest_id(pool):
    """`pool.allocate`, made to take the lowest free id first (then LRU eviction) whatever it is asked."""
    allocate = type(pool).allocate

    def alloc(self, after=None, want=1):
        runs = self.free_runs()
        return allocate(self, after=runs[0][0] - 1 if runs else None)

    return types.MethodType(alloc, pool)


def run_arms(model, arms: list[Arm], scenario: str, prompt_len: int, steps: int, warm: int) -> list[dict]:
    import workbench.model as model_module
    from workbench import Engine, EngineConfig
    from workbench.bench import bench_prompts

    as_is = model_module.attend

    def step(arm: Arm, engine) -> float:
        model_module.attend = arm.attend or as_is
        try:
            t0 = time.perf_counter()
            engine.step()
            return time.perf_counter() - t0
        finally:
            model_module.attend = as_is

    if scenario == "growing":
        prompt_len, warm = 500, max(warm, 512 - 500 + 2)
    prompts = bench_prompts(model, 16, prompt_len)
    engines, handles = [], []
    for arm in arms:
        engine = Engine(model, EngineConfig(max_concurrency=8, dtype="bfloat16", kv_resident_tokens=POOL_TOKENS))
        if arm.placement == "lowest-id":
            for pool in engine.scheduler.allocator.pools.values():
                pool.allocate = lowest_id(pool)
        if scenario == "after-wave":
            for p in prompts[8:]:
                engine.submit(p, max_tokens=2, ignore_eos=True)
            while engine.scheduler.has_work():
                step(arm, engine)
        hs = [engine.submit(p, max_tokens=warm + steps + 4, ignore_eos=True) for p in prompts[:8]]
        while not all(engine._live[h.request_id].token_ids for h in hs):  # the prefill
            step(arm, engine)
        for _ in range(warm):
            step(arm, engine)
        engines.append(engine)
        handles.append(hs)
    times = [[] for _ in arms]
    for t in range(steps):
        for i in range(len(arms)) if t % 2 == 0 else reversed(range(len(arms))):
            times[i].append(step(arms[i], engines[i]))
    out = []
    for arm, engine, hs, ts in zip(arms, engines, handles, times):
        assert (engine.telemetry.steps()["phase"].tail(steps) == "decode").all(), "a timed step was not pure decode"
        alloc = engine.scheduler.allocator
        tokens = [engine._live[h.request_id].token_ids for h in hs]
        out.append({
            "scenario": scenario, "arm": arm.label, "placement": arm.placement, "prompt_len": prompt_len,
            "median_s": statistics.median(ts),
            "paired_ratio": statistics.median(b / a for a, b in zip(times[0], ts)),
            "runs_per_table": {g: [runs_of(alloc.block_table(h.request_id, g).pages()) for h in hs]
                               for g in alloc.pools},
            "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            "times_s": [round(x, 5) for x in ts],
        })
    return out


def main(arms: list[Arm] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="bench,after-wave,growing")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per arm")
    ap.add_argument("--warm", type=int, default=3, help="untimed decode steps before them")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    import torch

    from workbench.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    arms = arms or [Arm("A", "runs"), Arm("B", "lowest-id")]
    model = load_model(args.model, dtype="bfloat16")
    for scenario in args.scenarios.split(","):
        for row in run_arms(model, arms, scenario, args.prompt_len, args.steps, args.warm):
            print(json.dumps(row), flush=True)
            print(f"# {scenario:10s} {row['arm']} {row['placement']:9s} median {row['median_s']:.4f} s, "
                  f"paired ratio to {arms[0].label} {row['paired_ratio']:.3f}, runs per table {row['runs_per_table']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
