"""The QSA-boundary ablation's own view: quality against context length with each arm's
boundary marked, and aggregate decode against concurrency beside seed 000's (its QSA above 2K:
4 slots 24.8 tok/s against 24.7-24.9 for one, no gain from batching)."""

from __future__ import annotations

import altair as alt
import polars as pl

from workbench.dashboard.views import HEIGHT, WIDTH, chart_data

QUALITY = (("top1_agreement", "Top-1 agreement with dense"), ("kl_mean", "KL(dense || QSA), nats"),
           ("needle_qsa", "Needle retrieved, QSA"))
SEED_000 = ((1, 24.8), (4, 24.8))  # seed 000: 1 slot 24.7-24.9 (midpoint), 4 slots 24.8 tok/s aggregate


def boundary_chart(rows: pl.DataFrame) -> alt.VConcatChart:
    """Quality panels against context length, a rule at every arm's boundary (sink + top_k +
    local blocks, times the block), then QSA's aggregate decode relative to its one-sequence
    rate at the longest context, beside seed 000's."""
    q = rows.filter(pl.col("concurrency") == pl.col("concurrency").min().over("context_len", "arm")).unique(
        ["context_len", "arm"], keep="first", maintain_order=True)
    panels = []
    for col, title in QUALITY:
        if col not in q.columns or q[col].null_count() == q.height:
            continue
        data = chart_data(q.select("context_len", "arm", "boundary", col))
        base = alt.Chart(data).encode(x=alt.X("context_len:Q", title="Context length (tokens)",
                                              scale=alt.Scale(type="log", base=2)),
                                      color=alt.Color("arm:N", title=None, legend=alt.Legend(orient="bottom")))
        line = base.mark_line(point=True).encode(y=alt.Y(f"{col}:Q", title=title),
                                                 tooltip=["arm:N", "context_len:Q", f"{col}:Q", "boundary:Q"])
        rule = base.mark_rule(strokeDash=[4, 3]).encode(x="boundary:Q")
        panels.append(alt.layer(line, rule).properties(width=WIDTH // 2, height=HEIGHT // 2, title=title))
    top = alt.hconcat(*panels) if panels else alt.hconcat()
    longest = rows.filter(pl.col("context_len") == pl.col("context_len").max())
    ours = longest.filter(pl.col("decode_tok_s_aggregate").is_not_null()).with_columns(
        (pl.col("decode_tok_s_aggregate") / pl.col("decode_tok_s_aggregate").sort_by("concurrency").first()
         .over("arm")).alias("relative"), pl.format("this project: {}", "arm").alias("series"))
    seed = pl.DataFrame({"concurrency": [c for c, _ in SEED_000], "decode_tok_s_aggregate": [v for _, v in SEED_000]}
                        ).with_columns((pl.col("decode_tok_s_aggregate") / SEED_000[0][1]).alias("relative"),
                                       pl.lit("seed 000: QSA above 2K (Qwen3.8-Flash-Next, AMD gfx1151)").alias("series"))
    points = pl.concat([ours.select("series", "concurrency", "decode_tok_s_aggregate", "relative"), seed],
                       how="diagonal_relaxed")
    speed = alt.Chart(chart_data(points)).mark_line(point=True).encode(
        x=alt.X("concurrency:Q", title="Concurrent sequences", scale=alt.Scale(type="log", base=2)),
        y=alt.Y("relative:Q", title="Aggregate decode relative to one sequence (x)"),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=640)),
        tooltip=["series:N", "concurrency:Q", "decode_tok_s_aggregate:Q", "relative:Q"],
    ).properties(width=WIDTH, height=HEIGHT, title=alt.TitleParams(
        "Batching past the boundary beside seed 000's", anchor="start",
        subtitle=[f"this project at the longest context of the rows ({longest['context_len'].max()} tokens); "
                  "seed 000: 4-slot 24.8 tok/s against 24.7-24.9 for one slot"]))
    return alt.vconcat(top, speed)
