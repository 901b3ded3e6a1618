"""`workbench run-all`: every registered ablation on the embedded default model, then the dashboards.

    workbench run-all [--quick] [--data-dir D] [--out dashboards]

All runs are planned and validated first; a run that fails is recorded as failed (it shows on
the dashboards) and the others still run. Exit 1 if any run failed, 0 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from workbench import ablations
from workbench.ablate import EXIT_RUN_FAILED, run_specs


def register_cli(subparsers) -> None:
    """Add `workbench run-all` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "run-all", help="run every ablation (embedded model), then build the dashboards",
        description="Run every registered ablation on the embedded default model, then build the dashboards.",
    )
    p.add_argument("--quick", action="store_true", help="each ablation's quick settings")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="run store root (default: data)")
    p.add_argument("--out", type=Path, default=Path("dashboards"), help="dashboard folder (default: dashboards)")
    p.add_argument("--no-progress", action="store_true", help="no papermill progress bars")
    p.set_defaults(func=cmd_run_all)


def cmd_run_all(args) -> int:
    from workbench.dashboard import build_dashboards

    specs = []
    for name, ablation in ablations.registry().items():
        default_model = {"model": None} if any(p.name == "model" for p in ablation.params) else {}
        specs += ablations.plan_sweep(name, default_model, quick=args.quick, data_dir=args.data_dir)
    results = run_specs(specs, progress_bar=not args.no_progress)
    print("building dashboards...", file=sys.stderr, flush=True)
    pages = build_dashboards(args.data_dir, args.out)
    for page in pages:
        print(f"wrote {page}")
    print(f"open file://{pages[0].resolve()}")
    failed = [r for r in results if r.status != "complete"]
    if failed:
        print(f"workbench: {len(failed)} of {len(results)} run(s) failed: "
              + "; ".join(f"{r.spec.label} ({r.run_id}): {r.error}" for r in failed), file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0
