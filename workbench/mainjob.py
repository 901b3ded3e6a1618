"""`workbench run-all`: every registered ablation on the embedded default model, then the dashboards.

    workbench run-all [--quick] [--data-dir D] [--out dashboards]

All runs are planned and validated first; a run that fails is recorded as failed (it shows on
the dashboards) and the others still run. Exit 1 if any run failed, 0 otherwise.

It says what it does on stderr: the planned runs, each run's start (from `run_specs`), a summary
of each run's status and wall time, the dashboard build, and the total wall time. Where the
results went (runs, pages) goes to stdout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from workbench import ablations
from workbench.ablate import EXIT_RUN_FAILED, run_specs
from workbench.dashboard import DEFAULT_OUT_DIR


def register_cli(subparsers) -> None:
    """Add `workbench run-all` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "run-all", help="run every ablation (embedded model), then build the dashboards",
        description="Run every registered ablation on the embedded default model, then build the dashboards.",
    )
    p.add_argument("--quick", action="store_true", help="each ablation's quick settings (minutes on a CPU)")
    p.add_argument("--data-dir", type=Path, default=Path("data"), metavar="DIR", help="run store root")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, metavar="DIR",
                   help="folder the dashboard pages are written to (built outputs, ignored by git)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars, neither papermill's nor the notebooks' (the lines saying which run starts and ends stay)")
    p.set_defaults(func=cmd_run_all)


def _say(line: str) -> None:
    print(f"run-all: {line}", file=sys.stderr, flush=True)


def cmd_run_all(args) -> int:
    from workbench.cli import format_duration
    from workbench.dashboard import build_dashboards

    started = time.perf_counter()
    specs = []
    for name, ablation in ablations.registry().items():
        default_model = {"model": None} if any(p.name == "model" for p in ablation.params) else {}
        specs += ablations.plan_sweep(name, default_model, quick=args.quick, data_dir=args.data_dir)
    _say(f"{len(specs)} run{'s' if len(specs) != 1 else ''}{' (quick settings)' if args.quick else ''} into "
         f"{args.data_dir}: {', '.join(spec.label for spec in specs)}")
    results = run_specs(specs, progress_bar=not args.no_progress)  # prints each run's start and end
    _say(f"building the dashboards into {args.out} ...")
    t_pages = time.perf_counter()
    pages = build_dashboards(args.data_dir, args.out)
    _say(f"{len(pages)} dashboard page{'s' if len(pages) != 1 else ''} in {format_duration(time.perf_counter() - t_pages)}")
    for page in pages:
        print(f"wrote {page}")
    print(f"open file://{pages[0].resolve()}")
    failed = [r for r in results if r.status != "complete"]
    _say(f"{len(results) - len(failed)} of {len(results)} run(s) complete; total "
         f"{format_duration(time.perf_counter() - started)}")
    if failed:
        print(f"workbench: {len(failed)} of {len(results)} run(s) failed: "
              + "; ".join(f"{r.spec.label} ({r.run_id}): {r.error}" for r in failed), file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0
