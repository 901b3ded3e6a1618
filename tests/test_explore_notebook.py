"""The explorer notebook runs headless (interactive=False) through papermill on a tiny GGUF,
and the widget's Run button drives the engine and redraws the charts."""

from __future__ import annotations

import re

import nbformat
import papermill

from workbench import ablations, explore

NOTEBOOK = ablations.NOTEBOOK_DIR / "explore.ipynb"
TINY = dict(concurrency=2, chunk_cap=16, prompt_len=24, gen_tokens=3)


def test_explore_notebook_headless(tiny_gguf, tmp_path):
    out = tmp_path / "explore.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK), str(out), parameters={"interactive": False, "model": str(tiny_gguf("llama")), **TINY},
        kernel_name=ablations.KERNEL_NAME, language="python", progress_bar=False,
        kernel_manager_class=ablations.this_python_kernel_manager(), execution_timeout=120,
    )
    outputs = [o for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    charts = [o for o in outputs if o.output_type == "display_data"]
    assert len(charts) == 2  # steps chart, requests chart
    # compiled Vega, which JupyterLab draws itself (no script from a CDN)
    assert all(o.data[explore.VEGA_MIME]["marks"] for o in charts), [list(o.data) for o in charts]


def test_explorer_run_button_runs_the_engine(tiny_gguf):
    box = explore.explorer(model=str(tiny_gguf("llama")), **TINY)
    button, status = box.children[3].children
    button.click()
    assert re.fullmatch(r"\d+ steps, 6 tokens", status.value), status.value  # 2 requests x 3 tokens
    assert not button.disabled
