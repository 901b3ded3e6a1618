"""`workbench ablate`: run an ablation's notebook through papermill into the run store.

    workbench ablate --list
    workbench ablate chunk-sizing [-p name=value ...] [--quick] [--data-dir D]

Every run is planned and validated before the first one starts: a bad -p value ends with one
line naming the parameter and what it allows, exit 2. A scalar parameter given several values
(`-p concurrency=2,4`) is swept across runs, one run each. Each run's manifest records its full
parameters and `quick` (true for --quick). The notebook also runs by hand: in JupyterLab, or as
`papermill notebooks/chunk_sizing.ipynb out.ipynb -p prompt_lens '[32]'`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from workbench import ablations
from workbench.errors import WorkbenchError

EXIT_RUN_FAILED = 1


def register_cli(subparsers) -> None:
    """Add `workbench ablate` to an argparse subparsers object."""
    names = list(ablations.registry())
    p = subparsers.add_parser(
        "ablate", help="run an ablation notebook (papermill) into the run store",
        description="Run an ablation's parameterized notebook; results and the executed notebook "
        "go to <data-dir>/runs/<run_id>/.",
    )
    p.add_argument("name", nargs="?", choices=names, help="the ablation (see --list)")
    p.add_argument("-p", "--param", dest="params", action="append", default=[], metavar="NAME=VALUE",
                   help="override a parameter, repeatable; lists as 16,64,auto or [16, 64]; several values of a "
                   "scalar sweep it across runs (default: the notebook's defaults, see --list)")
    p.add_argument("--quick", action="store_true",
                   help="start from the ablation's quick settings (minutes on a CPU); the manifest records quick")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="run store root")
    p.add_argument("--list", action="store_true", help="list the ablations with their parameters, defaults and "
                   "quick settings")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (papermill's over the cells, the notebook's over its measurements)")
    p.set_defaults(func=cmd_ablate)


def cmd_ablate(args) -> int:
    if args.list:
        print("\n\n".join(ablations.describe(name) for name in ablations.registry()))
        return 0
    if args.name is None:
        raise WorkbenchError(f"name an ablation ({', '.join(ablations.registry())}) or pass --list")
    overrides = ablations.parse_overrides(args.name, args.params)
    specs = ablations.plan_sweep(args.name, overrides, quick=args.quick, data_dir=args.data_dir)
    results = run_specs(specs, progress_bar=not args.no_progress)
    return 0 if all(r.status == "complete" for r in results) else EXIT_RUN_FAILED


def run_specs(specs, *, progress_bar: bool = True) -> list:
    """Run the specs with the local executor, printing each run's start, and its end (status,
    time, where it went) as soon as it ends."""

    def started(spec, i, n):
        print(f"[{i + 1}/{n}] {spec.label}: running {Path(spec.notebook).name}", file=sys.stderr, flush=True)

    def finished(result, i, n):
        print(f"[{i + 1}/{n}] {report_line(result)}", flush=True)

    return ablations.LocalExecutor(progress_bar=progress_bar, on_start=started, on_finish=finished).run(specs)


def report_line(result) -> str:
    files = ", ".join([*(f"{t}.parquet" for t in result.tables), result.notebook_path.name])
    line = f"{result.spec.label}: run {result.run_id} {result.status} in {result.wall_s:.0f} s -> {result.run_dir}/ ({files})"
    if result.error:
        line += f"; error: {result.error}"
    return line
