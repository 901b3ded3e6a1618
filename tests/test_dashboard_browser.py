"""Dashboards: built from a synthetic run store, checked as specs, then opened in headless Chromium.

The synthetic store holds the cases that made the old pages mislead: a smoke bench at one
concurrency run after the full sweeps, runs of one ablation with different parameters, a quick
run beside full ones, older runs of the same group, a failed run. The tests assert that each
chart draws one run per machine from one group, that titles are words, that subtitles name the
selection, and (in the browser) that every page renders its charts with no console errors and
that the index's links resolve. Screenshots land in test-artifacts/ (gitignored).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path

import polars as pl
import pytest

from browser import ARTIFACTS, chromium
from workbench import dashboard
from workbench.cli import main as cli_main
from workbench.dashboard import build_dashboards, group_runs, load_pages, measurement_params, run_table
from workbench.errors import WorkbenchError
from workbench.runstore import RunStore

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "data" / "reference" / "seeds.parquet"
LLAMACPP = REPO / "data" / "reference" / "llamacpp_cpu.parquet"
# Fake measurements on the ids of the project's machines, so that their reference figures attach.
CPU, GPU = "cpu:AMD-EPYC:2c", "gpu:NVIDIA-H200"
SPEED = {CPU: 1.0, GPU: 40.0}
SHA = "ab" * 32
BENCH = {"model": "m.gguf", "model_sha256": SHA, "backend": "torch", "prompt_len": 128, "gen": 32, "repeats": 2}
CHUNK = {"model": None, "concurrency": 4, "prompt_lens": [256, 1024], "chunk_sizes": [32, 128, "auto"],
         "chunk_cap": 4096, "gen_tokens": 16, "decode_prompt_len": 16, "repeats": 2, "seed": 0}


def _bench_run(store, hw, params, concurrencies, level):
    with store.start_run("bench", params, hardware={"hardware_id": hw}) as run:
        run.write_rows("summary", [
            {"concurrency": c, "repeat": r, "decode_tok_s_aggregate": level * SPEED[hw] * c ** 0.8 * (1 + 0.02 * r),
             "fraction_of_floor": 0.3 / c ** 0.2, "ttft_s_max": 0.1 * c / SPEED[hw]}
            for c in concurrencies for r in range(2)
        ])
    return run.run_id


def _chunk_run(store, hw, params, *, quick=False):
    with store.start_run("chunk-sizing", params, hardware={"hardware_id": hw}, quick=quick) as run:
        rows = []
        for prompt_len in params["prompt_lens"]:
            for setting in params["chunk_sizes"]:
                chunk = params["chunk_cap"] if setting == "auto" else setting
                for r in range(params["repeats"]):
                    rows.append({"prompt_len": prompt_len, "chunk_setting": str(setting), "chunk_size": chunk,
                                 "repeat": r, "ttft_s": prompt_len / chunk / SPEED[hw] + 0.01 * r,
                                 "itl_s_max": min(chunk, prompt_len) / 4096 / SPEED[hw],
                                 "itl_s_p99": min(chunk, prompt_len) / 8192 / SPEED[hw],
                                 "decode_tok_s_aggregate": 25 * SPEED[hw] * params["concurrency"],
                                 "peak_memory_bytes": int((1 + chunk / 1024) * 2**30)})
        run.write_rows("summary", rows)
    return run.run_id


def write_synthetic_runs(root: Path) -> dict[str, str]:
    """The runs of the module docstring; returns their ids by role."""
    store = RunStore(root)
    ids = {
        "gpu_old": _bench_run(store, GPU, BENCH | {"device_run": "run1"}, [1, 2, 4, 8], 0.5),
        "cpu_full": _bench_run(store, CPU, BENCH, [1, 2, 4, 8], 1.0),
        "gpu_full": _bench_run(store, GPU, BENCH | {"model": "renamed.gguf", "device_run": "run2"}, [1, 2, 4, 8], 1.0),
        "gpu_smoke": _bench_run(store, GPU, BENCH, [1], 3.0),
        "cpu_long": _bench_run(store, CPU, BENCH | {"prompt_len": 512}, [1, 2, 4], 0.7),
        "chunk_cpu": _chunk_run(store, CPU, CHUNK),
        "chunk_gpu": _chunk_run(store, GPU, CHUNK),
        "chunk_other": _chunk_run(store, CPU, CHUNK | {"concurrency": 2}),
        "chunk_quick": _chunk_run(store, CPU, CHUNK | {"concurrency": 2, "prompt_lens": [64], "repeats": 1},
                                  quick=True),
    }
    with store.start_run("decode-batching", {"model": "synthetic"}, hardware={"hardware_id": CPU}) as run:
        run.write_rows("summary", [{"concurrency": c, "decode_tok_s_aggregate": 10.0 * c} for c in (1, 2)])
    with pytest.raises(RuntimeError), store.start_run("chunk-sizing", CHUNK, hardware={"hardware_id": GPU}) as run:
        run.write_rows("summary", [{"ttft_s": 1e9, "chunk_size": 99, "prompt_len": 256}])
        raise RuntimeError("synthetic crash")
    ids["failed"] = run.run_id
    return ids


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    ids = write_synthetic_runs(root)
    pages = build_dashboards(root, root / "out", reference=REFERENCE, llamacpp=LLAMACPP)
    return root, ids, {p.name: p for p in pages}


@pytest.fixture(scope="module")
def built_empty(tmp_path_factory):
    root = tmp_path_factory.mktemp("empty")
    return build_dashboards(root, root / "out", reference=REFERENCE, llamacpp=LLAMACPP)


def specs_of(page: Path) -> dict:
    """The Vega-Lite specs a built page embeds, by chart id."""
    found = re.search(r"const specs = (\{.*\});\n  const state", page.read_text(encoding="utf-8"), re.S)
    return json.loads(found.group(1))


def line_runs(spec: dict) -> list[dict[str, set[str]]]:
    """For every dataset a metric panel draws its lines from: machine -> the runs in it."""
    out = []
    for values in spec.get("datasets", {}).values():
        if values and "median" in values[0] and "run_number" not in values[0]:
            per: dict[str, set[str]] = {}
            for v in values:
                per.setdefault(v["hardware_id"], set()).add(v["run_id"])
            out.append(per)
    return out


def titles(node) -> list[str]:
    """Every axis, legend, encoding and chart title in a spec (subtitles and tooltips left out)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "tooltip":
                continue
            if key == "title":
                if isinstance(value, dict):
                    value = value.get("text")
                found += [value] if isinstance(value, str) else list(value or [])
            else:
                found += titles(value)
    elif isinstance(node, list):
        for item in node:
            found += titles(item)
    return found


# ---- groups ---------------------------------------------------------------------------------


def test_measurement_params_leave_out_how_often_and_where():
    page = load_pages().ablation("bench")
    a = measurement_params(BENCH | {"device_run": "run1"}, page, "[1, 2, 4, 8]")
    b = measurement_params(BENCH | {"model": "renamed.gguf", "repeats": 5}, page, "[1, 2, 4, 8]")
    assert a == b and "repeats" not in a and "device_run" not in a and "model" not in a  # the sha names it
    assert a["concurrency"] == "[1, 2, 4, 8]"
    # a manifest that records its sweep keys the same as one whose sweep is read from its rows
    assert measurement_params(BENCH | {"concurrency": [1, 2, 4, 8]}, page, None) == a
    assert measurement_params(BENCH, page, "[1]") != a
    assert measurement_params(BENCH | {"prompt_len": 512}, page, "[1, 2, 4, 8]") != a


def test_a_manifest_without_the_quick_flag_reads_as_full(tmp_path):
    store = RunStore(tmp_path)
    old = _bench_run(store, CPU, BENCH, [1, 2], 1.0)
    path = store.runs_dir / old / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "quick"}))
    quick = _chunk_run(store, CPU, CHUNK | {"repeats": 1}, quick=True)
    runs, _ = run_table(store)
    assert dict(runs.select("run_id", "quick").iter_rows()) == {old: False, quick: True}


def test_groups_split_by_params_sweep_and_quick(built):
    root, ids, _ = built
    spec = load_pages()
    runs, params = run_table(RunStore(root))
    summary = RunStore(root).load("summary")
    sweeps = dashboard.measured_sweeps(summary, "concurrency")
    bench = group_runs(runs, params, "bench", spec.ablation("bench"), quick=False, sweeps=sweeps)
    members = [set(g.runs["run_id"]) for g in bench]
    assert members[0] == {ids["gpu_old"], ids["cpu_full"], ids["gpu_full"]}
    assert {ids["gpu_smoke"]} in members and {ids["cpu_long"]} in members and len(bench) == 3
    latest = dict(bench[0].latest.select("hardware_id", "run_id").iter_rows())
    assert latest == {CPU: ids["cpu_full"], GPU: ids["gpu_full"]}  # not the smoke run that came later

    page = spec.ablation("chunk-sizing")
    full = group_runs(runs, params, "chunk-sizing", page, quick=False)
    assert [set(g.runs["run_id"]) for g in full] == [{ids["chunk_cpu"], ids["chunk_gpu"]}, {ids["chunk_other"]}]
    quick = group_runs(runs, params, "chunk-sizing", page, quick=True)
    assert [set(g.runs["run_id"]) for g in quick] == [{ids["chunk_quick"]}]
    assert ids["failed"] not in set(runs.filter(pl.col("status") == "complete")["run_id"])


# ---- built pages ----------------------------------------------------------------------------


def test_pages_and_index(built):
    _, _, pages = built
    assert list(pages) == ["index.html", "overview.html", "reference.html", "bench.html", "chunk-sizing.html",
                           "chunk-sizing-quick.html", "decode-batching.html"]
    index = pages["index.html"].read_text(encoding="utf-8")
    links = re.findall(r'<li><a href="([^"]+)"', index)
    assert sorted(links) == sorted(set(pages) - {"index.html"})
    assert "10 complete run(s) of 11 recorded (1 quick)" in index  # the failed run counted, not drawn
    for page in pages.values():
        text = page.read_text(encoding="utf-8")
        assert "<script src" not in text and "cdn.jsdelivr" not in text
        assert "window.vegaEmbed=" in text  # the bundle is inlined
        assert '<a href="index.html"' in text
        for note in re.findall(r'<p class="(?:note|about)">(.*?)</p>', text, re.S):
            assert not re.search(r"\{\w+\}", note), (page.name, note)  # no unformatted placeholder
    assert "No page definition for the ablation 'decode-batching'" in html.unescape(
        pages["decode-batching.html"].read_text(encoding="utf-8"))


def test_each_line_is_one_run_per_machine_of_one_group(built):
    _, ids, pages = built
    bench = specs_of(pages["bench.html"])
    drawn = [per for spec in bench.values() for per in line_runs(spec)]
    assert drawn, "no metric panel found"
    assert all(len(runs) == 1 for per in drawn for runs in per.values())
    everything = set().union(*(r for per in drawn for r in per.values()))
    assert ids["gpu_old"] not in everything and ids["gpu_smoke"] not in everything
    assert {ids["cpu_full"], ids["gpu_full"], ids["cpu_long"]} <= everything
    # the older GPU run of the group is in the run-by-run chart
    history = [v for spec in bench.values() for d in spec.get("datasets", {}).values() for v in d
               if "run_number" in v]
    assert {v["run_id"] for v in history} == {ids["gpu_old"], ids["cpu_full"], ids["gpu_full"]}
    chunk = specs_of(pages["chunk-sizing.html"])
    for spec in chunk.values():
        for per in line_runs(spec):
            assert all(len(runs) == 1 for runs in per.values())
    text = json.dumps(chunk)
    assert ids["chunk_quick"] not in text, text[text.find(ids["chunk_quick"]) - 400:][:600]
    assert ids["failed"] not in text and "1000000000.0" not in text  # quick and failed runs stay out


def test_single_x_group_is_a_table_and_quick_runs_are_apart(built):
    _, ids, pages = built
    bench = pages["bench.html"].read_text(encoding="utf-8")
    assert "measured a single value of concurrent sequences (1): a table, not a chart" in bench
    chunk = pages["chunk-sizing.html"].read_text(encoding="utf-8")
    assert "1 quick run(s) are on chunk-sizing-quick.html" in chunk
    quick = json.dumps(specs_of(pages["chunk-sizing-quick.html"]))
    assert ids["chunk_quick"] in quick and ids["chunk_cpu"] not in quick and "quick runs (--quick)" in quick


def test_titles_are_words_and_subtitles_name_the_selection(built):
    root, ids, pages = built
    columns = set(RunStore(root).load("summary").columns)
    for page in pages.values():
        for chart_id, spec in specs_of(page).items():
            for title in titles(spec):
                assert title not in columns and "_" not in title, (page.name, chart_id, title)
    bench = specs_of(pages["bench.html"])
    first = next(s for s in bench.values() if line_runs(s))
    subtitle = " ".join(first["title"]["subtitle"])
    assert "bench group A: full runs" in subtitle and "prompt_len=128" in subtitle
    assert "concurrency=[1, 2, 4, 8]" in subtitle and f"{GPU} {ids['gpu_full']} (latest of 2)" in subtitle
    axis_titles = set(titles(first))
    assert {"Decode throughput, aggregate (tokens/s)", "Concurrent sequences"} <= axis_titles


def test_overview_panels_come_from_one_group_where_one_spans_the_machines(built):
    _, ids, pages = built
    overview = specs_of(pages["overview.html"])
    drawn = [per for spec in overview.values() for per in line_runs(spec)]
    assert drawn and all(per in ({CPU: {ids["cpu_full"]}}, {GPU: {ids["gpu_full"]}}) for per in drawn)


def test_reference_figures_beside_ours(built):
    _, _, pages = built
    bench = json.dumps(specs_of(pages["bench.html"]))
    assert '"issue-3"' in bench and "llamacpp_cpu.parquet" in bench  # same-machine baselines, GPU and CPU
    overview = json.dumps(specs_of(pages["overview.html"]))
    assert "The seeds' published figures" in overview and "000_f88e6dcca7da7c79.txt" in overview
    assert "Reference figures (source and machine in the tooltip)" in overview


def test_notebook_charts_of_one_run(built):
    root, ids, _ = built
    rows = RunStore(root).load("summary", run_id=ids["chunk_cpu"])
    charts = dashboard.ablation_charts("chunk-sizing", rows)
    assert [len(c.to_dict()["hconcat"]) for c in charts] == [2] * 5  # five metrics, two prompt lengths each
    assert "chunk-sizing group A: full runs" in " ".join(charts[0].to_dict()["title"]["subtitle"])
    # what ablations.chunk_sizing_charts calls: a view per metric whose columns the rows hold
    views = dashboard.ABLATION_VIEWS["chunk-sizing"]
    assert [cols for _, cols, _ in views][0] == ("chunk_size", "ttft_s")
    assert all(view(rows).to_dict()["hconcat"] for _, _, view in views)


def test_empty_store_shows_reference_and_note(built_empty):
    assert [p.name for p in built_empty] == ["index.html", "overview.html", "reference.html"]
    assert "No runs recorded" in built_empty[1].read_text(encoding="utf-8")
    assert specs_of(built_empty[2])  # the reference figures still draw


def test_missing_reference_is_noted(tmp_path):
    pages = build_dashboards(tmp_path, tmp_path / "out")
    assert "No reference table at" in pages[2].read_text(encoding="utf-8")


@pytest.mark.parametrize("text, named", [
    ('[columns]\nx = { label = "X", unti = "s" }\n', "unknown key(s) unti"),
    ('[[ablation]]\nname = "a"\npage = "a.html"\ntitle = "A"\nabout = "."\nx = "x"\nmetrics = ["y"]\n',
     "no [columns] entry for x, y"),
    ('[[ablation]]\nname = "a"\npage = "a.html"\n', "missing key(s) title, about, x, metrics"),
    ("[columns\n", "is not valid TOML"),
])
def test_bad_page_definitions_are_one_line(tmp_path, text, named):
    path = tmp_path / "pages.toml"
    path.write_text(text)
    with pytest.raises(WorkbenchError, match=re.escape(named)):
        load_pages(path)


def test_cli_prints_the_index_url(built, tmp_path, capsys):
    root, _, _ = built
    assert cli_main(["dashboard", "--data-dir", str(root), "--out", str(tmp_path / "o")]) == 0
    assert f"open file://{(tmp_path / 'o' / 'index.html').resolve()}" in capsys.readouterr().out
    assert cli_main(["dashboard", "--data-dir", str(root), "--pages", str(tmp_path / "none.toml")]) == 2
    assert "cannot read the page definitions" in capsys.readouterr().err


def test_built_pages_are_ignored_by_git():
    try:
        done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q",
                               str(dashboard.DEFAULT_OUT_DIR / "index.html")], check=False)
    except OSError:
        pytest.skip("git is not installed")
    assert done.returncode == 0, f"{dashboard.DEFAULT_OUT_DIR}/ is not ignored by git"


def test_reference_table_is_tidy():
    ref = pl.read_parquet(REFERENCE)
    assert set(ref["stat"].unique()) <= {"value", "min", "max"}
    ranges = ref.filter(pl.col("stat") != "value").group_by(
        "source", "configuration", "concurrency", "metric").agg(pl.col("stat").sort())
    assert all(stats.to_list() == ["max", "min"] for stats in ranges["stat"])


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
    with chromium(tmp_path_factory.mktemp("chromium-profile"), width=1400) as context:
        yield context


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
        result["links"] = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / shot_name), full_page=True)
    finally:
        page.close()
    assert result["errors"] == [], result["errors"]
    assert console_errors == []
    assert fetched == []
    for chart_id, counts in result["charts"].items():
        assert counts["scenegraph"] > 0, f"{page_path.name} {chart_id}: no mark items in the Vega scenegraph"
        assert counts["svg"] > 0, f"{page_path.name} {chart_id}: no mark elements in the SVG"
    return result


def test_pages_render_in_chromium(built, browser_context):
    _, _, pages = built
    for name, path in pages.items():
        result = _open_and_check(browser_context, path, f"dashboard-{path.stem}.png")
        assert len(result["charts"]) == len(specs_of(path)), name
        if name not in ("index.html", "decode-batching.html"):
            assert result["charts"], f"{name} has no charts"
        shot = (ARTIFACTS / f"dashboard-{path.stem}.png").read_bytes()
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000


def test_index_links_resolve_in_chromium(built, browser_context):
    _, _, pages = built
    result = _open_and_check(browser_context, pages["index.html"], "dashboard-index.png")
    targets = {link for link in result["links"] if link.startswith("file:")}
    assert len(targets) == len(pages)  # the index itself (navigation) and every other page
    page = browser_context.new_page()
    try:
        for link in sorted(targets):
            page.goto(link)
            assert page.title(), f"{link} did not load"
            assert page.evaluate("() => window.workbenchDashboard.ready.then(() => true)")
    finally:
        page.close()


def test_empty_store_page_renders_in_chromium(built_empty, browser_context):
    result = _open_and_check(browser_context, built_empty[2], "dashboard-empty-reference.png")
    assert len(result["charts"]) == 2  # every decode figure, the other published figures


def test_a_parameter_added_later_does_not_split_old_runs_off():
    """bench's paging options came after many recorded runs: a manifest without them is keyed as
    if it had their defaults (pages.toml param_defaults), a run with another value is apart."""
    page = next(p for p in load_pages().ablations if p.name == "bench")
    old = {"backend": "torch", "prompt_len": 512, "gen": 128, "concurrency": [1, 2]}
    new = {**old, "prefix_cache": True, "shared_prefix_len": 0, "kv_resident_tokens": "auto",
           "head_matmul": "default", "triton_options": "default"}
    assert measurement_params(old, page) == measurement_params(new, page)
    assert measurement_params({**new, "shared_prefix_len": 2048}, page) != measurement_params(old, page)
