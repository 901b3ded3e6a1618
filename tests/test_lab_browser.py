"""The explorer in a real JupyterLab: `workbench lab` serves a copy of notebooks/ on loopback,
headless Chromium opens explore.ipynb, runs all its cells through the kernel, types a model
path into the explorer and presses Run; the engine's status line and charts must appear, drawn
from this machine alone. Ctrl-C (SIGINT to the server's PID) must stop it, kernels and all.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from browser import ARTIFACTS, chromium, require_chromium

REPO = Path(__file__).resolve().parents[1]
TOKEN = "workbench-lab-test-token"
START_TIMEOUT_S = 60
# Without a display this settings file keeps the "get Jupyter news?" toast off the screenshot.
NO_NEWS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
           {"fetchNews": "false", "checkForUpdates": False}}


class Lab:
    """`workbench lab` as a subprocess, its output collected by a thread."""

    def __init__(self, root: Path, scratch: Path):
        dirs = {name: scratch / name for name in ("home", "config", "data", "runtime", "ipython", "settings",
                                                  "workspaces")}
        for d in dirs.values():
            d.mkdir(parents=True)
        for name, settings in NO_NEWS.items():
            (dirs["settings"] / name).parent.mkdir(parents=True, exist_ok=True)
            (dirs["settings"] / name).write_text(json.dumps(settings))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "IPYTHON"))}
        env.update(HOME=str(dirs["home"]), JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
                   JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), IPYTHONDIR=str(dirs["ipython"]),
                   JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]), JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]),
                   JUPYTER_PREFER_ENV_PATH="1", JUPYTER_TOKEN=TOKEN)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workbench", "lab", "explore.ipynb", "--notebook-dir", str(root), "--port", "0",
             "--no-browser"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=scratch,
        )
        self.lines: list[str] = []
        self._urls: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if m := re.search(r"https?://\S+", line):
                self._urls.put(m.group(0))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def url(self) -> str:
        """The URL it prints once it listens; then its REST API answers with the token."""
        try:
            url = self._urls.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"workbench lab printed no URL in {START_TIMEOUT_S} s:\n{self.output}") from None
        base = url.split("/lab", 1)[0]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                req = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {TOKEN}"})
                with urllib.request.urlopen(req, timeout=5) as resp:
                    assert "started" in json.load(resp)
                return url
            except (urllib.error.URLError, ConnectionError):
                assert self.proc.poll() is None, f"workbench lab exited ({self.proc.returncode}):\n{self.output}"
                assert time.monotonic() < deadline, f"no answer from {base}/api/status:\n{self.output}"
                time.sleep(0.2)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        """Signal the server's PID; kill it if it has not exited within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def lab(tmp_path):
    require_chromium()  # before starting a server that nothing could open
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    root = tmp_path / "notebooks"  # a copy: Lab's checkpoints and edits stay out of the repo
    shutil.copytree(REPO / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    server = Lab(root, tmp_path / "lab")
    try:
        yield server
    finally:
        server.stop(signal.SIGTERM)


# Per Vega view in the explorer's output: its titles, and its mark items per mark type.
VEGA_MARKS = """() => [...document.querySelectorAll(".widget-output .jp-RenderedVega5")]
  .map(view => {
    const marks = {};
    for (const g of view.querySelectorAll("svg g.role-mark")) {
      const type = [...g.classList].find(c => c.startsWith("mark-")).slice(5);
      marks[type] = (marks[type] || 0) + g.querySelectorAll(":scope > path, :scope > g").length;
    }
    return {titles: [...view.querySelectorAll("svg g.role-title text")].map(t => t.textContent), marks};
  })"""


def _vega_marks(page) -> list[dict]:
    return page.evaluate(VEGA_MARKS)


def _run_explorer(page, url: str, model: Path) -> tuple[int, list[dict]]:
    """Open the notebook, Run All Cells, fill in the model, press Run: (steps run, charts drawn)."""
    page.goto(url)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=60_000)
    # Lab starts the notebook's kernel (python3) by itself once it has the server's kernel
    # list; a notebook opened before that asks, with python3 preselected: accept it.
    idle = page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"^Python 3 \(ipykernel\) \| Idle$"))
    ask = page.locator(".jp-Dialog", has_text="Select Kernel")
    idle.or_(ask).first.wait_for(timeout=60_000)
    if ask.is_visible():
        assert ask.locator("select").input_value() == "python3"
        ask.locator("button.jp-mod-accept").click()
        idle.wait_for(timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

    # the kernel ran both code cells, and the second one displayed the explorer
    explorer = page.locator(".jp-OutputArea-output .widget-vbox").first
    explorer.wait_for(timeout=90_000)
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
    assert [p.strip() for p in prompts] == ["[1]:", "[2]:"], prompts
    assert explorer.locator(".widget-slider").count() == 4  # concurrency, chunk cap, prompt len, gen tokens
    button = explorer.locator("button.widget-button", has_text="Run")
    status = explorer.locator(".widget-label").last
    assert button.is_enabled() and status.inner_text().strip() == ""
    assert _vega_marks(page) == []  # no chart before a run

    explorer.locator(".widget-text input").fill(str(model))
    button.click()
    page.wait_for_function("el => /steps|error/.test(el.textContent)", arg=status.element_handle(),
                           timeout=90_000)
    text = status.inner_text().strip()
    m = re.fullmatch(r"(\d+) steps, 64 tokens", text)  # 4 requests x 16 tokens: the notebook's defaults
    assert m, text
    page.wait_for_function(f"() => ({VEGA_MARKS})().filter(v => Object.keys(v.marks).length).length == 2",
                           timeout=30_000)
    assert button.is_enabled()
    return int(m.group(1)), _vega_marks(page)


def test_explorer_runs_in_jupyterlab(lab, tiny_gguf, tmp_path):
    model = tiny_gguf("llama")
    with chromium(tmp_path / "chromium-profile") as context:
        url = lab.url()
        origin = url.split("/lab", 1)[0]
        page = context.new_page()
        console_errors, outside = [], []
        page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: console_errors.append(str(exc)))

        def loopback_only(route):
            if route.request.url.startswith((origin, "data:", "blob:")):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        page.route("**/*", loopback_only)
        ARTIFACTS.mkdir(exist_ok=True)
        try:
            num_steps, views = _run_explorer(page, url, model)
        finally:
            page.screenshot(path=str(ARTIFACTS / "lab-explorer.png"))
        kernels = psutil.Process(lab.proc.pid).children(recursive=True)

    assert len(views) == 2, views
    steps_view, requests_view = views
    assert steps_view["titles"] == ["Rows per step", "Wall time per step"], steps_view
    # a bar per step and kind (decode, prefill), a point per step on the wall-time line
    assert steps_view["marks"]["rect"] == 2 * num_steps, steps_view
    assert steps_view["marks"]["symbol"] == num_steps, steps_view
    assert requests_view["titles"] == ["Time to first token", "Decode rate"], requests_view
    assert requests_view["marks"]["rect"] == 2 * 4, requests_view  # a bar per request, twice
    assert outside == [], f"the page fetched from outside this machine: {outside}"
    assert console_errors == [], console_errors

    assert kernels, "no kernel runs under the server"
    assert lab.stop(signal.SIGINT) == 0, lab.output  # Ctrl-C
    assert "JupyterLab stopped." in lab.output and "Traceback" not in lab.output, lab.output
    _, alive = psutil.wait_procs(kernels, timeout=10)
    assert alive == [], f"kernels left running: {alive}"


# ---- the command's bad input, without a server ----------------------------------------------


def test_lab_rejects_a_missing_notebook(tmp_path, capsys):
    from workbench.cli import main

    (tmp_path / "a.ipynb").write_text("{}")
    assert main(["lab", "nope.ipynb", "--notebook-dir", str(tmp_path), "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"workbench: error: no notebook 'nope.ipynb' in {tmp_path}; notebooks there: a.ipynb", err


def test_lab_rejects_a_missing_folder_and_a_bad_port(tmp_path, capsys):
    from workbench.cli import main

    assert main(["lab", "--notebook-dir", str(tmp_path / "absent")]) == 2
    assert "notebook folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["lab", "--port", "70000"])
    assert exit_.value.code == 2
    assert "70000 is out of range: allowed an integer 0..65535" in capsys.readouterr().err


def test_lab_config_keeps_the_notebook_inside_its_folder(tmp_path):
    from workbench.errors import WorkbenchError
    from workbench.lab import LabConfig

    with pytest.raises(WorkbenchError, match="inside the notebook folder"):
        LabConfig(root_dir=tmp_path, notebook="../secrets.ipynb")
