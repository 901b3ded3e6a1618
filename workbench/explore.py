"""The interactive explorer behind notebooks/explore.ipynb: run one engine configuration,
chart its per-step and per-request telemetry, and wire both to ipywidgets controls.

    steps, requests = run_config(model, concurrency=4, chunk_cap=256, prompt_len=128, gen_tokens=16)
    show(steps_chart(steps)); show(requests_chart(requests))   # Altair charts, displayed
    explorer()                                                  # sliders, a Run button, the charts

Charts are displayed as Vega, which JupyterLab draws with the renderer it ships: no script
from the network, and they draw in untrusted (reopened) notebooks too.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import polars as pl

from workbench.ablations import prompt_ids

WIDTH = 520
CHUNK_CAPS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def load(path: str | None, dtype: str = "bfloat16"):
    """A model by GGUF path; None or "" is the embedded Gemma 3 270M."""
    from workbench.model import load_model

    return load_model(path or None, dtype=dtype)


def run_config(model, *, concurrency: int, chunk_cap: int, prompt_len: int, gen_tokens: int,
               seed: int = 0) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`concurrency` prompts of `prompt_len` tokens arrive together; chunk sizes auto, capped at
    `chunk_cap`. Returns the engine's (steps, requests) telemetry frames."""
    from workbench.engine import Engine
    from workbench.engine_config import EngineConfig

    engine = Engine(model, EngineConfig(max_concurrency=concurrency, chunk_cap=chunk_cap, dtype=model.dtype_name))
    prompts = [prompt_ids(model, prompt_len, f"{seed}-explore-{i}") for i in range(concurrency)]
    engine.generate(prompts, max_tokens=gen_tokens, ignore_eos=True)
    return engine.telemetry.steps(), engine.telemetry.requests()


# JupyterLab 4 draws Vega 5 and Vega-Lite 3-5 with the renderer it ships; Altair 6 writes
# Vega-Lite 6, which only Altair's HTML output draws, loading vega from a CDN at view time
# (nothing shows offline, nor in an untrusted notebook). So the chart goes to Lab as Vega,
# compiled by Altair itself (vl-convert); Lab's Vega 5 draws these specs, as
# tests/test_lab_browser.py checks mark by mark.
VEGA_MIME = "application/vnd.vega.v5+json"
VEGA_SCHEMA = "https://vega.github.io/schema/vega/v5.json"


def vega_bundle(chart: alt.TopLevelMixin) -> dict[str, Any]:
    """The chart as a display bundle: compiled Vega for JupyterLab, and a plain-text stand-in."""
    spec = chart.to_dict(format="vega")
    spec["$schema"] = VEGA_SCHEMA  # the version Lab's renderer checks it against
    return {VEGA_MIME: spec, "text/plain": f"<Altair {type(chart).__name__}>"}


def show(chart: alt.TopLevelMixin) -> None:
    """Display an Altair chart in the notebook (see VEGA_MIME), drawn as SVG."""
    from IPython.display import display

    display(vega_bundle(chart), raw=True, metadata={VEGA_MIME: {"embed_options": {"renderer": "svg"}}})


def steps_chart(steps: pl.DataFrame) -> alt.VConcatChart:
    """Rows per step (decode and prefill, stacked) above the step's wall time."""
    rows = steps.select("step", "decode_rows", "prefill_rows").unpivot(
        index="step", variable_name="kind", value_name="rows"
    ).with_columns(pl.col("kind").str.replace("_rows", ""))
    x = alt.X("step:O", title="engine step")
    bars = alt.Chart(alt.Data(values=rows.to_dicts()), title="Rows per step").mark_bar().encode(
        x=x, y=alt.Y("rows:Q", title="rows", stack=True), color=alt.Color("kind:N", title=None),
        tooltip=["step:O", "kind:N", "rows:Q"],
    ).properties(width=WIDTH, height=160)
    wall = alt.Chart(alt.Data(values=steps.select("step", "phase", "wall_ms", "chunk_size").to_dicts()),
                     title="Wall time per step").mark_line(point=True).encode(
        x=x, y=alt.Y("wall_ms:Q", title="wall (ms)"),
        tooltip=["step:O", "phase:N", alt.Tooltip("wall_ms:Q", format=".1f"), "chunk_size:Q"],
    ).properties(width=WIDTH, height=160)
    return alt.vconcat(bars, wall)


def requests_chart(requests: pl.DataFrame) -> alt.HConcatChart:
    """Per request: time to first token and decode tok/s."""
    data = alt.Data(values=requests.select("request_id", "prompt_tokens", "ttft_s", "decode_tok_s").to_dicts())
    y = alt.Y("request_id:N", title=None, sort=None)
    tooltip = ["request_id:N", "prompt_tokens:Q", alt.Tooltip("ttft_s:Q", format=".3f"),
               alt.Tooltip("decode_tok_s:Q", format=".1f")]
    ttft = alt.Chart(data, title="Time to first token").mark_bar().encode(
        x=alt.X("ttft_s:Q", title="TTFT (s)"), y=y, tooltip=tooltip).properties(width=WIDTH // 2)
    decode = alt.Chart(data, title="Decode rate").mark_bar(color="#59a14f").encode(
        x=alt.X("decode_tok_s:Q", title="decode tok/s"), y=y, tooltip=tooltip).properties(width=WIDTH // 2)
    return alt.hconcat(ttft, decode)


def explorer(*, model: str | None = None, concurrency: int = 4, chunk_cap: int = 256, prompt_len: int = 128,
             gen_tokens: int = 16) -> Any:
    """Controls (concurrency, chunk cap, prompt length, tokens, model path), a Run button, and
    the two charts, redrawn after each run. Models are loaded once per path."""
    import ipywidgets as w

    models: dict[str, Any] = {}
    conc = w.IntSlider(value=concurrency, min=1, max=16, description="concurrency")
    cap = w.SelectionSlider(options=CHUNK_CAPS, value=min(CHUNK_CAPS, key=lambda c: abs(c - chunk_cap)),
                            description="chunk cap")
    plen = w.IntSlider(value=prompt_len, min=8, max=2048, step=8, description="prompt len")
    gen = w.IntSlider(value=gen_tokens, min=1, max=128, description="gen tokens")
    path = w.Text(value=model or "", placeholder="empty: embedded Gemma 3 270M", description="model path",
                  layout=w.Layout(width="480px"))
    button = w.Button(description="Run", button_style="primary")
    status = w.Label()
    out = w.Output()

    def run(_=None) -> None:
        button.disabled = True
        key = path.value.strip()
        try:
            if key not in models:
                status.value = f"loading {key or 'the embedded model'}..."
                models[key] = load(key)
            status.value = "running..."
            steps, requests = run_config(models[key], concurrency=conc.value, chunk_cap=cap.value,
                                         prompt_len=plen.value, gen_tokens=gen.value)
            out.clear_output(wait=True)
            with out:
                show(steps_chart(steps))
                show(requests_chart(requests))
            status.value = f"{steps.height} steps, {requests['generated_tokens'].sum()} tokens"
        except Exception as exc:  # shown in the UI; the explorer stays usable
            status.value = f"error: {type(exc).__name__}: {exc}"
        finally:
            button.disabled = False

    button.on_click(run)
    return w.VBox([w.HBox([conc, cap]), w.HBox([plen, gen]), path, w.HBox([button, status]), out])
