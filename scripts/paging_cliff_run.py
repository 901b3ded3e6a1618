"""The paging-cliff ablation's cells without the notebook (a device machine has no papermill or
Jupyter kernel): the same validation, run store recording and summary table as
notebooks/paging_cliff.ipynb, so the run lands in the run store as the notebook's would.

    python3 scripts/paging_cliff_run.py --data-dir /tmp/wbruns -p backend=triton -p concurrencies=1,4,8,16,32
"""

from __future__ import annotations

import argparse
import sys

from workbench import ablations, paging_cliff
from workbench.errors import WorkbenchError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    try:
        over = ablations.parse_overrides("paging-cliff", args.param)
        base = dict(ablations.get("paging-cliff").quick) if args.quick else {}
        config = ablations.validate("paging-cliff", {**base, **over, "data_dir": args.data_dir, "progress": False})
        import workbench

        m = workbench.load_model(config["model"])
        with ablations.recording(config, "paging-cliff") as run:
            summary = paging_cliff.measure_from_config(m, config)
            run.write_rows(ablations.SUMMARY_TABLE, summary)
    except WorkbenchError as e:
        print(f"paging_cliff_run: {e}", file=sys.stderr)
        return 2
    import polars as pl

    with pl.Config(tbl_rows=200, tbl_cols=30, tbl_width_chars=400):
        print(summary.select("prompt_len", "pflash", "concurrency", "resident_tokens", "preemption", "oversubscription",
                             "decode_tok_s_aggregate", "resident_decode_tok_s_aggregate", "throughput_vs_resident",
                             "ttft_s_p50", "ttft_s_max", "pages_out", "pages_in", "swaps", "recomputes", "transfer_ms",
                             "max_wait_steps", "outputs_identical", "activation_ok"))
    flags = paging_cliff.flagged(summary)
    for r in flags.iter_rows(named=True):
        print(f"FLAGGED C={r['concurrency']} pool={r['resident_tokens']} {r['preemption']}: {r['activation_flag']}")
    print(paging_cliff.differing(summary) or "every row's tokens and logits are bitwise the all-resident run's")
    print(f"run {run.run_id}: {run.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
