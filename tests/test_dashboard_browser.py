"""Dashboards: built from a synthetic run store, then opened in headless Chromium.

The browser tests drive Debian's /usr/bin/chromium through Playwright (no browser download)
and assert what a person would see: every chart rendered with marks, no console errors, no
network fetches. Screenshots land in test-artifacts/ (gitignored).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import polars as pl
import pytest

from workbench.dashboard import build_dashboards
from workbench.runstore import RunStore

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "data" / "reference" / "seeds.parquet"
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
FAKE_MACHINES = {
    "cpu:Fake-CPU:2c": {"bandwidth": 20e9, "speed": 1.0},
    "gpu:Fake-GPU": {"bandwidth": 3.0e12, "speed": 40.0},
}


def write_synthetic_runs(root: Path, seed: int = 0) -> RunStore:
    """Chunk-sizing and decode-batching runs on two fake machines, plus one failed run."""
    rng = random.Random(seed)
    store = RunStore(root)
    for hw, spec in FAKE_MACHINES.items():
        hardware = {"hardware_id": hw, "cpu_model": "fake", "gpu_name": None}
        for chunk in (256, 512, 1024, 2048, 4096):
            for repeat in range(2):
                params = {"chunk_size": chunk, "concurrency": 4, "repeat": repeat, "engine": {"num_slots": 4}}
                with store.start_run("chunk-sizing", params, hardware=hardware) as run:
                    noise = 1 + rng.uniform(-0.05, 0.05)
                    run.write_rows("summary", [{
                        "ttft_s_max": 2.0 / spec["speed"] * (1 + 512 / chunk) * noise,
                        "itl_s_max": chunk / 4096 / spec["speed"] * noise,
                        "itl_s_p99": chunk / 8192 / spec["speed"] * noise,
                        "decode_tok_s_aggregate": 25 * spec["speed"] * (1 - chunk / 16384) * noise,
                        "peak_memory_bytes": int((1 + chunk / 1024) * 2**30),
                    }])
        with store.start_run("decode-batching", {"model": "synthetic"}, hardware=hardware) as run:
            floor = spec["bandwidth"] / 540e6
            run.write_rows("summary", [
                {"concurrency": c, "decode_tok_s_aggregate": floor * c * 0.6 / math.sqrt(c),
                 "bandwidth_floor_tok_s": floor * c}
                for c in (1, 2, 4, 8, 16)
            ])
    with pytest.raises(RuntimeError), store.start_run("chunk-sizing", {"chunk_size": 99},
                                                      hardware={"hardware_id": "gpu:Fake-GPU"}) as run:
        run.write_rows("summary", [{"ttft_s_max": 1e9}])
        raise RuntimeError("synthetic crash")
    return store


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    write_synthetic_runs(root)
    out = root / "dashboards"
    pages = build_dashboards(root, out, reference=REFERENCE)
    return root, pages


@pytest.fixture(scope="module")
def built_empty(tmp_path_factory):
    root = tmp_path_factory.mktemp("empty")
    return build_dashboards(root, root / "dashboards", reference=REFERENCE)


def test_pages_per_ablation_and_self_contained(built):
    root, pages = built
    assert [p.name for p in pages] == ["overview.html", "chunk-sizing.html", "decode-batching.html"]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "<script src" not in text and "cdn.jsdelivr" not in text
        assert "window.vegaEmbed=" in text  # the bundle is inlined
    # the failed run's absurd TTFT never reaches a chart
    assert "1000000000" not in (pages[1]).read_text(encoding="utf-8")


def test_empty_store_shows_reference_and_note(built_empty):
    assert [p.name for p in built_empty] == ["overview.html"]
    text = built_empty[0].read_text(encoding="utf-8")
    assert "No runs recorded" in text
    assert "Reference: decode throughput" in text


def test_missing_reference_is_noted(tmp_path):
    [page] = build_dashboards(tmp_path, tmp_path / "out")
    assert "No reference table at" in page.read_text(encoding="utf-8")


# ---- in the browser ---------------------------------------------------------------------

_COUNT_MARKS = """
async () => {
  const d = window.workbenchDashboard;
  await d.ready;
  const count = (node) => {
    let n = 0;
    if (node.marktype && node.marktype !== "group" && node.role === "mark") n += node.items.length;
    for (const item of node.items || []) if (item.items) n += count(item);
    return n;
  };
  const charts = {};
  for (const div of document.querySelectorAll("div.chart")) {
    const view = d.views[div.id];
    charts[div.id] = {
      scenegraph: view ? count(view.scenegraph().root) : -1,
      svg: div.querySelectorAll("svg g.role-mark > *").length,
    };
  }
  return { errors: d.errors, charts: charts };
}
"""


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def _open_and_check(context, page_path: Path, shot_name: str) -> dict:
    page = context.new_page()
    console_errors, fetched = [], []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))

    def guard(route):
        if route.request.url.startswith(("file:", "data:", "blob:")):
            route.continue_()
        else:
            fetched.append(route.request.url)
            route.abort()

    page.route("**/*", guard)
    try:
        page.goto(page_path.as_uri())
        result = page.evaluate(_COUNT_MARKS)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / shot_name), full_page=True)
    finally:
        page.close()
    assert result["errors"] == [], result["errors"]
    assert console_errors == []
    assert fetched == []
    assert result["charts"], f"{page_path.name} has no charts"
    for chart_id, counts in result["charts"].items():
        assert counts["scenegraph"] > 0, f"{page_path.name} {chart_id}: no mark items in the Vega scenegraph"
        assert counts["svg"] > 0, f"{page_path.name} {chart_id}: no mark elements in the SVG"
    return result


def test_pages_render_in_chromium(built, browser_context):
    _, pages = built
    expected_charts = {"overview.html": 5, "chunk-sizing.html": 4, "decode-batching.html": 3}
    for path in pages:
        result = _open_and_check(browser_context, path, f"dashboard-{path.stem}.png")
        assert len(result["charts"]) == expected_charts[path.name], (path.name, result["charts"])
        shot = (ARTIFACTS / f"dashboard-{path.stem}.png").read_bytes()
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000


def test_empty_store_page_renders_in_chromium(built_empty, browser_context):
    result = _open_and_check(browser_context, built_empty[0], "dashboard-empty-overview.png")
    assert len(result["charts"]) == 2  # the two reference views


def test_reference_table_is_tidy():
    ref = pl.read_parquet(REFERENCE)
    assert set(ref["stat"].unique()) <= {"value", "min", "max"}
    ranges = ref.filter(pl.col("stat") != "value").group_by(
        "source", "configuration", "concurrency", "metric").agg(pl.col("stat").sort())
    assert all(stats.to_list() == ["max", "min"] for stats in ranges["stat"])
