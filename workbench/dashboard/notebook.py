"""Charts of rows a notebook holds: an ablation's views over one run's rows, as its page draws them."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from workbench.dashboard.groups import group_runs, measured_sweeps
from workbench.dashboard.pages import DEFAULT_PAGES, load_pages
from workbench.dashboard.views import drawable_metrics, group_title, metric_cells, palette


def ablation_charts(ablation: str, rows: pl.DataFrame, *, pages: str | Path | None = None,
                    metrics: tuple[str, ...] | None = None) -> list[alt.TopLevelMixin]:
    """Charts of rows a notebook holds (one run's, as it shows them after the run): a chart per
    metric of the ablation's page (or of `metrics`), the same panels as the built page's."""
    spec = load_pages(pages if pages is not None else DEFAULT_PAGES)
    page = spec.ablation(ablation)
    if page is None or rows.is_empty() or "run_id" not in rows.columns:
        return []
    runs = rows.group_by("run_id", "hardware_id").len().drop("len").with_columns(
        pl.lit(ablation).alias("ablation"), pl.lit("complete").alias("status"), pl.lit(False).alias("quick"),
        pl.col("run_id").alias("started_at"), pl.lit("").alias("git_commit"), pl.lit("").alias("device_run"))
    params = {r: {} for r in runs["run_id"]}
    charts = []
    for group in group_runs(runs, params, ablation, page, quick=False, sweeps=measured_sweeps(rows, page.x)):
        mine = rows.filter(pl.col("run_id").is_in(group.latest["run_id"].to_list()))
        for metric in drawable_metrics(mine, page):
            if metrics is None or metric in metrics:
                cells = metric_cells(group, mine, page, spec, palette(group.hardware), None, metric)
                charts.append(alt.hconcat(*cells).properties(title=group_title(group, mine, page)))
    return charts


def _metric_views(ablation: str) -> list[tuple[str, tuple[str, ...], Any]]:
    spec = load_pages()
    page = spec.ablation(ablation)
    if page is None:
        raise KeyError(ablation)
    return [(spec.label(m, page).label, (page.x, m), partial(_one_metric_chart, ablation, m)) for m in page.metrics]


def _one_metric_chart(ablation: str, metric: str, rows: pl.DataFrame) -> alt.TopLevelMixin | None:
    charts = ablation_charts(ablation, rows, metrics=(metric,))
    return charts[0] if charts else None


class _AblationViews(Mapping):
    """`ABLATION_VIEWS[name]`: (title, columns needed, view over rows) per metric of the page,
    read from the page definitions when asked for (no I/O at import). Its last reader is
    tests/test_dashboard_browser.py; `ablations.chunk_sizing_charts` calls `ablation_charts`."""

    def __getitem__(self, ablation: str) -> list[tuple[str, tuple[str, ...], Any]]:
        return _metric_views(ablation)

    def __iter__(self):
        return iter([a.name for a in load_pages().ablations])

    def __len__(self) -> int:
        return len(load_pages().ablations)


ABLATION_VIEWS = _AblationViews()
