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


# Seed 002's KVFlash screen: DDTree + PFlash auto + KVFlash auto on an 8,192-token resident pool,
# ~2K effective prompt tokens a request; throughput scaled to C8 and fell at C16 (its paging cliff).
SEED_CLIFF_SOURCE = "002_e2128ad86e2e4259.txt"
SEED_CLIFF_CONFIGURATION = "screenshot: "


def seed_cliff_points(refs: pl.DataFrame) -> pl.DataFrame:
    """Seed 002's paging-cliff screen, one row per concurrency: decode tok/s, pages in and out."""
    if refs.is_empty():
        return pl.DataFrame()
    screen = refs.filter((pl.col("source") == SEED_CLIFF_SOURCE)
                         & pl.col("configuration").str.starts_with(SEED_CLIFF_CONFIGURATION)
                         & pl.col("metric").is_in(["decode_tok_s_aggregate", "page_in", "page_out"])
                         & pl.col("concurrency").is_not_null())
    if screen.is_empty():
        return pl.DataFrame()
    wide = screen.pivot(on="metric", index=["concurrency", "configuration", "hardware", "model"], values="value")
    return wide.sort("concurrency")


def cliff_chart(rows: pl.DataFrame, refs: pl.DataFrame) -> alt.LayerChart:
    """Throughput against concurrency relative to each series' own smallest concurrency: one
    line per arm of `rows` (the paging-cliff summary) and one for seed 002's screen, so that
    the shapes of the cliffs compare across machines and models (absolute figures do not)."""
    ours = rows.filter(pl.col("decode_tok_s_aggregate").is_not_null()).with_columns(
        pl.format("this project: {}", "arm").alias("series"),
        pl.lit("measured here").alias("source"),
    )
    keys = ["run_id", "series"] if "run_id" in ours.columns else ["series"]
    ours = ours.with_columns(
        (pl.col("decode_tok_s_aggregate") / pl.col("decode_tok_s_aggregate").sort_by("concurrency").first()
         .over(keys)).alias("relative"),
        pl.col("pages_in").cast(pl.Float64).alias("page_in"), pl.col("pages_out").cast(pl.Float64).alias("page_out"),
    ).select(*keys[:-1], "series", "source", "concurrency", "decode_tok_s_aggregate", "relative", "page_in",
             "page_out", "oversubscription")
    seed = seed_cliff_points(refs)
    if seed.height:
        seed = seed.with_columns(
            pl.format("seed 002: {} ({}, {})", pl.col("configuration").str.strip_prefix(SEED_CLIFF_CONFIGURATION),
                      "model", "hardware").alias("series"),
            pl.lit(SEED_CLIFF_SOURCE).alias("source"),
            (pl.col("decode_tok_s_aggregate") / pl.col("decode_tok_s_aggregate").first()).alias("relative"),
        ).select("series", "source", "concurrency", "decode_tok_s_aggregate", "relative", "page_in", "page_out")
    points = pl.concat([ours, seed], how="diagonal_relaxed") if seed.height else ours
    x_values = sorted(set(points["concurrency"].to_list()))
    base = alt.Chart(chart_data(points)).encode(
        x=alt.X("concurrency:Q", title="Concurrent sequences", scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(values=x_values)),
        y=alt.Y("relative:Q", title="Decode throughput relative to the smallest concurrency (x)"),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom", direction="vertical",
                                                                  labelLimit=640)),
    )
    fmt = ",.4~g"
    tooltip = ["series:N", "source:N", alt.Tooltip("concurrency:Q", title="concurrent sequences"),
               alt.Tooltip("decode_tok_s_aggregate:Q", title="decode tok/s, aggregate", format=fmt),
               alt.Tooltip("relative:Q", title="relative to the smallest concurrency", format=fmt),
               alt.Tooltip("page_in:Q", title="pages in", format=fmt),
               alt.Tooltip("page_out:Q", title="pages out", format=fmt),
               alt.Tooltip("oversubscription:Q", title="live KV / pool", format=fmt)]
    detail = "run_id:N" if "run_id" in points.columns else "series:N"
    return alt.layer(
        base.mark_line(strokeWidth=2).encode(detail=detail),
        base.mark_point(filled=True, size=55).encode(tooltip=tooltip),
    ).properties(width=WIDTH + 180, height=HEIGHT, title=alt.TitleParams(
        "The paging cliff beside seed 002's", anchor="start",
        subtitle=["each line relative to its own smallest concurrency; seed 002: Qwen3.6-27B on AMD gfx1151, "
                  "8,192-token resident pool, ~2K effective prompt tokens a request (the cliff at C16, ~32K live)",
                  "seed 002's page in/out are its own page counts (pages of its engine, not ours)"]))
