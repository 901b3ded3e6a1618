"""Recompute the bandwidth floor of recorded `bench` runs with the bytes a decode step reads.

Runs recorded before the runners had `step_weight_bytes` used their resident weight bytes as
the floor's bytes per step, which counts the token-embedding table (178 MB for Gemma 3 270M's
Q8_0 table) although a step gathers only a few of its rows: their floors were too low and their
`fraction_of_floor` too high. The measurements themselves (tok/s, copy bandwidth) are unchanged;
this rewrites the three derived columns of each run's summary (atomically) and records the
correction in the manifest:

    .venv/bin/python scripts/recompute_bench_floor.py RUN_ID --weight-bytes N --note "..."

N is the runner's `step_weight_bytes` for that run's model, dtype and backend (for a run made
before the attribute existed: its resident bytes minus the embedding table's bytes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

from workbench.atomic import atomic_write_parquet, atomic_write_text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_id")
    ap.add_argument("--weight-bytes", type=int, required=True)
    ap.add_argument("--note", required=True)
    ap.add_argument("--data-dir", type=Path, default=Path("data"))
    args = ap.parse_args()
    run = args.data_dir / "runs" / args.run_id
    manifest = json.loads((run / "manifest.json").read_text())
    if manifest.get("ablation") != "bench":
        raise SystemExit(f"{args.run_id} is not a bench run")
    summary = pl.read_parquet(run / "summary.parquet")
    old = sorted(set(summary["weight_bytes"].to_list()))
    if old == [args.weight_bytes]:
        print(f"{args.run_id}: already at {args.weight_bytes} bytes per step")
        return 0
    n = args.weight_bytes
    summary = summary.with_columns(
        pl.lit(n, dtype=summary.schema["weight_bytes"]).alias("weight_bytes"),
        (pl.col("concurrency") * pl.col("copy_bandwidth_bytes_s") / n).alias("bandwidth_floor_tok_s"),
    ).with_columns((pl.col("decode_tok_s_aggregate") / pl.col("bandwidth_floor_tok_s")).alias("fraction_of_floor"))
    atomic_write_parquet(run / "summary.parquet", summary)
    manifest.setdefault("corrections", []).append(
        {"columns": ["weight_bytes", "bandwidth_floor_tok_s", "fraction_of_floor"], "old_weight_bytes": old,
         "new_weight_bytes": n, "note": args.note})
    atomic_write_text(run / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    print(f"{args.run_id}: weight bytes per step {old} -> {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
