"""The draft-yield ablation's cells without the notebook (a device machine has no papermill or
Jupyter kernel): the same validation, run store recording and summary table as
notebooks/draft_yield.ipynb, so the run lands in the run store as the notebook's would.

    python3 scripts/draft_yield_run.py --data-dir /tmp/wbruns -p backend=triton -p concurrencies=1,4,16
"""

from __future__ import annotations

import argparse
import sys

from workbench import ablations, draft_yield
from workbench.errors import WorkbenchError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--data-dir", default="data", help="the run store the run goes to")
    ap.add_argument("--prompts-dir", default="data", help="where data/workloads/ is read from")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    try:
        over = ablations.parse_overrides("draft-yield", args.param)
        base = dict(ablations.get("draft-yield").quick) if args.quick else {}
        config = ablations.validate("draft-yield", {**base, **over, "data_dir": args.data_dir, "progress": False})
        import workbench

        m = workbench.load_model(config["model"])
        with ablations.recording(config, "draft-yield") as run:
            summary = draft_yield.measure_from_config(m, {**config, "data_dir": args.prompts_dir})
            run.write_rows(ablations.SUMMARY_TABLE, summary)
    except WorkbenchError as e:
        print(f"draft_yield_run: {e}", file=sys.stderr)
        return 2
    import polars as pl

    with pl.Config(tbl_rows=200, tbl_cols=30, tbl_width_chars=400):
        print(summary.select("workload", "temperature", "concurrency", "proposer", "k", "guard", "pipeline", "goodput_tok_s", "ar_goodput_tok_s",
                             "goodput_vs_ar", "verify_steps", "drafted", "accepted", "acceptance", "draft_yield",
                             "guard_skips", "row_cost", "tokens_identical", "activation_ok"))
    for r in draft_yield.flagged(summary).iter_rows(named=True):
        print(f"FLAGGED {r['workload']} C={r['concurrency']} {r['arm']}: {r['activation_flag']}")
    print(draft_yield.differing(summary) or "every row's tokens are bitwise the AR run's")
    print(f"run {run.run_id}: {run.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
