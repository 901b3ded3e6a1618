"""The overview page: every recorded run, and the headline metrics per machine beside the seeds' figures."""

from __future__ import annotations

import altair as alt
import polars as pl

from workbench.dashboard.context import BuildContext
from workbench.dashboard.groups import Group
from workbench.dashboard.pages import AblationPage
from workbench.dashboard.reference import seed_rows, seeds_chart
from workbench.dashboard.render import Page, Section, frame_html
from workbench.dashboard.views import WIDTH, Axes, metric_chart, refs_for, runs_chart


def overview_page(ctx: BuildContext) -> Page:
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
        sections.append(Section("Runs", runs_chart(runs, ctx.colors), body_html=frame_html(table)))
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
                "compare shapes, not levels." if seed_rows(ctx.refs, metric).height else ""
        sections.append(Section(
            label.label, chart,
            note=f"One panel per machine, each a group of full {spec.overview_ablation} runs drawn through its "
                 "latest run on that machine: the group that spans the most machines, then the machine's most-run "
                 "group, then the widest sweep, then the one run last. The panels' parameters differ where their subtitles say so. "
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


def _headline_chart(ctx: BuildContext, page: AblationPage, groups: list[Group], metric: str):
    spec = ctx.spec
    axes = Axes(page.x, metric, spec.label(page.x, page), spec.label(metric, page), ctx.colors, page.tooltip)
    panels, picked = [], []
    for hw in sorted({h for g in groups for h in g.hardware}):
        best = None
        # the group that spans the most machines (so that panels compare alike where they can),
        # then the machine's most-run one, then the widest sweep (a special measurement, e.g. a
        # shared-prefix run at two concurrencies, is no headline), then the one run last; its
        # latest run must draw the metric
        def sweep(g) -> int:
            rows = ctx.rows_of([g.latest.filter(pl.col("hardware_id") == hw)["run_id"][0]])
            return rows[page.x].n_unique() if page.x in rows.columns else 0

        for g in sorted((g for g in groups if g.runs_on(hw)), key=lambda g: (
                len(g.hardware), g.runs_on(hw), sweep(g),
                g.runs.filter(pl.col("hardware_id") == hw)["started_at"].max() or ""), reverse=True):
            run_id = g.latest.filter(pl.col("hardware_id") == hw)["run_id"][0]
            rows = ctx.rows_of([run_id])
            if metric in rows.columns and page.x in rows.columns and rows.filter(
                    pl.col(metric).is_not_null())[page.x].n_unique() > 1:
                best = (g, run_id, rows)
                break
        if best is None:
            continue
        g, run_id, rows = best
        refs = refs_for(ctx.refs, metric, [hw]) if metric in page.reference else None
        title = alt.TitleParams(text=hw, subtitle=g.subtitle([hw], width=64), anchor="start", subtitleFontSize=10)
        panel_axes = Axes(axes.x, axes.y, axes.x_label, axes.y_label, ctx.colors_for([hw]), axes.tooltip)
        panels.append(metric_chart(rows, panel_axes, title, refs, legend=False).properties(width=WIDTH - 60))
        picked.append(run_id)
    if not panels:
        return None, []
    seeds = seed_rows(ctx.refs, metric)
    if seeds.height and page.x == "concurrency":
        panels.append(seeds_chart(seeds, axes, alt.TitleParams(
            "The seeds' published figures", anchor="start", subtitleFontSize=10,
            subtitle=["other machines and models (data/reference/seeds.parquet)", "compare shapes, not levels"]),
            shape_by_source=False).properties(width=WIDTH - 60))
    title = alt.TitleParams(f"{axes.y_label.title} against {axes.x_label.label.lower()}, per machine",
                            anchor="start", fontSize=15)
    chart = alt.hconcat(*panels).resolve_scale(y="shared", color="independent", shape="independent")
    return chart.properties(title=title), picked
