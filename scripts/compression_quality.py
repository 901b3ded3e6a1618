"""Prompt compression on the real model, on the CPU (issue 20, deliverable 3): lossy, so measured.

    .venv/bin/python scripts/compression_quality.py [--lengths 2048 4096] [--depths 0.25 0.75]
        [--ratios 0.25 0.1] [--seeds 0 1 2] [--max-tokens 24] [--out data/compression] [--skip-scorer]

Two tables, both on needle prompts (`workbench.compression_quality.needle_prompt`: a random
6-digit code bound to a name, planted at a depth of bland filler, asked for at the end):

* `needle_scorer.parquet`: which scorer finds the needle. For each prompt the target's first 12
  layers run once (`compression.run_layers`); each scorer variant (which layers score, query
  window, block pooling, spread) ranks the blocks, and the row records the rank of the block
  holding the code's first token (as a fraction of the blocks: 0 = the best) and whether the
  code's tokens all survive at ratio 0.25. The defaults of `CompressionOptions` come from here.
* `needle_quality.parquet`: the default options served through the engine, whole and
  compressed (greedy, EOS ignored): retrieval (the code in the greedy text) of each, whether
  the code was kept, and the agreement of the compressed continuation with the whole one
  (matching prefix, teacher-forced top-1 agreement and mean KL; `compression_quality.compare`).

Rows carry the hardware fingerprint and the commit. Written atomically; a summary is printed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import polars as pl
import torch

from workbench.atomic import atomic_write_parquet
from workbench.compression import (CompressionOptions, blocks_to_keep, candidate_blocks, rank_blocks, run_layers,
                                   target_tokens, window_probability)
from workbench.compression_quality import needle_prompt, needle_trial
from workbench.hardware import fingerprint
from workbench.model import load_model

REPO = Path(__file__).resolve().parent.parent
# (name, layers that score) over the first 12 layers of Gemma 3 270M: 0-4 and 6-10 slide, 5 and 11 are global
LAYER_SETS = (("sliding 0-3", (0, 1, 2, 3)), ("sliding 0-4", (0, 1, 2, 3, 4)), ("global 5", (5,)),
              ("all 0-5", tuple(range(6))), ("global 5,11", (5, 11)), ("all 0-11", tuple(range(12))))
WINDOWS = (16, 32, 64)
POOLS = ("mean", "max")
SPREADS = (0, 8)


def _git() -> dict:
    """The commit, and whether tracked files differ from it (the measured tree is then HEAD plus
    those changes)."""
    def run(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    return {"commit": run("rev-parse", "HEAD") or None,
            "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}


def scorer_rows(model, lengths, depths, seeds, ratio: float) -> list[dict]:
    c = model.config
    rows = []
    for n_target in lengths:
        for seed in seeds:
            for depth in depths:
                nd = needle_prompt(model, n_target, depth, seed)
                ids, n = list(nd.ids), len(nd.ids)
                with torch.inference_mode():
                    _, queries, keys = run_layers(model, ids, 12, max(WINDOWS), finish_last=False)
                for window in WINDOWS:
                    for pool in POOLS:
                        for spread in SPREADS:
                            opts = CompressionOptions(window=window, pool=pool, spread=spread)
                            blocks = candidate_blocks(n, opts)
                            keep = blocks_to_keep(n, target_tokens(n, ratio, opts), blocks, opts)
                            at = next((i for i, (a, b) in enumerate(blocks) if a <= nd.code_positions[0] < b), None)
                            # the code survives when each of its tokens that a candidate block holds is kept
                            # (the others are sinks or in the tail)
                            candidates = [p for p in nd.code_positions if blocks[0][0] <= p < blocks[-1][1]]
                            for name, layers in LAYER_SETS:
                                s = window_probability(c, [queries[li][-window:] for li in layers],
                                                       [keys[li] for li in layers], n, window)
                                ranked = rank_blocks(s, blocks, opts)
                                kept = {p for b in ranked[:keep] for p in range(*blocks[b])}
                                rows.append({
                                    "prompt_tokens": n, "depth": depth, "seed": seed, "layers": name,
                                    "window": window, "pool": pool, "spread": spread, "block_size": opts.block_size,
                                    "num_blocks": len(blocks),
                                    "needle_block_rank": None if at is None else ranked.index(at) / len(blocks),
                                    "ratio": ratio, "code_kept": all(p in kept for p in candidates),
                                })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.75])
    ap.add_argument("--scorer-depths", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 0.9])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.1])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=REPO / "data" / "compression")
    ap.add_argument("--skip-scorer", action="store_true", help="only the engine table")
    args = ap.parse_args(argv)

    model = load_model(dtype="bfloat16")
    meta = {"model": model.path.name, "dtype": model.dtype_name, **_git(), **fingerprint()}
    if not args.skip_scorer:
        t0 = time.perf_counter()
        frame = pl.DataFrame([{**r, **meta} for r in scorer_rows(model, args.lengths, args.scorer_depths, args.seeds, 0.25)])
        atomic_write_parquet(args.out / "needle_scorer.parquet", frame)
        summary = (frame.group_by("layers", "window", "pool", "spread")
                   .agg(pl.col("needle_block_rank").mean().alias("rank_mean"),
                        pl.col("needle_block_rank").max().alias("rank_worst"),
                        pl.col("code_kept").mean().alias("code_kept"))
                   .sort("rank_worst", "rank_mean"))
        with pl.Config(tbl_rows=100):
            print(summary)
        print(f"scorer table: {frame.height} rows in {time.perf_counter() - t0:.0f} s")
    rows = []
    opts = CompressionOptions()
    for ratio in args.ratios:
        for n in args.lengths:
            for depth in args.depths:
                for seed in args.seeds:
                    t0 = time.perf_counter()
                    r = needle_trial(model, n, depth, ratio, opts, seed=seed, max_tokens=args.max_tokens)
                    rows.append({**r, "ratio": ratio, "wall_s": time.perf_counter() - t0,
                                 **{f"compression_{k}": v for k, v in opts.to_dict().items()}, **meta})
                    print(f"{n} tokens depth {depth} seed {seed} ratio {ratio}: kept {r['effective_tokens']}/"
                          f"{r['raw_tokens']}, retrieved whole {r['retrieved_whole']} kept {r['retrieved_kept']}, "
                          f"code kept {r['code_kept']}, prefix {r['prefix_match']}/{r['num_tokens']}, "
                          f"top-1 {r['top1_agreement']:.3f}, KL {r['mean_kl']:.4f}, TTFT {r['ttft_whole_s']:.2f} -> "
                          f"{r['ttft_kept_s']:.2f} s", flush=True)
    frame = pl.DataFrame(rows, infer_schema_length=None)
    atomic_write_parquet(args.out / "needle_quality.parquet", frame)
    with pl.Config(tbl_rows=100):
        print(frame.group_by("ratio", "target_tokens", "depth").agg(
            pl.col("retrieved_whole").mean(), pl.col("retrieved_kept").mean(), pl.col("code_kept").mean(),
            pl.col("prefix_match").mean(), pl.col("top1_agreement").mean(), pl.col("mean_kl").mean(),
            pl.col("effective_tokens").mean(), pl.col("scorer_s").mean(), pl.col("ttft_whole_s").mean(),
            pl.col("ttft_kept_s").mean(),
        ).sort("ratio", "target_tokens", "depth"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
