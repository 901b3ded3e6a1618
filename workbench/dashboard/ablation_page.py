"""An ablation's page (full or quick runs): its groups, a chart of each, a run-by-run history."""

from __future__ import annotations

import html
import json
from functools import partial

import polars as pl

from workbench.dashboard.context import SUMMARY_TABLE, BuildContext
from workbench.dashboard.groups import Group, short
from workbench.dashboard.pages import AblationPage, PagesSpec
from workbench.dashboard.render import Page, Section, frame_html, table_html
from workbench.dashboard.views import Axes, group_chart, history_chart


def ablation_page(ctx: BuildContext, ablation: str, page: AblationPage | None, *, quick: bool) -> Page:
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
                    (Section("Runs", note=note, body_html=frame_html(table)),))
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
    shown = [f"{k}={short(group.params.get(k, '—'), 24)}" for k in differ if k in group.params] or ["the only group"]
    return ", ".join(shown) + f" · {', '.join(group.hardware)}"


def _groups_table(groups: list[Group]) -> str:
    """The page's groups, each linked to its section: runs, parameters, the run each line is."""
    head = "".join(f"<th>{h}</th>" for h in ("group", "machines", "complete runs", "parameters",
                                             "latest run per machine (the line)"))
    rows = []
    for g in groups:
        cells = [", ".join(g.hardware), str(g.runs.height), ", ".join(f"{k}={short(v)}" for k, v in g.params.items()),
                 ", ".join(f"{r['hardware_id']}: {r['run_id']}" for r in g.latest.iter_rows(named=True))]
        rows.append(f'<tr><td><a href="#group-{g.letter}">{g.letter}</a></td>'
                    + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>" if rows else ""


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
    return table_html(head, body)
