"""Reference figures: the seeds' published figures and this project's llama.cpp CPU baselines.

The tables (`<data_dir>/reference/seeds.parquet`, `.../llamacpp_cpu.parquet`) become one
row per figure; their charts and the reference page draw them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import altair as alt
import polars as pl

from workbench.dashboard.pages import PagesSpec
from workbench.dashboard.render import Page, Section, frame_html
from workbench.dashboard.views import HEIGHT, WIDTH, Axes, chart_data

if TYPE_CHECKING:
    from workbench.dashboard.context import BuildContext

SEEDS_PATH = Path("reference") / "seeds.parquet"
LLAMACPP_PATH = Path("reference") / "llamacpp_cpu.parquet"


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


def read_table(path: Path) -> pl.DataFrame | None:
    return pl.read_parquet(path) if path.is_file() else None


def seed_rows(refs: pl.DataFrame, metric: str) -> pl.DataFrame:
    """Published figures from the seed files (not this project's own reference measurements)."""
    if refs.is_empty():
        return refs
    return refs.filter((pl.col("metric") == metric) & pl.col("published") & pl.col("concurrency").is_not_null())


def seeds_chart(refs: pl.DataFrame, axes: Axes, title: str | alt.TitleParams, *,
                shape_by_source: bool = True) -> alt.LayerChart:
    """The seeds' published figures of one metric against concurrency: colour per system,
    shape per source (else squares, apart from our circles), a line per published series,
    bars over published ranges."""
    pts = refs.filter(pl.col("concurrency").is_not_null())
    x_values = sorted(set(pts["concurrency"].to_list()))
    base = alt.Chart(chart_data(pts)).encode(
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
        alt.layer(ranges, dots, data=chart_data(points))
        .properties(width=WIDTH)
        .facet(row=alt.Row("metric_title:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left",
                                                                              labelFontWeight="bold")))
        .resolve_scale(x="independent", y="independent")
        .properties(title=alt.TitleParams("Other published figures", anchor="start",
                                          subtitle="From data/reference/seeds.parquet; bars span published ranges"))
    )


def reference_page(ctx: BuildContext, seeds_path: Path, llama_path: Path) -> Page:
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
        sections.append(Section("All reference rows", body_html=frame_html(
            refs.select("source", "system", "hardware", "model", "configuration", "concurrency", "metric", "value",
                        "low", "high", "unit", "notes"), summary=f"all {refs.height} reference figures")))
    return Page("reference.html", "Reference figures: the seeds and this project's baselines", "Reference figures",
                "Every published figure of the seeds and every reference measurement (llama.cpp, transformers) "
                "with its source.", tuple(sections))
