"""`workbench dashboard`: build the pages and print the index's URL."""

from __future__ import annotations

from pathlib import Path

from workbench.dashboard import DEFAULT_OUT_DIR


def register_cli(subparsers) -> None:
    """Add `workbench dashboard` to an argparse subparsers object."""
    p = subparsers.add_parser("dashboard", help="build the HTML dashboards from the run store",
                              description="Build self-contained HTML dashboards from recorded runs and the "
                              "reference tables, as dashboards/pages.toml defines them; prints the index's URL.")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="run store root")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="folder the pages are written to")
    p.add_argument("--reference", type=Path, default=None,
                   help="seeds' reference figures, a parquet file (default: <data-dir>/reference/seeds.parquet)")
    p.add_argument("--llamacpp", type=Path, default=None,
                   help="llama.cpp CPU measurements, a parquet file "
                   "(default: <data-dir>/reference/llamacpp_cpu.parquet)")
    p.add_argument("--pages", type=Path, default=None,
                   help="page definitions, a TOML file (default: the repository's dashboards/pages.toml)")
    p.set_defaults(func=_cmd_dashboard)


def _cmd_dashboard(args) -> int:
    from workbench.dashboard import build_dashboards  # looked up when run (tests patch the package's name)

    paths = build_dashboards(args.data_dir, args.out, reference=args.reference, llamacpp=args.llamacpp,
                             pages=args.pages)
    for path in paths:
        print(f"wrote {path}")
    print(f"open file://{paths[0].resolve()}")
    return 0
