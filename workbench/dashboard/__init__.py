"""Dashboards: Altair views over the run store's tidy parquet, built into self-contained HTML.

The pages are defined in `dashboards/pages.toml` (the sources: what each page draws and every
column's name in words, with its unit); `build_dashboards` reads it, the run store and the
reference tables, and writes the pages (outputs) to `dashboards/build/`, an index first.

Like is compared with like. The complete runs of an ablation are split into groups: runs with
the same parameters (those that say what was measured, the sweep of x included; repeat counts
and where a run came from are left out, as the page definition says) and the same quick flag;
a smoke run at one or two x values is thus a group of its own. A group's
chart draws one line per hardware, through that hardware's latest run of the group: the median
over repeats, a band from the least to the most. Points of different groups or different runs
are never joined along the x axis. Quick runs have pages of their own. Every chart names its
selection (ablation, parameters, quick or full, run ids and counts) in its subtitle.

Vega, Vega-Lite and Vega-Embed are inlined into each page (from the `vl-convert-python`
package), so a page opens offline, from disk or as a CI artifact.

The package, a module per concept:

    pages.py          the page definitions: ColumnLabel, AblationPage, PagesSpec, load_pages
    groups.py         run_table, Group, group_runs (like with like), measurement_params
    views.py          the views, each a function returning an Altair chart
    reference.py      the seeds' and llama.cpp's figures, their charts, the reference page
    context.py        BuildContext: what every page of a build is drawn from, read once
    overview.py       the overview page
    ablation_page.py  an ablation's page: its groups, their charts and history
    render.py         Section, Page, HTML rendering, Vega's JavaScript, atomic writes
    build.py          build_dashboards: every page, the index first
    notebook.py       ablation_charts: a notebook's charts of one run's rows
    cli.py            `workbench dashboard`
"""

from __future__ import annotations

from pathlib import Path

# Where the built pages go (outputs, ignored by git). Here, not in build.py, so that the CLI's
# parser can name it without importing Altair and polars (about a second of every start).
DEFAULT_OUT_DIR = Path("dashboards") / "build"

# The public names, each imported from its module when first used (PEP 562): `workbench --help`
# and every other command register `workbench dashboard` without paying for Altair.
_EXPORTS = {
    "build": ("build_dashboards",),
    "cli": ("register_cli",),
    "context": ("SUMMARY_TABLE",),
    "groups": ("Group", "group_runs", "measured_sweeps", "measurement_params", "run_table"),
    "notebook": ("ABLATION_VIEWS", "ablation_charts"),
    "pages": ("DEFAULT_PAGES", "AblationPage", "ColumnLabel", "PagesSpec", "load_pages"),
    "reference": ("LLAMACPP_PATH", "SEEDS_PATH", "reference_points"),
    "views": ("Axes", "history_chart", "metric_chart", "palette", "repeat_stats"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(["DEFAULT_OUT_DIR", *_MODULE_OF])


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'workbench.dashboard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"workbench.dashboard.{module}"), name)
    globals()[name] = value
    return value
