"""`build_dashboards`: every page from the run store and the reference tables, the index first."""

from __future__ import annotations

import html
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

from workbench.dashboard import DEFAULT_OUT_DIR
from workbench.dashboard.ablation_page import ablation_page
from workbench.dashboard.context import SUMMARY_TABLE, BuildContext
from workbench.dashboard.groups import run_table
from workbench.dashboard.overview import overview_page
from workbench.dashboard.pages import DEFAULT_PAGES, load_pages
from workbench.dashboard.reference import LLAMACPP_PATH, SEEDS_PATH, read_table, reference_page, reference_points
from workbench.dashboard.render import Page, Section, vega_bundle, write_page
from workbench.dashboard.views import palette
from workbench.runstore import RunStore


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
    ctx = BuildContext(
        spec=spec, store=store, runs=runs, params=params, summary=summary,
        refs=reference_points(read_table(seeds_path), read_table(llama_path), str(llama_path)), seeds_path=seeds_path,
        colors=palette(runs["hardware_id"].drop_nulls().to_list()),
        built_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    built = [overview_page(ctx), reference_page(ctx, seeds_path, llama_path)]
    for ablation in sorted(runs["ablation"].drop_nulls().unique().to_list()):
        page = spec.ablation(ablation)
        built.append(ablation_page(ctx, ablation, page, quick=False))
        if runs.filter((pl.col("ablation") == ablation) & pl.col("quick")).height:
            built.append(ablation_page(ctx, ablation, page, quick=True))
    script = vega_bundle()
    out = Path(out_dir)
    nav = [("index.html", "Index")] + [(p.file, p.nav) for p in built]
    written = [write_page(out / p.file, p, nav, script, ctx.built_at) for p in built]
    index = _index_page(ctx, built, data_dir)
    return [write_page(out / index.file, index, nav, script, ctx.built_at), *written]


def _index_page(ctx: BuildContext, built: list[Page], data_dir: str | Path) -> Page:
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
