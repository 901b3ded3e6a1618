"""The views: each a function of tidy rows returning an Altair chart.

A group's metric against x, one line per machine (median over repeats, band from the least
to the most) with the same-machine reference figures beside it; a metric run by run; the
recorded runs by ablation and machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import altair as alt
import polars as pl

from workbench.dashboard.groups import Group, short, wrap
from workbench.dashboard.pages import AblationPage, ColumnLabel, PagesSpec

WIDTH, HEIGHT = 380, 230
# Colours of the machines, assigned in sorted hardware_id order so that a machine keeps its
# colour on every chart of a build (Tableau 10).
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
           "#9d755d", "#bab0ac")


@dataclass(frozen=True)
class Axes:
    """How to draw one metric against one x: the words and scales of both axes, the colours."""

    x: str
    y: str
    x_label: ColumnLabel
    y_label: ColumnLabel
    colors: alt.Scale
    tooltip: tuple[str, ...] = ()
    x_words: str | None = None  # a row column whose words name some x values ("auto" -> 4096)


def palette(hardware: list[str]) -> alt.Scale:
    """One colour per machine, the same on every chart of a build."""
    domain = sorted(set(hardware))
    return alt.Scale(domain=domain, range=[PALETTE[i % len(PALETTE)] for i in range(len(domain))])


def repeat_stats(rows: pl.DataFrame, axes: Axes) -> pl.DataFrame:
    """Median, least and most of the metric over repeats, per machine, run and x (the tooltip's
    columns kept alongside)."""
    keep = rows.filter(pl.col(axes.x).is_not_null() & pl.col(axes.y).is_not_null())
    keys = ["hardware_id", "run_id", axes.x, *[c for c in axes.tooltip if c in keep.columns]]
    y = pl.col(axes.y).cast(pl.Float64) / axes.y_label.divide_by
    return keep.group_by(keys, maintain_order=True).agg(
        y.median().alias("median"), y.min().alias("low"), y.max().alias("high"), pl.len().alias("repeats")
    ).sort("hardware_id", axes.x)


def metric_chart(rows: pl.DataFrame, axes: Axes, title: str | alt.TitleParams,
                 refs: pl.DataFrame | None = None, *, legend: bool = True) -> alt.LayerChart:
    """The metric against x: one line per machine (median over repeats, band least to most),
    the reference figures of the same x and metric as grey marks beside it."""
    stats = repeat_stats(rows, axes)
    refs = refs if refs is not None and refs.height else None
    ref_x = refs["concurrency"].to_list() if refs is not None else []
    x_values = sorted(set(stats[axes.x].to_list()) | set(ref_x))
    x_log = axes.x_label.log and all(v > 0 for v in x_values)
    y_low = stats["low"].to_list()
    if refs is not None:
        y_low += refs["low"].drop_nulls().to_list() + refs["value"].to_list()
    y_log = axes.y_label.log and bool(y_low) and all(v is not None and v > 0 for v in y_low)
    x_enc = alt.X(f"{axes.x}:Q", title=axes.x_label.title, scale=alt.Scale(type="log", base=2) if x_log else
                  alt.Scale(zero=False), axis=alt.Axis(values=x_values, labelFlush=False,
                                                       labelExpr=_x_word_labels(rows, axes)))
    y_axis = alt.Axis(format=axes.y_label.format) if axes.y_label.format else alt.Axis()
    y_scale = alt.Scale(type="log") if y_log else alt.Scale(zero=not axes.y_label.log)
    y_enc = alt.Y("median:Q", title=axes.y_label.title, axis=y_axis, scale=y_scale)
    color = alt.Color("hardware_id:N", title="Measured here (machine)", scale=axes.colors,
                      legend=alt.Legend(titleLimit=400) if legend else None)
    fmt = axes.y_label.format or ",.4~g"
    tooltip = [alt.Tooltip("hardware_id:N", title="machine"), alt.Tooltip("run_id:N", title="run"),
               alt.Tooltip(f"{axes.x}:Q", title=axes.x_label.title),
               alt.Tooltip("median:Q", title=f"median, {axes.y_label.title}", format=fmt),
               alt.Tooltip("low:Q", title="least", format=fmt), alt.Tooltip("high:Q", title="most", format=fmt),
               alt.Tooltip("repeats:Q", title="repeats")]
    tooltip += [alt.Tooltip(f"{c}:N") for c in axes.tooltip if c in stats.columns]
    base = alt.Chart(chart_data(stats)).encode(x=x_enc, color=color)
    layers = [
        base.mark_area(opacity=0.18).encode(y=alt.Y("low:Q", scale=y_scale, title=axes.y_label.title, axis=y_axis),
                                            y2="high:Q", detail="run_id:N"),
        base.mark_line(strokeWidth=2).encode(y=y_enc, detail="run_id:N"),
        base.mark_point(filled=True, size=45, opacity=1).encode(y=y_enc, tooltip=tooltip),
    ]
    if refs is not None:
        layers += _reference_layers(refs, x_enc, y_scale, axes, fmt)
    return alt.layer(*layers).properties(width=WIDTH, height=HEIGHT, title=title)


def _x_word_labels(rows: pl.DataFrame, axes: Axes) -> str | Any:
    """A Vega label expression that names the x values a word stood for ("4,096 (auto)")."""
    if not axes.x_words or axes.x_words not in rows.columns:
        return alt.Undefined
    pairs = rows.select(axes.x, pl.col(axes.x_words).cast(pl.String)).unique().drop_nulls()
    words = pairs.filter(~pl.col(axes.x_words).str.contains(r"^[0-9.]+$"))
    if words.is_empty():
        return alt.Undefined
    expr = "format(datum.value, ',')"
    for value, word in words.sort(axes.x).iter_rows():
        tick = f"format(datum.value, ',') + {json.dumps(f' ({word})')}"
        expr = f"datum.value == {json.dumps(value)} ? {tick} : {expr}"
    return expr


def _reference_layers(refs: pl.DataFrame, x_enc: alt.X, y_scale: alt.Scale, axes: Axes, fmt: str) -> list:
    """Grey hollow marks, a dashed line per reference series, bars over its range. The
    reference tables are by concurrency: drawn only where x is the concurrency."""
    base = alt.Chart(chart_data(refs)).encode(
        x=x_enc, y=alt.Y("value:Q", scale=y_scale, title=axes.y_label.title),
        shape=alt.Shape("series:N", title="Reference figures (source and machine in the tooltip)",
                        legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=520, titleLimit=520)),
    )
    tooltip = [alt.Tooltip("source:N", title="source"), alt.Tooltip("system:N"), alt.Tooltip("hardware:N"),
               alt.Tooltip("model:N"), alt.Tooltip("configuration:N"),
               alt.Tooltip("concurrency:Q", title=axes.x_label.title),
               alt.Tooltip("value:Q", title=axes.y_label.title, format=fmt), alt.Tooltip("low:Q", format=fmt),
               alt.Tooltip("high:Q", format=fmt), alt.Tooltip("notes:N")]
    grey = alt.value("#555")
    return [
        base.mark_line(strokeDash=[4, 3], strokeWidth=1, opacity=0.6).encode(detail="series:N", color=grey),
        base.mark_rule(strokeWidth=2, opacity=0.6).encode(y="low:Q", y2="high:Q", color=grey),
        base.mark_point(size=70, filled=False, strokeWidth=1.5).encode(color=grey, tooltip=tooltip),
    ]


def history_chart(rows: pl.DataFrame, group: Group, axes: Axes) -> alt.FacetChart:
    """The metric run by run (oldest first), one colour per x value, one panel per machine."""
    stats = repeat_stats(rows, axes)
    order = group.runs.with_columns(
        (pl.col("started_at").rank("ordinal").over("hardware_id")).cast(pl.Int64).alias("run_number"),
        pl.col("git_commit").str.slice(0, 10).alias("commit"),
    ).select("run_id", "run_number", "started_at", "commit", "device_run")
    stats = stats.join(order, on="run_id").with_columns(pl.col(axes.x).cast(pl.String).alias("x_value"))
    x_order = [str(v) for v in sorted(set(stats[axes.x].to_list()))]
    fmt = axes.y_label.format or ",.4~g"
    y_log = axes.y_label.log and stats["median"].min() > 0
    chart = alt.Chart().encode(
        x=alt.X("run_number:Q", title="Run of this group on the machine, oldest first",
                axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("median:Q", title=axes.y_label.title, scale=alt.Scale(type="log") if y_log else alt.Scale(),
                axis=alt.Axis(format=axes.y_label.format) if axes.y_label.format else alt.Axis()),
        color=alt.Color("x_value:O", title=axes.x_label.title, sort=x_order, scale=alt.Scale(scheme="viridis")),
    )
    tooltip = [alt.Tooltip("run_number:Q", title="run number"), alt.Tooltip("run_id:N", title="run"),
               alt.Tooltip("started_at:N", title="started (UTC)"), alt.Tooltip("commit:N", title="git commit"),
               alt.Tooltip("device_run:N", title="device run"), alt.Tooltip("x_value:N", title=axes.x_label.title),
               alt.Tooltip("median:Q", title=f"median, {axes.y_label.title}", format=fmt)]
    layer = alt.layer(chart.mark_line(strokeWidth=1, opacity=0.5),
                      chart.mark_point(filled=True, size=40).encode(tooltip=tooltip),
                      data=chart_data(stats)).properties(width=WIDTH * 2, height=HEIGHT)
    title = alt.TitleParams(
        text=f"{axes.y_label.title}, run by run ({group.name})", anchor="start",
        subtitle=wrap(f"{group.name}: {'quick' if group.quick else 'full'} runs; parameters: ",
                       [f"{k}={short(v)}" for k, v in group.params.items()])
        + [f"one point per complete run and {axes.x_label.label.lower()}: the median over its repeats; "
           "the lines above draw only each machine's latest run"],
    )
    return layer.facet(facet=alt.Facet("hardware_id:N", title=None), columns=2).properties(title=title)


def group_chart(group: Group, rows: pl.DataFrame, page: AblationPage, spec: PagesSpec, colors: alt.Scale,
                refs: pl.DataFrame | None) -> alt.ConcatChart | None:
    """Every metric of one group, a panel each (a row of panels per metric where the page
    splits by a column such as the prompt length); None where the group's x takes one value."""
    metrics = drawable_metrics(rows, page)
    if not metrics:
        return None
    split = page.panel if page.panel in rows.columns else None
    cells = [cell for metric in metrics for cell in metric_cells(group, rows, page, spec, colors, refs, metric)]
    columns = rows[split].drop_nulls().n_unique() if split else 2
    # one level of concatenation: Altair copies every sub-chart at each level it is nested in
    return alt.concat(*cells, columns=columns).properties(title=group_title(group, rows, page)) \
        .resolve_scale(x="independent", y="independent")


def metric_cells(group: Group, rows: pl.DataFrame, page: AblationPage, spec: PagesSpec, colors: alt.Scale,
                 refs: pl.DataFrame | None, metric: str) -> list[alt.LayerChart]:
    """One metric of a group: a panel, or one per value of the page's panel column."""
    axes = Axes(page.x, metric, spec.label(page.x, page), spec.label(metric, page), colors, page.tooltip,
                page.x_words)
    cell_refs = refs_for(refs, page.reference_names.get(metric, metric), group.hardware,
                         page.reference_configurations) if metric in page.reference and page.x == "concurrency" else None
    if page.panel not in rows.columns:
        return [metric_chart(rows, axes, axes.y_label.title, cell_refs)]
    panel_label = spec.label(page.panel, page)
    return [metric_chart(rows.filter(pl.col(page.panel) == value), axes,
                         f"{axes.y_label.title} · {panel_label.label.lower()} {value} {panel_label.unit}".rstrip(),
                         cell_refs)
            for value in sorted(rows[page.panel].drop_nulls().unique().to_list())]


def drawable_metrics(rows: pl.DataFrame, page: AblationPage) -> list[str]:
    """The page's metrics that the rows hold, where their x takes two values or more."""
    if page.x not in rows.columns or rows[page.x].drop_nulls().n_unique() < 2:
        return []
    return [m for m in page.metrics if m in rows.columns and rows[m].null_count() < rows.height]


def group_title(group: Group, rows: pl.DataFrame, page: AblationPage) -> alt.TitleParams:
    return alt.TitleParams(text=f"{page.title}: {group.name}", subtitle=group.subtitle() + _band_line(rows),
                           anchor="start", fontSize=15)


def _band_line(rows: pl.DataFrame) -> list[str]:
    if "repeat" in rows.columns and rows["repeat"].n_unique() > 1:
        return [f"points: median over {rows['repeat'].n_unique()} repeats; band: least to most"]
    return ["one measurement per point (no repeats)"]


def refs_for(refs: pl.DataFrame | None, metric: str, hardware: list[str],
             configurations: tuple[str, ...] = ()) -> pl.DataFrame | None:
    """The reference figures of `metric` by concurrency: the same machines' (`hardware`), and
    those of `configurations` (prefixes of the configuration column) from any machine."""
    if refs is None or not refs.height:
        return None
    where = pl.col("hardware").is_in(hardware)
    for prefix in configurations:
        where = where | pl.col("configuration").str.starts_with(prefix)
    found = refs.filter((pl.col("metric") == metric) & where & pl.col("concurrency").is_not_null())
    return found if found.height else None


def runs_chart(runs: pl.DataFrame, colors: alt.Scale) -> alt.Chart:
    """Recorded runs per ablation (quick ones apart) and machine, by status."""
    counts = runs.with_columns(
        pl.when(pl.col("quick")).then(pl.format("{} (quick)", "ablation")).otherwise("ablation").alias("what")
    ).group_by("what", "hardware_id", "status").len("runs").sort("what")
    return (
        alt.Chart(chart_data(counts), title=alt.TitleParams(
            "Recorded runs by ablation and machine", anchor="start",
            subtitle="every run in the store, any status; quick runs (--quick) counted apart"))
        .mark_bar()
        .encode(
            x=alt.X("sum(runs):Q", title="Runs (count)", axis=alt.Axis(tickMinStep=1, format="d")),
            y=alt.Y("what:N", title="Ablation"),
            yOffset="hardware_id:N",
            color=alt.Color("hardware_id:N", title="Machine", scale=colors),
            opacity=alt.Opacity("status:N", title="Status", scale=alt.Scale(
                domain=["complete", "running", "failed", "unreadable"], range=[1.0, 0.6, 0.3, 0.15])),
            tooltip=[alt.Tooltip("what:N", title="ablation"), alt.Tooltip("hardware_id:N", title="machine"),
                     "status:N", alt.Tooltip("runs:Q", title="runs")],
        )
        .properties(width=WIDTH + 180)
    )


def chart_data(frame: pl.DataFrame) -> pl.DataFrame:
    """A chart's data, JSON-safe (temporal columns as text, NaN as null). Altair inlines each
    distinct frame once, in the spec's top-level datasets, however many layers use it; a frame
    is cheap to carry through Altair's copies of layered and concatenated charts, where inline
    values (alt.Data) are deep-copied at every level."""
    return frame.with_columns(
        pl.col(pl.Datetime, pl.Date, pl.Time, pl.Duration).cast(pl.String),
        pl.col(pl.Float32, pl.Float64).fill_nan(None),
    )
