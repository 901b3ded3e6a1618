"""Dashboards: Altair views over the run store's tidy parquet, built into self-contained HTML.

Each view is a function taking a polars frame and returning an Altair chart. The pages
(`build_dashboards`) read only parquet: every complete run's `summary` table and the seeds'
reference table. Vega, Vega-Lite and Vega-Embed are inlined into each page (from the
`vl-convert-python` package), so a page opens offline, from disk or as a CI artifact.

The `summary` table is one row per measured configuration (and repeat); views use the columns
they need and skip themselves, with a note, when those are absent:

    concurrency, decode_tok_s_aggregate, bandwidth_floor_tok_s      overview
    chunk_size, ttft_s_max, itl_s_max, itl_s_p99, peak_memory_bytes chunk-sizing page

`bandwidth_floor_tok_s` is the decode rate at which the step would take exactly the time to
read its bytes at the machine's measured bandwidth; measured / floor is the fraction reached.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from workbench.errors import WorkbenchError
from workbench.runstore import RunStore, atomic_write_text, flatten_params

SUMMARY_TABLE = "summary"
REFERENCE_PATH = Path("reference") / "seeds.parquet"
WIDTH, HEIGHT = 560, 300
_ID_COLUMNS = {"run_id", "ablation", "hardware_id", "repeat"}
# Row columns that are swept settings rather than measurements (x axes of the generic page).
SWEEP_COLUMNS = ("concurrency", "chunk_size", "num_slots", "prompt_tokens", "max_new_tokens")


@dataclass(frozen=True)
class Section:
    """One block of a page: a heading, an optional note, and a chart or a pre-rendered table."""

    title: str
    chart: alt.TopLevelMixin | None = None
    note: str = ""
    table_html: str = ""


# ---- views over the run store ---------------------------------------------------------------


def runs_chart(runs: pl.DataFrame) -> alt.Chart:
    """Runs per ablation, one bar per hardware_id (all statuses; the tooltip splits them)."""
    counts = runs.group_by("ablation", "hardware_id", "status").len("runs").sort("ablation")
    return (
        alt.Chart(_data(counts), title="Recorded runs")
        .mark_bar()
        .encode(
            x=alt.X("sum(runs):Q", title="runs"),
            y=alt.Y("ablation:N", title=None),
            yOffset="hardware_id:N",
            color=alt.Color("hardware_id:N", title="hardware"),
            opacity=alt.Opacity("status:N", sort=["complete", "running", "failed"], legend=alt.Legend(title="status")),
            tooltip=["ablation:N", "hardware_id:N", "status:N", "runs:Q"],
        )
        .properties(width=WIDTH)
    )


def decode_vs_concurrency_chart(summary: pl.DataFrame) -> alt.LayerChart:
    """Aggregate decode tok/s against concurrent sequences, one line per hardware and ablation."""
    return _measured_vs(summary, "concurrency", "decode_tok_s_aggregate", "decode tok/s (aggregate)",
                        "Decode throughput vs concurrency (line: latest run per hardware)", x_log=True, y_log=True,
                        dash="ablation", line_from="latest")


def bandwidth_fraction_chart(summary: pl.DataFrame) -> alt.LayerChart:
    """Aggregate decode tok/s as a fraction of each machine's bandwidth floor."""
    frame = summary.with_columns(
        (pl.col("decode_tok_s_aggregate") / pl.col("bandwidth_floor_tok_s")).alias("fraction_of_floor")
    )
    return _measured_vs(frame, "concurrency", "fraction_of_floor", "fraction of bandwidth floor",
                        "Decode throughput / bandwidth floor (line: latest run per hardware)", x_log=True,
                        dash="ablation", y_format="%", line_from="latest")


def ttft_vs_chunk_chart(summary: pl.DataFrame) -> alt.Chart:
    """Worst time to first token against the prefill chunk size."""
    return _measured_vs(summary, "chunk_size", "ttft_s_max", "max TTFT (s)", "Time to first token vs chunk size",
                        x_log=True, per_hardware=True, series="prompt_len")


def itl_vs_chunk_chart(summary: pl.DataFrame) -> alt.Chart:
    """Max and p99 inter-token latency of the decoding slots against the prefill chunk size."""
    present = [c for c in ("itl_s_max", "itl_s_p99") if c in summary.columns]
    long = summary.unpivot(on=present, index=[c for c in summary.columns if c not in present],
                           variable_name="statistic", value_name="itl_s")
    long = long.with_columns(pl.col("statistic").str.replace("itl_s_", ""))
    return _measured_vs(long, "chunk_size", "itl_s", "inter-token latency (s)",
                        "Inter-token latency vs chunk size (max, p99)", x_log=True, per_hardware=True, dash="statistic",
                        series="prompt_len")


def throughput_vs_chunk_chart(summary: pl.DataFrame) -> alt.Chart:
    """Aggregate decode tok/s against the prefill chunk size."""
    return _measured_vs(summary, "chunk_size", "decode_tok_s_aggregate", "decode tok/s (aggregate)",
                        "Aggregate throughput vs chunk size", x_log=True, per_hardware=True, series="prompt_len")


def peak_memory_vs_chunk_chart(summary: pl.DataFrame) -> alt.Chart:
    """Peak memory (GiB) against the prefill chunk size."""
    frame = summary.with_columns((pl.col("peak_memory_bytes") / 2**30).alias("peak_memory_gib"))
    return _measured_vs(frame, "chunk_size", "peak_memory_gib", "peak memory (GiB)", "Peak memory vs chunk size",
                        x_log=True, per_hardware=True, series="prompt_len")


def metric_vs_param_chart(summary: pl.DataFrame, param: str, metric: str) -> alt.Chart:
    """Any measured column against any swept parameter (the fallback view of an ablation page)."""
    numeric = summary.schema[param].is_numeric()
    return _measured_vs(summary, param, metric, metric, f"{metric} vs {param}", x_log=False,
                        x_type="Q" if numeric else "N", per_hardware=True)


# ---- views over the seeds' reference table --------------------------------------------------


def reference_decode_chart(reference: pl.DataFrame) -> alt.LayerChart:
    """Published aggregate decode tok/s against concurrency, ranges drawn as bars."""
    points = _reference_points(reference.filter(pl.col("metric") == "decode_tok_s_aggregate"))
    points = points.filter(pl.col("concurrency").is_not_null())
    base = alt.Chart(_data(points)).encode(
        x=alt.X("concurrency:Q", scale=alt.Scale(type="log", base=2), title="concurrent sequences"),
        y=alt.Y("value:Q", scale=alt.Scale(type="log"), title="decode tok/s (aggregate)"),
        color=alt.Color("hardware:N", legend=alt.Legend(labelLimit=360, orient="bottom", columns=1)),
    )
    tooltip = ["source:N", "system:N", "hardware:N", "model:N", "configuration:N", "concurrency:Q",
               alt.Tooltip("value:Q", format=",.2f"), alt.Tooltip("low:Q", format=",.2f"),
               alt.Tooltip("high:Q", format=",.2f"), "notes:N"]
    line = base.mark_line(opacity=0.5).encode(detail="series:N")
    dots = base.mark_point(filled=True, size=60).encode(
        shape=alt.Shape("source:N", legend=alt.Legend(orient="bottom")), tooltip=tooltip
    )
    ranges = base.mark_rule(strokeWidth=3).encode(y="low:Q", y2="high:Q")
    return alt.layer(line, ranges, dots).properties(
        width=WIDTH + 140, height=HEIGHT + 60, title="Seeds and our peers: decode throughput vs concurrency"
    )


def reference_metrics_chart(reference: pl.DataFrame, metrics: tuple[str, ...]) -> alt.FacetChart:
    """Other published figures, one panel per metric, each with its own scale."""
    points = _reference_points(reference.filter(pl.col("metric").is_in(list(metrics))))
    points = points.with_columns(
        pl.format("{} · C{}", pl.col("configuration"), pl.col("concurrency").cast(pl.String).fill_null("?"))
        .alias("label")
    )
    base = alt.Chart().encode(
        x=alt.X("value:Q", title=None),
        y=alt.Y("label:N", title=None, axis=alt.Axis(labelLimit=420)),
        color=alt.Color("source:N"),
    )
    dots = base.mark_point(filled=True, size=50).encode(
        tooltip=["source:N", "system:N", "hardware:N", "configuration:N", "concurrency:Q", "value:Q", "unit:N",
                 "notes:N"]
    )
    ranges = base.mark_rule(strokeWidth=3).encode(x="low:Q", x2="high:Q")
    return (
        alt.layer(ranges, dots, data=_data(points))
        .properties(width=WIDTH - 160)
        .facet(row=alt.Row("metric:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left")))
        .resolve_scale(x="independent", y="independent")
        .properties(title="Other published figures")
    )


# ---- pages ----------------------------------------------------------------------------------


def build_dashboards(
    data_dir: str | Path = "data",
    out_dir: str | Path = "dashboards",
    *,
    reference: str | Path | None = None,
) -> list[Path]:
    """Write overview.html and one page per ablation present; return their paths.

    `reference` defaults to `<data_dir>/reference/seeds.parquet`; a missing one is noted on the page.
    """
    store = RunStore(data_dir)
    out = Path(out_dir)
    reference_path = Path(reference) if reference is not None else store.root / REFERENCE_PATH
    ref = pl.read_parquet(reference_path) if reference_path.exists() else None
    runs = store.list_runs()
    summary = store.load(SUMMARY_TABLE) if not runs.is_empty() else pl.DataFrame()
    ablations = sorted(runs["ablation"].drop_nulls().unique().to_list())
    pages = {"overview": "overview.html"} | {a: _page_name(a) for a in ablations}
    script = _vega_bundle()

    written = []
    overview = _overview_sections(store, runs, summary, ref, reference_path)
    written.append(_write_page(out / pages["overview"], "Slotlab workbench: overview", overview, pages, script))
    for ablation in ablations:
        rows = summary.filter(pl.col("ablation") == ablation) if "ablation" in summary.columns else summary
        sections = _ablation_sections(store, ablation, runs.filter(pl.col("ablation") == ablation), rows)
        written.append(_write_page(out / pages[ablation], f"Ablation: {ablation}", sections, pages, script))
    return written


def _overview_sections(store, runs, summary, ref, reference_path) -> list[Section]:
    sections = []
    if runs.is_empty():
        sections.append(Section(
            "Runs", note=f"No runs recorded in {store.runs_dir} yet. Run an ablation notebook or "
            "`workbench bench`, then rebuild with `workbench dashboard`. The reference figures below "
            "come from the seeds and this project's issues."))
    else:
        sections.append(Section("Runs", runs_chart(runs), table_html=_html_table(
            runs.select("run_id", "ablation", "hardware_id", "status", "started_at", "duration_s", "tables", "error"))))
        if _has(summary, "concurrency", "decode_tok_s_aggregate"):
            sections.append(Section("Decode throughput", decode_vs_concurrency_chart(summary),
                                    note="Complete runs' summary rows; lines are means over repeats."))
            if _has(summary, "bandwidth_floor_tok_s"):
                sections.append(Section("Against the bandwidth floor", bandwidth_fraction_chart(summary),
                                        note="Measured aggregate decode tok/s / bandwidth_floor_tok_s "
                                        "of the same row."))
        else:
            sections.append(Section("Decode throughput", note="No complete run has summary rows with "
                                    "concurrency and decode_tok_s_aggregate yet."))
    if ref is None:
        sections.append(Section("Reference figures", note=f"No reference table at {reference_path}; build it "
                                "with scripts/build_reference_data.py."))
        return sections
    sections.append(Section("Reference: decode throughput", reference_decode_chart(ref),
                            note="Published by the seeds' authors (source = seed file) and measured by this "
                            "project (source = issue-N). Bars span published ranges. Different models and "
                            "machines: compare shapes, not levels."))
    others = tuple(m for m in ("prefill_tok_s", "decode_tok_s_per_stream", "ttft_s_max", "accepted_per_step",
                               "page_out", "peak_memory_gb") if m in set(ref["metric"]))
    if others:
        sections.append(Section("Reference: other figures", reference_metrics_chart(ref, others),
                                table_html=_html_table(ref, summary_line=f"all {ref.height} reference rows")))
    return sections


def _ablation_sections(store, ablation, runs, summary) -> list[Section]:
    counts = runs.group_by("status").len().sort("status")
    line = ", ".join(f"{n} {s}" for s, n in counts.iter_rows())
    sections = [Section("Runs", note=f"{runs.height} run(s): {line}. Charts use complete runs' "
                        f"{SUMMARY_TABLE!r} rows, coloured by hardware_id.")]
    if summary.is_empty():
        sections.append(Section("No data", note=f"No complete run of {ablation!r} wrote a {SUMMARY_TABLE!r} table."))
        return sections
    views = ABLATION_VIEWS.get(ablation)
    if _has(summary, "concurrency", "decode_tok_s_aggregate", "bandwidth_floor_tok_s") and \
            summary["concurrency"].n_unique() > 1:
        sections.append(Section("Against the bandwidth floor", bandwidth_fraction_chart(summary)))
    if views is not None:
        for title, columns, view in views:
            if _has(summary, *columns):
                sections.append(Section(title, view(summary)))
            else:
                sections.append(Section(title, note=f"Needs columns {', '.join(columns)} in the summary rows."))
        return sections
    params = _swept_params(store, ablation, summary)
    metrics = [c for c, t in summary.schema.items()
               if t.is_numeric() and c not in _ID_COLUMNS and c not in params
               and summary[c].null_count() < summary.height]
    if not params or not metrics:
        sections.append(Section("No sweep", note="No swept parameter and measured numeric column to plot."))
        return sections
    for metric in metrics[:12]:
        sections.append(Section(f"{metric} vs {params[0]}", metric_vs_param_chart(summary, params[0], metric)))
    return sections


# Per-ablation pages: (title, columns the view needs, view). Ablations not listed get the
# generic page: every measured column against the first swept parameter.
ABLATION_VIEWS: dict[str, list[tuple[str, tuple[str, ...], Callable[[pl.DataFrame], Any]]]] = {
    "chunk-sizing": [
        ("Time to first token", ("chunk_size", "ttft_s_max"), ttft_vs_chunk_chart),
        ("Inter-token latency", ("chunk_size", "itl_s_max"), itl_vs_chunk_chart),
        ("Aggregate throughput", ("chunk_size", "decode_tok_s_aggregate"), throughput_vs_chunk_chart),
        ("Peak memory", ("chunk_size", "peak_memory_bytes"), peak_memory_vs_chunk_chart),
    ],
}


def _swept_params(store: RunStore, ablation: str, summary: pl.DataFrame) -> list[str]:
    """Columns to plot against: swept params of this ablation's runs, then known sweep columns
    of the rows (SWEEP_COLUMNS), each taking more than one value; numeric ones first."""
    names: dict[str, None] = {}
    for m in store.manifests():
        if m.get("ablation") == ablation and isinstance(m.get("params"), dict):
            names |= dict.fromkeys(flatten_params(m["params"]))
    names |= dict.fromkeys(SWEEP_COLUMNS)
    swept = [n for n in names if n in summary.columns and n not in _ID_COLUMNS and summary[n].n_unique() > 1]
    return sorted(swept, key=lambda n: not summary.schema[n].is_numeric())


def _measured_vs(frame, x, y, y_title, title, *, x_log, dash=None, y_format=None, x_type="Q", y_log=False,
                 per_hardware=False, series=None, line_from="mean"):
    """Points for every row, a line through the mean per x; colour by hardware_id.

    `line_from="latest"`: the line goes through the latest run of each hardware only (run ids
    begin with their UTC start time), so that older code versions stay visible as points
    without pulling the current curve.

    `series` (a column such as prompt_len) splits the lines and gives the points a shape, so
    that rows of different settings are not averaged into one curve.

    `per_hardware` draws one panel per hardware_id, each with its own y scale, so that a slow
    machine's curve keeps its shape next to a fast one.
    """
    keep = frame.filter(pl.col(x).is_not_null() & pl.col(y).is_not_null())
    tooltip = [f"{c}:{'Q' if keep.schema[c].is_numeric() else 'N'}"
               for c in dict.fromkeys(("run_id", "hardware_id", "ablation", dash, x, y)) if c and c in keep.columns]
    x_enc = alt.X(f"{x}:{x_type}", title=x,
                  scale=alt.Scale(type="log", base=2) if x_log and x_type == "Q" else alt.Undefined)
    axis = alt.Axis(format=y_format) if y_format else alt.Undefined
    y_scale = alt.Scale(type="log") if y_log else alt.Undefined
    color = alt.Color("hardware_id:N", title="hardware")
    extra = {"strokeDash": alt.StrokeDash(f"{dash}:N")} if dash and dash in keep.columns else {}
    split = series if series and series in keep.columns else None
    if split:
        tooltip.append(f"{split}:N")
        extra["detail"] = alt.Detail(f"{split}:N")
    base = alt.Chart().encode(x=x_enc, color=color, **extra)
    line = base.mark_line().encode(y=alt.Y(f"mean({y}):Q", title=y_title, axis=axis, scale=y_scale))
    shape = {"shape": alt.Shape(f"{split}:N")} if split else {}
    dots = base.mark_point(size=50, opacity=0.7, filled=True).encode(
        y=alt.Y(f"{y}:Q", title=y_title, axis=axis, scale=y_scale), tooltip=tooltip, **shape
    )
    if line_from == "latest" and "run_id" in keep.columns:
        line = line.properties(data=_data(keep.filter(pl.col("run_id") == pl.col("run_id").max().over("hardware_id"))))
        dots = dots.properties(data=_data(keep))
        layer = alt.layer(line, dots)
    else:
        layer = alt.layer(line, dots, data=_data(keep))
    if not per_hardware:
        return layer.properties(width=WIDTH, height=HEIGHT, title=title)
    return (
        layer.properties(width=WIDTH * 2 // 3, height=HEIGHT)
        .facet(facet=alt.Facet("hardware_id:N", title=None), columns=2)
        .resolve_scale(y="independent")
        .properties(title=title)
    )


def _reference_points(ref: pl.DataFrame) -> pl.DataFrame:
    """One row per published figure: value (midpoint of a range), low and high."""
    keys = ["source", "system", "hardware", "model", "configuration", "concurrency", "metric", "unit", "notes"]
    points = ref.group_by(keys, maintain_order=True).agg(
        pl.col("value").filter(pl.col("stat") == "value").first().alias("point"),
        pl.col("value").filter(pl.col("stat") == "min").first().alias("low"),
        pl.col("value").filter(pl.col("stat") == "max").first().alias("high"),
    )
    return points.with_columns(
        pl.coalesce("point", (pl.col("low") + pl.col("high")) / 2).alias("value"),
        pl.format("{} · {} · {}", "source", "system", "configuration").alias("series"),
    ).drop("point")


def _has(frame: pl.DataFrame, *columns: str) -> bool:
    return all(c in frame.columns and frame[c].null_count() < frame.height for c in columns) and frame.height > 0


def _data(frame: pl.DataFrame) -> alt.Data:
    """Inline values (JSON-safe: temporal columns as text, NaN as null)."""
    frame = frame.with_columns(
        pl.col(pl.Datetime, pl.Date, pl.Time, pl.Duration).cast(pl.String),
        pl.col(pl.Float32, pl.Float64).fill_nan(None),
    )
    return alt.Data(values=frame.to_dicts())


def _page_name(ablation: str) -> str:
    return "ablation-overview.html" if ablation == "overview" else f"{ablation}.html"


def _html_table(frame: pl.DataFrame, summary_line: str | None = None, max_rows: int = 500) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in frame.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{'' if v is None else html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in frame.head(max_rows).iter_rows()
    )
    line = summary_line or f"{frame.height} row(s)"
    return f"<details><summary>{html.escape(line)}</summary><table><tr>{head}</tr>{body}</table></details>"


def _vega_bundle() -> str:
    """Vega + Vega-Lite + Vega-Embed as one script, matching Altair's Vega-Lite version."""
    try:
        import vl_convert as vlc
    except ImportError as exc:
        raise WorkbenchError(
            "building dashboards needs the vl-convert-python package (it inlines Vega's JavaScript); "
            "pip install vl-convert-python"
        ) from exc
    major, minor = alt.SCHEMA_VERSION.lstrip("v").split(".")[:2]
    return vlc.javascript_bundle(vl_version=f"v{major}_{minor}").replace("</script", "<\\/script")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }}
nav a {{ margin-right: 1em; }}
nav a.here {{ font-weight: bold; text-decoration: none; color: #222; }}
section {{ margin: 1.5em 0 2.5em; }}
p.note {{ color: #555; max-width: 60em; }}
table {{ border-collapse: collapse; font-size: 0.8em; margin-top: 0.5em; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }}
</style>
<script>{script}</script>
</head>
<body>
<h1>{title}</h1>
<nav>{nav}</nav>
{sections}
<script>
(function () {{
  const specs = {specs};
  const state = {{ views: {{}}, errors: [] }};
  window.workbenchDashboard = state;
  const options = {{ renderer: "svg", actions: {{ export: true, source: true, compiled: false, editor: false }} }};
  state.ready = Promise.all(Object.keys(specs).map(function (id) {{
    return vegaEmbed("#" + id, specs[id], options)
      .then(function (result) {{ state.views[id] = result.view; }})
      .catch(function (err) {{ state.errors.push(id + ": " + err); console.error(err); }});
  }}));
}})();
</script>
</body>
</html>
"""


def _write_page(path: Path, title: str, sections: list[Section], pages: dict[str, str], script: str) -> Path:
    specs: dict[str, Any] = {}
    blocks = []
    for i, s in enumerate(sections):
        parts = [f"<h2>{html.escape(s.title)}</h2>"]
        if s.note:
            parts.append(f'<p class="note">{html.escape(s.note)}</p>')
        if s.chart is not None:
            chart_id = f"chart-{i}"
            specs[chart_id] = s.chart.to_dict()
            parts.append(f'<div class="chart" id="{chart_id}"></div>')
        parts.append(s.table_html)
        blocks.append("<section>" + "\n".join(parts) + "</section>")
    nav = " ".join(
        f'<a href="{html.escape(file)}"{" class=here" if file == path.name else ""}>{html.escape(name)}</a>'
        for name, file in pages.items()
    )
    page = _PAGE.format(
        title=html.escape(title),
        script=script,
        nav=nav,
        sections="\n".join(blocks),
        specs=json.dumps(specs).replace("</", "<\\/"),
    )
    atomic_write_text(path, page)
    return path


# ---- CLI glue -------------------------------------------------------------------------------


def register_cli(subparsers) -> None:
    """Add `workbench dashboard` to an argparse subparsers object."""
    p = subparsers.add_parser("dashboard", help="build the HTML dashboards from the run store",
                              description="Build self-contained HTML dashboards from recorded runs.")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="run store root (default: data)")
    p.add_argument("--out", type=Path, default=Path("dashboards"), help="output folder (default: dashboards)")
    p.add_argument("--reference", type=Path, default=None,
                   help="seeds reference parquet (default: <data-dir>/reference/seeds.parquet)")
    p.set_defaults(func=_cmd_dashboard)


def _cmd_dashboard(args) -> int:
    paths = build_dashboards(args.data_dir, args.out, reference=args.reference)
    for path in paths:
        print(f"wrote {path}")
    print(f"open file://{paths[0].resolve()}")
    return 0
