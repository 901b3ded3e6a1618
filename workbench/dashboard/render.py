"""HTML: a page's sections into one self-contained file, Vega's JavaScript inlined, written atomically."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from workbench.errors import WorkbenchError
from workbench.runstore import atomic_write_text


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


def table_html(head: list[str], body: list[list[Any]], summary: str | None = None, max_rows: int = 500) -> str:
    th = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    rows = "".join("<tr>" + "".join(f"<td>{'' if v is None else html.escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in body[:max_rows])
    table = f"<table><tr>{th}</tr>{rows}</table>"
    return f"<details><summary>{html.escape(summary)}</summary>{table}</details>" if summary else table


def frame_html(frame: pl.DataFrame, summary: str | None = None) -> str:
    return table_html(frame.columns, [list(r) for r in frame.iter_rows()], summary or f"{frame.height} row(s)")


def vega_bundle() -> str:
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


def write_page(path: Path, page: Page, nav: list[tuple[str, str]], script: str, built_at: str) -> Path:
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
