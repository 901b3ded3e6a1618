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
"""

from __future__ import annotations

import html
import json
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from workbench.errors import WorkbenchError
from workbench.runstore import RunStore, atomic_write_text, flatten_params

SUMMARY_TABLE = "summary"
DEFAULT_PAGES = Path(__file__).resolve().parent.parent / "dashboards" / "pages.toml"
DEFAULT_OUT_DIR = Path("dashboards") / "build"
SEEDS_PATH = Path("reference") / "seeds.parquet"
LLAMACPP_PATH = Path("reference") / "llamacpp_cpu.parquet"
WIDTH, HEIGHT = 380, 230
# Colours of the machines, assigned in sorted hardware_id order so that a machine keeps its
# colour on every chart of a build (Tableau 10).
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
           "#9d755d", "#bab0ac")
_SUBTITLE_WIDTH = 110  # characters per subtitle line before the parameter list wraps


# ---- the page definitions (dashboards/pages.toml) -------------------------------------------


@dataclass(frozen=True)
class ColumnLabel:
    """A column in words: `label (unit)` on axes; `divide_by` rescales it (bytes to GiB)."""

    label: str
    unit: str = ""
    divide_by: float = 1.0
    format: str | None = None
    log: bool = False

    def __post_init__(self) -> None:
        if not self.label.strip():
            raise WorkbenchError("a column label must not be empty")
        if not self.divide_by > 0:
            raise WorkbenchError(f"divide_by={self.divide_by!r} of {self.label!r} must be positive")

    @property
    def title(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label


@dataclass(frozen=True)
class AblationPage:
    """One ablation's page: its x axis, the metrics drawn, and what defines a group."""

    name: str
    page: str
    title: str
    about: str
    x: str
    metrics: tuple[str, ...]
    x_params: tuple[str, ...] = ()
    panel: str | None = None
    ignore_params: tuple[str, ...] = ()
    reference: tuple[str, ...] = ()
    history: str | None = None
    tooltip: tuple[str, ...] = ()
    x_words: str | None = None
    labels: Mapping[str, ColumnLabel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.page.endswith(".html") or "/" in self.page or self.page in _FIXED_PAGES:
            raise WorkbenchError(f"ablation {self.name}: page={self.page!r} must be a file name ending in .html, "
                                 f"not one of {', '.join(_FIXED_PAGES)}")
        if not self.metrics:
            raise WorkbenchError(f"ablation {self.name}: metrics must name at least one column")
        for key, names in (("reference", self.reference), ("history", (self.history,) if self.history else ())):
            stray = [n for n in names if n not in self.metrics]
            if stray:
                raise WorkbenchError(f"ablation {self.name}: {key} names {', '.join(stray)}, which is not in metrics")

    @property
    def quick_page(self) -> str:
        return self.page.removesuffix(".html") + "-quick.html"

    def drops(self, params: Mapping[str, Any]) -> set[str]:
        """Parameters left out of a group's key: the ignored ones, the model's file name where
        its sha256 names it, and the x list (the key takes the sweep in one form instead)."""
        out = {*self.x_params, *self.ignore_params}
        if "model_sha256" in params:
            out.add("model")
        return out


@dataclass(frozen=True)
class PagesSpec:
    """The whole of dashboards/pages.toml."""

    columns: Mapping[str, ColumnLabel]
    ablations: tuple[AblationPage, ...]
    overview_ablation: str = "bench"
    overview_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        pages = [a.page for a in self.ablations] + [a.quick_page for a in self.ablations]
        if len(set(pages)) != len(pages):
            raise WorkbenchError(f"two ablations share a page name: {', '.join(sorted(pages))}")
        for a in self.ablations:
            needed = [a.x, *a.metrics, *([a.panel] if a.panel else [])]
            missing = [c for c in needed if c not in self.columns and c not in a.labels]
            if missing:
                raise WorkbenchError(f"ablation {a.name}: no [columns] entry for {', '.join(missing)}; "
                                     "add a label and unit for each")
        missing = [c for c in self.overview_metrics if c not in self.columns]
        if missing:
            raise WorkbenchError(f"[overview] metrics: no [columns] entry for {', '.join(missing)}")

    def ablation(self, name: str) -> AblationPage | None:
        return next((a for a in self.ablations if a.name == name), None)

    def label(self, column: str, ablation: AblationPage | None = None) -> ColumnLabel:
        if ablation is not None and column in ablation.labels:
            return ablation.labels[column]
        if column in self.columns:
            return self.columns[column]
        raise WorkbenchError(f"column {column!r} has no label in the page definitions; add it to [columns]")


_FIXED_PAGES = ("index.html", "overview.html", "reference.html")


def load_pages(path: str | Path = DEFAULT_PAGES) -> PagesSpec:
    """Read and check a page-definition file; one WorkbenchError line for any fault."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkbenchError(f"cannot read the page definitions {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise WorkbenchError(f"{path} is not valid TOML: {exc}") from exc
    where = str(path)
    _only_keys(raw, ("columns", "overview", "ablation"), where)
    columns = {name: _build(ColumnLabel, spec, f"{where} [columns] {name}")
               for name, spec in _table(raw.get("columns", {}), f"{where} [columns]").items()}
    overview = _table(raw.get("overview", {}), f"{where} [overview]")
    _only_keys(overview, ("ablation", "metrics"), f"{where} [overview]")
    ablations = []
    for i, spec in enumerate(raw.get("ablation", [])):
        spec = dict(_table(spec, f"{where} [[ablation]] #{i + 1}"))
        labels = _table(spec.pop("labels", {}), f"{where} ablation labels")
        spec["labels"] = {k: _build(ColumnLabel, v, f"{where} ablation labels {k}") for k, v in labels.items()}
        ablations.append(_build(AblationPage, spec, f"{where} [[ablation]] {spec.get('name', i + 1)}"))
    return PagesSpec(columns, tuple(ablations), overview.get("ablation", "bench"),
                     tuple(overview.get("metrics", ())))


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise WorkbenchError(f"{where} must be a table, got {type(value).__name__}")
    return value


def _only_keys(table: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in table if k not in allowed]
    if unknown:
        raise WorkbenchError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def _build(cls, spec: Any, where: str):
    """A frozen dataclass from a TOML table: unknown or missing keys and wrong types refused."""
    spec = _table(spec, where)
    known = {f.name: f for f in fields(cls)}
    _only_keys(spec, tuple(known), where)
    values = {}
    for name, f in known.items():
        if name not in spec:
            continue
        value, kind = spec[name], str(f.type)
        if kind.startswith("tuple"):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise WorkbenchError(f"{where}: {name} must be a list of column or parameter names")
            value = tuple(value)
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise WorkbenchError(f"{where}: {name}={value!r} must be a number")
            value = float(value)
        elif kind == "bool" and not isinstance(value, bool):
            raise WorkbenchError(f"{where}: {name}={value!r} must be true or false")
        elif kind.startswith("str") and not isinstance(value, str):
            raise WorkbenchError(f"{where}: {name}={value!r} must be text")
        values[name] = value
    missing = [n for n, f in known.items()
               if n not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise WorkbenchError(f"{where}: missing key(s) {', '.join(missing)}")
    return cls(**values)


# ---- runs and groups ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Group:
    """Complete runs measured alike: one ablation, the same parameters, quick or full.

    `runs` is one row per run (run_id, hardware_id, started_at, git_commit, device_run),
    oldest first; `latest` keeps each hardware's latest run, the one its line is drawn through.
    """

    ablation: str
    quick: bool
    params: Mapping[str, Any]
    runs: pl.DataFrame
    letter: str = "A"

    @property
    def latest(self) -> pl.DataFrame:
        return self.runs.group_by("hardware_id").agg(pl.all().sort_by("started_at").last()).sort("hardware_id")

    @property
    def hardware(self) -> list[str]:
        return sorted(self.runs["hardware_id"].unique().to_list())

    def runs_on(self, hardware_id: str) -> int:
        return self.runs.filter(pl.col("hardware_id") == hardware_id).height

    @property
    def name(self) -> str:
        return f"{self.ablation} group {self.letter}{' (quick)' if self.quick else ''}"

    def subtitle(self, hardware: list[str] | None = None, width: int = _SUBTITLE_WIDTH) -> list[str]:
        """The selection in words: ablation, quick/full, parameters, the runs each line comes from."""
        kind = "quick runs (--quick)" if self.quick else "full runs"
        lines = _wrap(f"{self.name}: {kind}; parameters: ", [f"{k}={_short(v)}" for k, v in self.params.items()],
                      width)
        latest = self.latest
        if hardware is not None:
            latest = latest.filter(pl.col("hardware_id").is_in(hardware))
        picks = [f"{r['hardware_id']} {r['run_id']} (latest of {self.runs_on(r['hardware_id'])})"
                 for r in latest.iter_rows(named=True)]
        lines += _wrap("line per machine, through its latest complete run of the group: ", picks, width)
        return lines


def run_table(store: RunStore) -> tuple[pl.DataFrame, dict[str, dict[str, Any]]]:
    """Every recorded run (one row each, oldest first) and each run's parameters by run id.

    `quick` is the manifest's flag; a manifest written before the flag existed counts as a
    full run.
    """
    rows, params = [], {}
    for m in store.manifests():
        p = m.get("params") if isinstance(m.get("params"), dict) else {}
        params[m.get("run_id")] = p
        rows.append({
            "run_id": m.get("run_id"),
            "ablation": m.get("ablation"),
            "hardware_id": m.get("hardware_id"),
            "status": m.get("status"),
            "quick": bool(m.get("quick", p.get("quick", False))),
            "started_at": m.get("started_at"),
            "git_commit": m.get("git_commit"),
            "device_run": str(p.get("device_run", "")),
            "error": m.get("error"),
        })
    schema = {"run_id": pl.String, "ablation": pl.String, "hardware_id": pl.String, "status": pl.String,
              "quick": pl.Boolean, "started_at": pl.String, "git_commit": pl.String, "device_run": pl.String,
              "error": pl.String}
    return pl.DataFrame(rows, schema=schema).sort("started_at", "run_id", nulls_last=True), params


def group_runs(runs: pl.DataFrame, params: Mapping[str, Mapping[str, Any]], ablation: str,
               page: AblationPage | None, *, quick: bool, sweeps: Mapping[str, str] | None = None) -> list[Group]:
    """The complete runs of `ablation` (quick or full) in groups, the most-run group first.

    `sweeps` (run id -> the x values its rows hold, see `measured_sweeps`) stands in for the x
    list of runs whose manifest does not record it, so that a smoke run at one or two x values
    forms a group of its own instead of becoming the latest run of a full sweep's group.
    """
    chosen = runs.filter((pl.col("ablation") == ablation) & (pl.col("status") == "complete")
                         & (pl.col("quick") == quick))
    keys: dict[str, dict[str, Any]] = {}
    key_of = []
    for run_id in chosen["run_id"]:
        key = measurement_params(params.get(run_id, {}), page, (sweeps or {}).get(run_id))
        text = json.dumps(key, sort_keys=True, default=str)
        keys[text] = key
        key_of.append(text)
    chosen = chosen.with_columns(pl.Series("group_key", key_of, dtype=pl.String))
    found = [(members.height, members["started_at"].max() or "", text, members.drop("group_key"))
             for (text,), members in chosen.group_by("group_key", maintain_order=True)]
    found.sort(key=lambda g: g[:2], reverse=True)  # most runs first; ties: the one run last
    return [Group(ablation, quick, keys[text], members, _letter(i)) for i, (_, _, text, members) in enumerate(found)]


def measurement_params(params: Mapping[str, Any], page: AblationPage | None,
                       measured: str | None = None) -> dict[str, Any]:
    """The parameters that say what a run measured (flattened, sorted; see `AblationPage.drops`),
    with the sweep of x as one entry: the x list as the manifest records it, else `measured`
    (the x values of the run's rows, JSON text)."""
    try:
        flat = flatten_params(params)
    except WorkbenchError:  # a manifest from before the collision check: keep it as it is
        flat = dict(params)
    if page is None:
        return {k: flat[k] for k in sorted(flat) if k != "repeats"}
    key = {k: flat[k] for k in flat if k not in page.drops(flat)}
    recorded = next((p for p in page.x_params if p in flat), None)
    if recorded is not None:
        key[recorded] = flat[recorded]
    elif measured is not None:
        key[page.x_params[0] if page.x_params else page.x] = measured
    return dict(sorted(key.items()))


def measured_sweeps(summary: pl.DataFrame, x: str) -> dict[str, str]:
    """Run id -> the sorted x values of its rows, as JSON text ("[1, 4, 16]")."""
    if summary.is_empty() or x not in summary.columns:
        return {}
    found = summary.filter(pl.col(x).is_not_null()).group_by("run_id").agg(pl.col(x).unique().sort())
    return {run_id: json.dumps(values) for run_id, values in found.iter_rows()}


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"A{i}"


def _short(value: Any, limit: int = 40) -> str:
    text = "null" if value is None else str(value)
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):  # a sha256: its first 12 digits
        return text[:12] + "…"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _wrap(head: str, items: list[str], width: int = _SUBTITLE_WIDTH) -> list[str]:
    """`head` and the items, comma-separated, in lines of about `width` characters (Vega does
    not wrap titles)."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else "")
        if len(line) + len(piece) > width and line.strip():
            lines.append(line.rstrip())
            line = "    "
        line += piece
    lines.append(line.rstrip() if items else line + "(none)")
    return lines


# ---- reference figures ----------------------------------------------------------------------


def reference_points(seeds: pl.DataFrame | None, llamacpp: pl.DataFrame | None,
                     llamacpp_source: str = "data/reference/llamacpp_cpu.parquet") -> pl.DataFrame:
    """One row per published or reference figure: value (midpoint of a range), low, high.

    Seeds rows (data/reference/seeds.parquet) keep their source: a seed file (`published`
    True: the seeds' authors' figures, on their machines) or issue-N (measured by this
    project). llama.cpp's CPU rows become the median over repeats with their range, on the
    hardware id our runs of that CPU carry (its threads counted as the cores it had).
    """
    frames = []
    if seeds is not None and seeds.height:
        keys = ["source", "system", "hardware", "model", "configuration", "concurrency", "metric", "unit", "notes"]
        points = seeds.group_by(keys, maintain_order=True).agg(
            pl.col("value").filter(pl.col("stat") == "value").first().alias("point"),
            pl.col("value").filter(pl.col("stat") == "min").first().alias("low"),
            pl.col("value").filter(pl.col("stat") == "max").first().alias("high"),
        )
        frames.append(points.with_columns(pl.coalesce("point", (pl.col("low") + pl.col("high")) / 2).alias("value"))
                      .drop("point"))
    if llamacpp is not None and llamacpp.height:
        frames.append(_llamacpp_points(llamacpp).with_columns(pl.lit(llamacpp_source).alias("source")))
    if not frames:
        return pl.DataFrame()
    out = pl.concat(frames, how="diagonal_relaxed")
    return out.with_columns(
        pl.format("{} · {}", "system", "configuration").alias("series"),
        (pl.col("source").str.ends_with(".txt")).alias("published"),
    )


def _llamacpp_points(frame: pl.DataFrame) -> pl.DataFrame:
    from workbench.hardware import hardware_id

    metrics = [c for c in ("decode_tok_s_aggregate", "decode_tok_s_per_stream", "prefill_tok_s") if c in frame.columns]
    long = frame.unpivot(on=metrics, index=["mode", "concurrency", "threads", "cpu_model", "prompt_tokens",
                                            "gen_tokens", "llama_cpp_python_version"],
                         variable_name="metric", value_name="v").drop_nulls("v")
    agg = long.group_by("mode", "concurrency", "threads", "cpu_model", "prompt_tokens", "gen_tokens",
                        "llama_cpp_python_version", "metric", maintain_order=True).agg(
        pl.col("v").median().alias("value"), pl.col("v").min().alias("low"), pl.col("v").max().alias("high"),
        pl.len().alias("repeats"))
    return agg.select(
        pl.format("llama.cpp CPU (llama-cpp-python {})", "llama_cpp_python_version").alias("system"),
        pl.struct("cpu_model", "threads").map_elements(
            lambda s: hardware_id({"cpu_model": s["cpu_model"], "cpu_cores_available": s["threads"]}),
            return_dtype=pl.String).alias("hardware"),
        pl.lit("Gemma 3 270M Q4_K_M GGUF (project default)").alias("model"),
        pl.format("{}, {}-token prompts, {} threads", "mode", "prompt_tokens", "threads").alias("configuration"),
        "concurrency", "metric", pl.lit("tok/s").alias("unit"),
        pl.format("measured by scripts/bench_llamacpp_cpu.py; median of {} repeats, range min–max",
                  "repeats").alias("notes"),
        "value", "low", "high",
    )


# ---- views ----------------------------------------------------------------------------------


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
    base = alt.Chart(_data(stats)).encode(x=x_enc, color=color)
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
    base = alt.Chart(_data(refs)).encode(
        x=x_enc, y=alt.Y("value:Q", scale=y_scale, title=axes.y_label.title),
        shape=alt.Shape("series:N", title="Reference figures, same machine (source in the tooltip)",
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
                      data=_data(stats)).properties(width=WIDTH * 2, height=HEIGHT)
    title = alt.TitleParams(
        text=f"{axes.y_label.title}, run by run ({group.name})", anchor="start",
        subtitle=_wrap(f"{group.name}: {'quick' if group.quick else 'full'} runs; parameters: ",
                       [f"{k}={_short(v)}" for k, v in group.params.items()])
        + [f"one point per complete run and {axes.x_label.label.lower()}: the median over its repeats; "
           "the lines above draw only each machine's latest run"],
    )
    return layer.facet(facet=alt.Facet("hardware_id:N", title=None), columns=2).properties(title=title)


def group_chart(group: Group, rows: pl.DataFrame, page: AblationPage, spec: PagesSpec, colors: alt.Scale,
                refs: pl.DataFrame | None) -> alt.ConcatChart | None:
    """Every metric of one group, a panel each (a row of panels per metric where the page
    splits by a column such as the prompt length); None where the group's x takes one value."""
    metrics = _drawable(rows, page)
    if not metrics:
        return None
    split = page.panel if page.panel in rows.columns else None
    cells = [cell for metric in metrics for cell in metric_cells(group, rows, page, spec, colors, refs, metric)]
    columns = rows[split].drop_nulls().n_unique() if split else 2
    # one level of concatenation: Altair copies every sub-chart at each level it is nested in
    return alt.concat(*cells, columns=columns).properties(title=_group_title(group, rows, page)) \
        .resolve_scale(x="independent", y="independent")


def metric_cells(group: Group, rows: pl.DataFrame, page: AblationPage, spec: PagesSpec, colors: alt.Scale,
                 refs: pl.DataFrame | None, metric: str) -> list[alt.LayerChart]:
    """One metric of a group: a panel, or one per value of the page's panel column."""
    axes = Axes(page.x, metric, spec.label(page.x, page), spec.label(metric, page), colors, page.tooltip,
                page.x_words)
    cell_refs = _refs_for(refs, metric, group.hardware) if metric in page.reference and page.x == "concurrency" \
        else None
    if page.panel not in rows.columns:
        return [metric_chart(rows, axes, axes.y_label.title, cell_refs)]
    panel_label = spec.label(page.panel, page)
    return [metric_chart(rows.filter(pl.col(page.panel) == value), axes,
                         f"{axes.y_label.title} · {panel_label.label.lower()} {value} {panel_label.unit}".rstrip(),
                         cell_refs)
            for value in sorted(rows[page.panel].drop_nulls().unique().to_list())]


def _drawable(rows: pl.DataFrame, page: AblationPage) -> list[str]:
    """The page's metrics that the rows hold, where their x takes two values or more."""
    if page.x not in rows.columns or rows[page.x].drop_nulls().n_unique() < 2:
        return []
    return [m for m in page.metrics if m in rows.columns and rows[m].null_count() < rows.height]


def _group_title(group: Group, rows: pl.DataFrame, page: AblationPage) -> alt.TitleParams:
    return alt.TitleParams(text=f"{page.title}: {group.name}", subtitle=group.subtitle() + _band_line(rows),
                           anchor="start", fontSize=15)


def _band_line(rows: pl.DataFrame) -> list[str]:
    if "repeat" in rows.columns and rows["repeat"].n_unique() > 1:
        return [f"points: median over {rows['repeat'].n_unique()} repeats; band: least to most"]
    return ["one measurement per point (no repeats)"]


def _refs_for(refs: pl.DataFrame | None, metric: str, hardware: list[str]) -> pl.DataFrame | None:
    if refs is None or not refs.height:
        return None
    found = refs.filter((pl.col("metric") == metric) & pl.col("hardware").is_in(hardware)
                        & pl.col("concurrency").is_not_null())
    return found if found.height else None


def single_x_table(group: Group, rows: pl.DataFrame, page: AblationPage, spec: PagesSpec) -> str:
    """A group whose x takes one value: its medians as a table (a chart would be a strip of dots)."""
    metrics = [m for m in page.metrics if m in rows.columns and rows[m].null_count() < rows.height]
    x_label = spec.label(page.x, page)
    head = ["machine", "run", x_label.title] + [spec.label(m, page).title for m in metrics]
    body = []
    for (hw, run_id, x), part in rows.group_by("hardware_id", "run_id", page.x, maintain_order=True):
        cells = [hw, run_id, x]
        for m in metrics:
            v, label = part[m].cast(pl.Float64).median(), spec.label(m, page)
            cells.append("" if v is None else f"{v:.1%}" if label.format == "%" else f"{v / label.divide_by:,.4g}")
        body.append(cells)
    return _table_html(head, body)


def seeds_chart(refs: pl.DataFrame, axes: Axes, title: str | alt.TitleParams, *,
                shape_by_source: bool = True) -> alt.LayerChart:
    """The seeds' published figures of one metric against concurrency: colour per system,
    shape per source (else squares, apart from our circles), a line per published series,
    bars over published ranges."""
    pts = refs.filter(pl.col("concurrency").is_not_null())
    x_values = sorted(set(pts["concurrency"].to_list()))
    base = alt.Chart(_data(pts)).encode(
        x=alt.X("concurrency:Q", title=axes.x_label.title, scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(values=x_values)),
        y=alt.Y("value:Q", title=axes.y_label.title, scale=alt.Scale(type="log")),
        color=alt.Color("system:N", title="Published by (system)",
                        legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=520)),
    )
    fmt = ",.4~g"
    tooltip = [alt.Tooltip("source:N", title="source"), "system:N", "hardware:N", "model:N", "configuration:N",
               alt.Tooltip("concurrency:Q", title=axes.x_label.title),
               alt.Tooltip("value:Q", title=axes.y_label.title, format=fmt), alt.Tooltip("low:Q", format=fmt),
               alt.Tooltip("high:Q", format=fmt), "notes:N"]
    return alt.layer(
        base.mark_line(opacity=0.5, strokeDash=[4, 3]).encode(detail="series:N"),
        base.mark_rule(strokeWidth=3).encode(y="low:Q", y2="high:Q"),
        base.mark_point(filled=True, size=60).encode(
            shape=alt.Shape("source:N", title="Source file", legend=alt.Legend(orient="bottom", direction="vertical"))
            if shape_by_source else alt.value("square"), tooltip=tooltip),
    ).properties(width=WIDTH, height=HEIGHT, title=title)


def reference_metrics_chart(refs: pl.DataFrame, spec: PagesSpec, metrics: tuple[str, ...]) -> alt.FacetChart:
    """Other published figures, one panel per metric (its label and unit), each with its own scale."""
    points = refs.filter(pl.col("metric").is_in(list(metrics))).with_columns(
        pl.col("metric").replace_strict({m: spec.label(m).title for m in metrics}).alias("metric_title"),
        pl.format("{} · {} sequence(s)", pl.col("configuration"),
                  pl.col("concurrency").cast(pl.String).fill_null("?")).alias("label"),
    )
    base = alt.Chart().encode(
        x=alt.X("value:Q", title="value, in the unit of the panel's title"),
        y=alt.Y("label:N", title=None, axis=alt.Axis(labelLimit=420)),
        color=alt.Color("source:N", title="Source"),
    )
    dots = base.mark_point(filled=True, size=50).encode(
        tooltip=["source:N", "system:N", "hardware:N", "configuration:N", "concurrency:Q", "value:Q", "unit:N",
                 "notes:N"])
    ranges = base.mark_rule(strokeWidth=3).encode(x="low:Q", x2="high:Q")
    return (
        alt.layer(ranges, dots, data=_data(points))
        .properties(width=WIDTH)
        .facet(row=alt.Row("metric_title:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left",
                                                                              labelFontWeight="bold")))
        .resolve_scale(x="independent", y="independent")
        .properties(title=alt.TitleParams("Other published figures", anchor="start",
                                          subtitle="From data/reference/seeds.parquet; bars span published ranges"))
    )


def runs_chart(runs: pl.DataFrame, colors: alt.Scale) -> alt.Chart:
    """Recorded runs per ablation (quick ones apart) and machine, by status."""
    counts = runs.with_columns(
        pl.when(pl.col("quick")).then(pl.format("{} (quick)", "ablation")).otherwise("ablation").alias("what")
    ).group_by("what", "hardware_id", "status").len("runs").sort("what")
    return (
        alt.Chart(_data(counts), title=alt.TitleParams(
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


# ---- pages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """One block of a page: a heading, an optional note, a chart, raw HTML (tables, links)."""

    title: str
    chart: alt.TopLevelMixin | None = None
    note: str = ""
    body_html: str = ""
    anchor: str = ""  # the heading's id, for links within the page


@dataclass(frozen=True)
class Page:
    """A page to write: its file, title, short name in the navigation, a line on what it shows."""

    file: str
    title: str
    nav: str
    about: str
    sections: tuple[Section, ...]
    runs_used: int = 0


@dataclass(frozen=True, eq=False)
class _Build:
    """What every page is built from, read once."""

    spec: PagesSpec
    store: RunStore
    runs: pl.DataFrame
    params: Mapping[str, Mapping[str, Any]]
    summary: pl.DataFrame
    refs: pl.DataFrame
    seeds_path: Path
    colors: alt.Scale
    built_at: str

    def groups(self, ablation: str, page: AblationPage, *, quick: bool) -> list[Group]:
        sweeps = measured_sweeps(self.summary.filter(pl.col("ablation") == ablation), page.x) \
            if "ablation" in self.summary.columns else {}
        return group_runs(self.runs, self.params, ablation, page, quick=quick, sweeps=sweeps)

    def colors_for(self, hardware: list[str]) -> alt.Scale:
        """The build's colours of these machines only (a legend lists what the chart draws)."""
        domain, colors = list(self.colors.domain), list(self.colors.range)
        keep = sorted(set(hardware))
        return alt.Scale(domain=keep, range=[colors[domain.index(h)] for h in keep])

    def rows_of(self, run_ids: list[str]) -> pl.DataFrame:
        if self.summary.is_empty() or "run_id" not in self.summary.columns:
            return pl.DataFrame()
        rows = self.summary.filter(pl.col("run_id").is_in(run_ids))
        return rows.select([c for c in rows.columns if rows[c].null_count() < rows.height])


def build_dashboards(
    data_dir: str | Path = "data",
    out_dir: str | Path = DEFAULT_OUT_DIR,
    *,
    reference: str | Path | None = None,
    llamacpp: str | Path | None = None,
    pages: str | Path | None = None,
) -> list[Path]:
    """Write index.html, overview.html, reference.html and a page per ablation present (and per
    ablation's quick runs, where there are any); return their paths, the index first.

    `reference` and `llamacpp` default to `<data_dir>/reference/seeds.parquet` and
    `.../llamacpp_cpu.parquet`; a missing one is noted on the pages. `pages` defaults to the
    repository's dashboards/pages.toml.
    """
    spec = load_pages(pages if pages is not None else DEFAULT_PAGES)
    store = RunStore(data_dir)
    seeds_path = Path(reference) if reference is not None else store.root / SEEDS_PATH
    llama_path = Path(llamacpp) if llamacpp is not None else store.root / LLAMACPP_PATH
    runs, params = run_table(store)
    summary = store.load(SUMMARY_TABLE) if runs.filter(pl.col("status") == "complete").height else pl.DataFrame()
    ctx = _Build(
        spec=spec, store=store, runs=runs, params=params, summary=summary,
        refs=reference_points(_read(seeds_path), _read(llama_path), str(llama_path)), seeds_path=seeds_path,
        colors=palette(runs["hardware_id"].drop_nulls().to_list()),
        built_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    built = [_overview_page(ctx), _reference_page(ctx, seeds_path, llama_path)]
    for ablation in sorted(runs["ablation"].drop_nulls().unique().to_list()):
        page = spec.ablation(ablation)
        built.append(_ablation_page(ctx, ablation, page, quick=False))
        if runs.filter((pl.col("ablation") == ablation) & pl.col("quick")).height:
            built.append(_ablation_page(ctx, ablation, page, quick=True))
    script = _vega_bundle()
    out = Path(out_dir)
    nav = [("index.html", "Index")] + [(p.file, p.nav) for p in built]
    written = [_write_page(out / p.file, p, nav, script, ctx.built_at) for p in built]
    index = _index_page(ctx, built, data_dir)
    return [_write_page(out / index.file, index, nav, script, ctx.built_at), *written]


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
        for metric in _drawable(mine, page):
            if metrics is None or metric in metrics:
                cells = metric_cells(group, mine, page, spec, palette(group.hardware), None, metric)
                charts.append(alt.hconcat(*cells).properties(title=_group_title(group, mine, page)))
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


def _read(path: Path) -> pl.DataFrame | None:
    return pl.read_parquet(path) if path.is_file() else None


def _overview_page(ctx: _Build) -> Page:
    spec, runs = ctx.spec, ctx.runs
    sections = []
    if runs.is_empty():
        sections.append(Section("Runs", note=f"No runs recorded in {ctx.store.runs_dir} yet. Run an ablation "
                                "(`workbench ablate chunk-sizing`) or `workbench bench`, then rebuild with "
                                "`workbench dashboard`. The reference figures below come from the seeds and "
                                "this project's issues."))
    else:
        table = runs.select("run_id", "ablation", "quick", "hardware_id", "status", "started_at",
                            pl.col("git_commit").str.slice(0, 10), "error")
        sections.append(Section("Runs", runs_chart(runs, ctx.colors), body_html=_frame_html(table)))
    page = spec.ablation(spec.overview_ablation)
    groups = ctx.groups(spec.overview_ablation, page, quick=False) if page else []
    used: set[str] = set()
    for metric in spec.overview_metrics:
        chart, picked = _headline_chart(ctx, page, groups, metric) if page else (None, [])
        used |= set(picked)
        label = spec.label(metric, page)
        if chart is None:
            x_words = spec.label(page.x, page).label.lower() if page else "x values"
            sections.append(Section(label.label, note=f"No complete full run of {spec.overview_ablation!r} has "
                                    f"{label.label.lower()} at two or more {x_words}."))
            continue
        seeds = " On the right, the seeds' published figures on other machines and models, on the same axes: " \
                "compare shapes, not levels." if _seed_rows(ctx.refs, metric).height else ""
        sections.append(Section(
            label.label, chart,
            note=f"One panel per machine, each a group of full {spec.overview_ablation} runs drawn through its "
                 "latest run on that machine: the group that spans the most machines, then the machine's most-run "
                 "group, then the one run last. The panels' parameters differ where their subtitles say so. "
                 f"Grey marks: reference figures measured on the same machine.{seeds} Every group is on the "
                 f"{page.page} page."))
    quick = runs.filter(pl.col("quick")).height
    if quick:
        sections.append(Section("Quick runs", note=f"{quick} quick run(s) (--quick) are left out of these charts; "
                                "each ablation's quick runs have their own page (see the index)."))
    if ctx.refs.is_empty():
        sections.append(Section("Reference figures", note=f"No reference table at {ctx.seeds_path}; build it with "
                                "scripts/build_reference_data.py."))
    return Page("overview.html", "Overview: throughput per machine beside the reference figures", "Overview",
                f"Headline decode throughput and share of the bandwidth floor per machine "
                f"({spec.overview_ablation} runs), beside the seeds' figures; every recorded run.",
                tuple(sections), len(used))


def _headline_chart(ctx: _Build, page: AblationPage, groups: list[Group], metric: str):
    spec = ctx.spec
    axes = Axes(page.x, metric, spec.label(page.x, page), spec.label(metric, page), ctx.colors, page.tooltip)
    panels, picked = [], []
    for hw in sorted({h for g in groups for h in g.hardware}):
        best = None
        # the group that spans the most machines (so that panels compare alike where they can),
        # then the machine's most-run one, then the one run last; its latest run must draw the metric
        for g in sorted((g for g in groups if g.runs_on(hw)), key=lambda g: (
                len(g.hardware), g.runs_on(hw), g.runs.filter(pl.col("hardware_id") == hw)["started_at"].max() or ""),
                reverse=True):
            run_id = g.latest.filter(pl.col("hardware_id") == hw)["run_id"][0]
            rows = ctx.rows_of([run_id])
            if metric in rows.columns and page.x in rows.columns and rows.filter(
                    pl.col(metric).is_not_null())[page.x].n_unique() > 1:
                best = (g, run_id, rows)
                break
        if best is None:
            continue
        g, run_id, rows = best
        refs = _refs_for(ctx.refs, metric, [hw]) if metric in page.reference else None
        title = alt.TitleParams(text=hw, subtitle=g.subtitle([hw], width=64), anchor="start", subtitleFontSize=10)
        panel_axes = Axes(axes.x, axes.y, axes.x_label, axes.y_label, ctx.colors_for([hw]), axes.tooltip)
        panels.append(metric_chart(rows, panel_axes, title, refs, legend=False).properties(width=WIDTH - 60))
        picked.append(run_id)
    if not panels:
        return None, []
    seeds = _seed_rows(ctx.refs, metric)
    if seeds.height and page.x == "concurrency":
        panels.append(seeds_chart(seeds, axes, alt.TitleParams(
            "The seeds' published figures", anchor="start", subtitleFontSize=10,
            subtitle=["other machines and models (data/reference/seeds.parquet)", "compare shapes, not levels"]),
            shape_by_source=False).properties(width=WIDTH - 60))
    title = alt.TitleParams(f"{axes.y_label.title} against {axes.x_label.label.lower()}, per machine",
                            anchor="start", fontSize=15)
    chart = alt.hconcat(*panels).resolve_scale(y="shared", color="independent", shape="independent")
    return chart.properties(title=title), picked


def _seed_rows(refs: pl.DataFrame, metric: str) -> pl.DataFrame:
    """Published figures from the seed files (not this project's own reference measurements)."""
    if refs.is_empty():
        return refs
    return refs.filter((pl.col("metric") == metric) & pl.col("published") & pl.col("concurrency").is_not_null())


def _ablation_page(ctx: _Build, ablation: str, page: AblationPage | None, *, quick: bool) -> Page:
    spec, runs = ctx.spec, ctx.runs
    mine = runs.filter(pl.col("ablation") == ablation)
    kind = "quick" if quick else "full"
    counts = mine.filter(pl.col("quick") == quick).group_by("status").len().sort("status")
    line = ", ".join(f"{n} {s}" for s, n in counts.iter_rows()) or "none"
    if page is None:
        file = f"{ablation}{'-quick' if quick else ''}.html"
        note = (f"No page definition for the ablation {ablation!r} in dashboards/pages.toml: add an [[ablation]] "
                f"entry (x, metrics, labels) to chart it. Its {kind} runs: {line}.")
        table = mine.filter(pl.col("quick") == quick).select("run_id", "hardware_id", "status", "started_at")
        name = f"{ablation}{' (quick runs)' if quick else ''}"
        return Page(file, name, name, "no page definition yet",
                    (Section("Runs", note=note, body_html=_frame_html(table)),))
    groups = ctx.groups(ablation, page, quick=quick)
    other = mine.filter(pl.col("quick") != quick).height
    elsewhere = (f" {other} {'full' if quick else 'quick'} run(s) are on {page.page if quick else page.quick_page}."
                 if other else "")
    intro = (f"This page: the {kind} runs ({line}), in {len(groups)} group(s) of complete runs with "
             "the same parameters. A group's chart draws one line per machine, through that machine's latest run "
             f"of the group.{elsewhere}")
    sections = [Section("Runs", note=intro, body_html=_groups_table(groups))]
    used = set()
    for group in groups:
        run_ids = group.latest["run_id"].to_list()
        rows = ctx.rows_of(run_ids)
        used |= set(run_ids)
        section = partial(Section, f"Group {group.letter}: " + _distinct(group, groups),
                          anchor=f"group-{group.letter}")
        if rows.is_empty() or page.x not in rows.columns:
            sections.append(section(note=f"The latest runs of {group.name} have no {page.x!r} rows in their "
                                    f"{SUMMARY_TABLE!r} table."))
            continue
        chart = group_chart(group, rows, page, spec, ctx.colors_for(group.hardware), ctx.refs)
        if chart is None:
            x_label = spec.label(page.x, page)
            values = ", ".join(map(str, sorted(rows[page.x].drop_nulls().unique().to_list())))
            sections.append(section(note=" ".join(group.subtitle()) + ". Every selected run measured a single "
                                    f"value of {x_label.label.lower()} ({values}): a table, not a chart.",
                                    body_html=single_x_table(group, rows, page, spec)))
            continue
        sections.append(section(chart=chart))
        if page.history and any(group.runs_on(h) > 1 for h in group.hardware):
            all_rows = ctx.rows_of(group.runs["run_id"].to_list())
            if page.history in all_rows.columns:
                axes = Axes(page.x, page.history, spec.label(page.x, page), spec.label(page.history, page),
                            ctx.colors_for(group.hardware))
                sections.append(Section(f"Group {group.letter}, run by run", history_chart(all_rows, group, axes),
                                        note=f"All {group.runs.height} complete runs of {group.name}, oldest first: "
                                        "how the measurement moved as the code changed (hover for the commit)."))
    title = page.title + (" — quick runs" if quick else "")
    about = f"{page.about.split('. ')[0].rstrip('.')}; {kind} runs, {len(groups)} group(s)."
    nav = f"{page.name} (quick)" if quick else page.name
    return Page(page.quick_page if quick else page.page, title, nav, about, tuple(sections), len(used))


def _distinct(group: Group, groups: list[Group]) -> str:
    """The parameters that tell this group from the others on its page, in `k=v` form."""
    keys = sorted({k for g in groups for k in g.params})
    differ = [k for k in keys if len({json.dumps(g.params.get(k), default=str) for g in groups}) > 1]
    shown = [f"{k}={_short(group.params.get(k, '—'), 24)}" for k in differ if k in group.params] or ["the only group"]
    return ", ".join(shown) + f" · {', '.join(group.hardware)}"


def _groups_table(groups: list[Group]) -> str:
    """The page's groups, each linked to its section: runs, parameters, the run each line is."""
    head = "".join(f"<th>{h}</th>" for h in ("group", "machines", "complete runs", "parameters",
                                             "latest run per machine (the line)"))
    rows = []
    for g in groups:
        cells = [", ".join(g.hardware), str(g.runs.height), ", ".join(f"{k}={_short(v)}" for k, v in g.params.items()),
                 ", ".join(f"{r['hardware_id']}: {r['run_id']}" for r in g.latest.iter_rows(named=True))]
        rows.append(f'<tr><td><a href="#group-{g.letter}">{g.letter}</a></td>'
                    + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>" if rows else ""


def _reference_page(ctx: _Build, seeds_path: Path, llama_path: Path) -> Page:
    spec, refs = ctx.spec, ctx.refs
    missing = [str(p) for p in (seeds_path, llama_path) if not p.is_file()]
    sections = []
    if missing:
        sections.append(Section("Missing tables", note=f"No reference table at {', '.join(missing)}; "
                                "build them with scripts/build_reference_data.py and scripts/bench_llamacpp_cpu.py."))
    decode = refs.filter((pl.col("metric") == "decode_tok_s_aggregate") & pl.col("concurrency").is_not_null()) \
        if refs.height else refs
    if decode.height:
        axes = Axes("concurrency", "decode_tok_s_aggregate", spec.label("concurrency"),
                    spec.label("decode_tok_s_aggregate"), ctx.colors)
        sections.append(Section("Decode throughput", seeds_chart(decode, axes, alt.TitleParams(
            f"{axes.y_label.title}: every reference figure", anchor="start",
            subtitle="seed files (published by the seeds' authors) and this project's own reference measurements "
                     "(issue-N, llama.cpp CPU); different models and machines")).properties(width=720, height=380),
            note="Bars span published ranges. The overview and bench pages draw the same-machine figures beside "
                 "our runs."))
    others = tuple(m for m in ("prefill_tok_s", "decode_tok_s_per_stream", "ttft_s_max", "accepted_per_step",
                               "page_out", "peak_memory_gb") if refs.height and m in set(refs["metric"]))
    if others:
        sections.append(Section("Other published figures", reference_metrics_chart(refs, spec, others)))
    if refs.height:
        sections.append(Section("All reference rows", body_html=_frame_html(
            refs.select("source", "system", "hardware", "model", "configuration", "concurrency", "metric", "value",
                        "low", "high", "unit", "notes"), summary=f"all {refs.height} reference figures")))
    return Page("reference.html", "Reference figures: the seeds and this project's baselines", "Reference figures",
                "Every published figure of the seeds and every reference measurement (llama.cpp, transformers) "
                "with its source.", tuple(sections))


def _index_page(ctx: _Build, built: list[Page], data_dir: str | Path) -> Page:
    runs = ctx.runs
    complete = runs.filter(pl.col("status") == "complete")
    latest = runs["run_id"].max() if runs.height else None
    items = "".join(
        f'<li><a href="{html.escape(p.file)}">{html.escape(p.title)}</a> — {html.escape(p.about)}'
        + (f" Draws {p.runs_used} run(s)." if p.runs_used else "") + "</li>"
        for p in built)
    body = (f"<p>Built {html.escape(ctx.built_at)} from {html.escape(str(Path(data_dir)))}: {complete.height} "
            f"complete run(s) of {runs.height} recorded ({runs.filter(pl.col('quick')).height} quick), latest "
            f"{html.escape(str(latest))}; reference figures from {html.escape(str(ctx.seeds_path))}. "
            f"Pages defined in dashboards/pages.toml; rebuild with <code>workbench dashboard</code>.</p>"
            f"<ul class=\"index\">{items}</ul>")
    return Page("index.html", "Slotlab workbench dashboards", "Index", "", (Section("Dashboards", body_html=body),))


# ---- HTML -----------------------------------------------------------------------------------


def _data(frame: pl.DataFrame) -> pl.DataFrame:
    """A chart's data, JSON-safe (temporal columns as text, NaN as null). Altair inlines each
    distinct frame once, in the spec's top-level datasets, however many layers use it; a frame
    is cheap to carry through Altair's copies of layered and concatenated charts, where inline
    values (alt.Data) are deep-copied at every level."""
    return frame.with_columns(
        pl.col(pl.Datetime, pl.Date, pl.Time, pl.Duration).cast(pl.String),
        pl.col(pl.Float32, pl.Float64).fill_nan(None),
    )


def _table_html(head: list[str], body: list[list[Any]], summary: str | None = None, max_rows: int = 500) -> str:
    th = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    rows = "".join("<tr>" + "".join(f"<td>{'' if v is None else html.escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in body[:max_rows])
    table = f"<table><tr>{th}</tr>{rows}</table>"
    return f"<details><summary>{html.escape(summary)}</summary>{table}</details>" if summary else table


def _frame_html(frame: pl.DataFrame, summary: str | None = None) -> str:
    return _table_html(frame.columns, [list(r) for r in frame.iter_rows()], summary or f"{frame.height} row(s)")


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
p.note, p.about {{ color: #555; max-width: 70em; }}
ul.index li {{ margin: 0.4em 0; max-width: 70em; }}
footer {{ color: #777; font-size: 0.85em; margin-top: 3em; }}
table {{ border-collapse: collapse; font-size: 0.8em; margin-top: 0.5em; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }}
</style>
<script>{script}</script>
</head>
<body>
<h1>{title}</h1>
<nav>{nav}</nav>
{about}
{sections}
<footer>Built {built_at} by <code>workbench dashboard</code> from dashboards/pages.toml and the run store.</footer>
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


def _write_page(path: Path, page: Page, nav: list[tuple[str, str]], script: str, built_at: str) -> Path:
    specs: dict[str, Any] = {}
    blocks = []
    for i, s in enumerate(page.sections):
        anchor = f' id="{html.escape(s.anchor)}"' if s.anchor else ""
        parts = [f"<h2{anchor}>{html.escape(s.title)}</h2>"]
        if s.note:
            parts.append(f'<p class="note">{html.escape(s.note)}</p>')
        if s.chart is not None:
            chart_id = f"chart-{i}"
            specs[chart_id] = s.chart.to_dict()
            parts.append(f'<div class="chart" id="{chart_id}"></div>')
        parts.append(s.body_html)
        blocks.append("<section>" + "\n".join(parts) + "</section>")
    links = " ".join(
        f'<a href="{html.escape(file)}"{" class=here" if file == path.name else ""}>{html.escape(name)}</a>'
        for file, name in nav
    )
    text = _PAGE.format(
        title=html.escape(page.title),
        script=script,
        nav=links,
        about=f'<p class="about">{html.escape(page.about)}</p>' if page.about else "",
        sections="\n".join(blocks),
        built_at=html.escape(built_at),
        specs=json.dumps(specs).replace("</", "<\\/"),
    )
    atomic_write_text(path, text)
    return path


class _AblationViews(Mapping):
    """`ABLATION_VIEWS[name]`: (title, columns needed, view over rows) per metric of the page,
    read from the page definitions when asked for (no I/O at import). Kept for
    `ablations.chunk_sizing_charts` until it calls `ablation_charts` itself."""

    def __getitem__(self, ablation: str) -> list[tuple[str, tuple[str, ...], Any]]:
        return _metric_views(ablation)

    def __iter__(self):
        return iter([a.name for a in load_pages().ablations])

    def __len__(self) -> int:
        return len(load_pages().ablations)


ABLATION_VIEWS = _AblationViews()


# ---- CLI glue -------------------------------------------------------------------------------


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
    paths = build_dashboards(args.data_dir, args.out, reference=args.reference, llamacpp=args.llamacpp,
                             pages=args.pages)
    for path in paths:
        print(f"wrote {path}")
    print(f"open file://{paths[0].resolve()}")
    return 0
