"""Import the H200 decode benchmark (data/gpu/h200_bench.parquet, measured by scripts/gpu_bench.py
on the device machine, which has no polars or run store) into the run store as `bench` runs of the
machine that measured them, so the dashboards compare it with the CPU runs.

    .venv/bin/python scripts/import_gpu_bench.py [--data-dir data]

One run per (device run, variant) of the invariant Triton path with CUDA graphs; rows use the
columns `workbench bench` writes (concurrency, decode_tok_s_aggregate, bandwidth_floor_tok_s, ...).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import polars as pl

from workbench.runstore import RunStore

SOURCE = Path(__file__).resolve().parent.parent / "data" / "gpu" / "h200_bench.parquet"
VARIANTS = ("triton_graphs", "triton_graphs_seg64", "triton_graphs_seg32", "triton_default")  # batch-invariant only


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="data")
    args = ap.parse_args()
    store = RunStore(args.data_dir)
    done = {(m["params"].get("device_run"), m["params"].get("variant")) for m in store.manifests()}
    frame = pl.read_parquet(SOURCE).filter(pl.col("variant").is_in(VARIANTS) & pl.col("tok_s").is_not_null())
    # oldest device run first, one second apart: run ids start with their creation time (to the
    # second), and the dashboards draw their line through the latest run of each hardware
    order = {r: (int(re.match(r"run(\d+)", r).group(1)) if re.match(r"run(\d+)", r) else 0, r)
             for r in frame["run"].unique().to_list()}
    first = True
    for (device_run, variant), rows in sorted(frame.group_by(["run", "variant"], maintain_order=True),
                                              key=lambda kv: order[kv[0][0]]):
        if (device_run, variant) in done:
            continue
        if not first:
            time.sleep(1.0)
        first = False
        hardware = json.loads(rows["fingerprint"][0])
        params = {
            "model": "gemma-3-270m-q4_k_m.gguf",
            "backend": "triton",
            "variant": variant,
            "device_run": device_run,
            "prompt_len": int(rows["prompt"][0]),
            "gen": int(rows["steps"][0]),
            "source": "data/gpu/h200_bench.parquet",
        }
        out = [
            {
                "concurrency": int(r["slots"]),
                "decode_tok_s_aggregate": float(r["tok_s"]),
                "decode_tok_s_per_stream": float(r["tok_s"]) / int(r["slots"]),
                "step_ms": float(r["step_ms"]),
                "launches_per_step": r["launches_per_step"],
                "copy_bandwidth_bytes_s": float(r["copy_bw_gbs"]) * 1e9,
                "weight_bytes": int(r["weight_bytes"]),
                "bandwidth_floor_tok_s": int(r["slots"]) * 1e6 / float(r["floor_weights_us"]),
                "fraction_of_floor": 1.0 / float(r["x_floor"]),
            }
            for r in rows.iter_rows(named=True)
        ]
        with store.start_run("bench", params, hardware=hardware) as run:
            run.write_rows("summary", out)
        print(f"{device_run} {variant}: {len(out)} rows -> {run.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
