"""Ablation registry, parameter validation, sweeps, the `workbench ablate` CLI, and the
chunk-sizing notebook run headless through papermill (the runner, and papermill's own command
line as the notebook documents it) on a tiny random GGUF."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys

import nbformat
import polars as pl
import pytest

from workbench import ablations, cli
from workbench.errors import WorkbenchError
from workbench.runstore import RunStore


def chunk_params(**over):
    return {"concurrency": 2, "prompt_lens": [64], "chunk_sizes": [16, "auto"], **over}


@pytest.mark.parametrize(
    ("params", "named", "allowed"),
    [
        (chunk_params(concurrency=1), "concurrency=1", "an integer 2..64"),
        (chunk_params(concurrency=65), "concurrency=65", "an integer 2..64"),
        (chunk_params(concurrency="four"), "concurrency='four' is not an integer", "an integer 2..64"),
        (chunk_params(concurrency="4.5"), "concurrency=4.5 is not an integer", "an integer 2..64"),
        (chunk_params(concurrency=True), "concurrency=True", "an integer 2..64"),
        (chunk_params(chunk_sizes=[16, "big"]), "chunk_sizes=", "integers >= 1 or 'auto'"),
        (chunk_params(chunk_sizes=[0]), "chunk_sizes=[0]", "integers >= 1 or 'auto'"),
        (chunk_params(chunk_sizes=[]), "chunk_sizes=[]", "a non-empty list"),
        (chunk_params(chunk_sizes=[16, 16]), "chunk_sizes=[16, 16]", "distinct"),
        (chunk_params(prompt_lens=64), "prompt_lens=64", "a non-empty list of distinct integers >= 1"),
        (chunk_params(prompt_lens=["auto"]), "prompt_lens=['auto']", "distinct integers >= 1"),
        (chunk_params(prompt_lens="[32"), "prompt_lens='[32' is not a non-empty list", "distinct integers >= 1"),
        (chunk_params(prompt_lens="[]"), "prompt_lens=[] is not a non-empty list", "distinct integers >= 1"),
        (chunk_params(prompt_lens="[32, 32]"), "prompt_lens=[32, 32] repeats a value", "distinct"),
        (chunk_params(chunk_sizes="16,huge"), "non-integer item 'huge'", "integers >= 1 or 'auto'"),
        (chunk_params(progress="maybe"), "progress='maybe'", "True or False"),
        (chunk_params(repeats=0), "repeats=0", "an integer 1..1000"),
        (chunk_params(model="/no/such/model.gguf"), "model='/no/such/model.gguf'", "an existing file or None"),
    ],
)
def test_validate_refuses_bad_values_naming_what_is_allowed(params, named, allowed):
    with pytest.raises(WorkbenchError) as err:
        ablations.validate("chunk-sizing", params)
    assert named in str(err.value) and allowed in str(err.value)


def test_validate_refuses_unknown_names_and_fills_defaults():
    with pytest.raises(WorkbenchError, match=r"unknown parameter\(s\) 'chunk_size'.*parameters: model, concurrency"):
        ablations.validate("chunk-sizing", {"chunk_size": 16})
    with pytest.raises(WorkbenchError, match="unknown ablation 'nope'; ablations: chunk-sizing"):
        ablations.validate("nope", {})
    config = ablations.validate("chunk-sizing", {"chunk_sizes": (8, "auto")})
    assert config["chunk_sizes"] == [8, "auto"]
    assert config == {**ablations.get("chunk-sizing").defaults(), "chunk_sizes": [8, "auto"],
                      "data_dir": "data", "run_id": None, "progress": True}


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("prompt_lens", "[32]", [32]),
        ("prompt_lens", "[32, 64]", [32, 64]),
        ("prompt_lens", "32,64", [32, 64]),
        ("prompt_lens", "32", [32]),
        ("chunk_sizes", '[16, "auto"]', [16, "auto"]),
        ("chunk_sizes", "[16, auto]", [16, "auto"]),
        ("chunk_sizes", "16, 64,auto", [16, 64, "auto"]),
        ("chunk_sizes", "auto", ["auto"]),
        ("concurrency", "64", 64),
        ("concurrency", " 3 ", 3),
        ("concurrency", "2,4", [2, 4]),  # a sweep, for `workbench ablate`; `validate` refuses it
        ("model", "None", None),
        ("model", "null", None),
        ("prompt_lens", "[32", "[32"),  # unbalanced: stays text, for `check` to refuse
        ("concurrency", "__import__('os')", "__import__('os')"),  # not a literal: never evaluated
    ],
)
def test_text_values_read_as_literals(name, text, value):
    assert ablations.get("chunk-sizing").param(name).parse(text) == value


def test_validate_reads_text_as_papermill_passes_it():
    # papermill -p passes '[32]' as the string "[32]"; -r passes every value as a string
    text = {"prompt_lens": "[32]", "chunk_sizes": "[16, 'auto']", "concurrency": "3", "model": "null",
            "repeats": "2", "progress": "False", "run_id": "None"}
    typed = {"prompt_lens": [32], "chunk_sizes": [16, "auto"], "concurrency": 3, "model": None,
             "repeats": 2, "progress": False, "run_id": None}
    assert ablations.validate("chunk-sizing", text) == ablations.validate("chunk-sizing", typed)
    assert ablations.validate("chunk-sizing", text)["prompt_lens"] == [32]
    with pytest.raises(WorkbenchError, match=r"concurrency=\[2, 4\] is not an integer: allowed an integer 2\.\.64"):
        ablations.validate("chunk-sizing", {"concurrency": "2,4"})


def parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    tree = ast.parse(cell.source)
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body}


@pytest.mark.parametrize("name", list(ablations.registry()))
def test_notebook_parameters_cell_matches_the_registry(name):
    ablation = ablations.get(name)
    assert parameters_cell(ablation.notebook_path) == {**ablation.defaults(), "data_dir": "data", "run_id": None,
                                                       "progress": True}
    ablations.validate(name, ablation.quick)


def test_is_quick_needs_every_quick_setting():
    ablation = ablations.get("chunk-sizing")
    quick = ablations.validate("chunk-sizing", ablation.quick)
    assert ablation.is_quick(quick)
    assert ablation.is_quick({**quick, "seed": 7})  # a parameter the quick settings leave alone
    assert not ablation.is_quick({**quick, "repeats": 2})
    assert not ablation.is_quick(ablations.validate("chunk-sizing", {}))


def test_a_run_by_hand_is_quick_when_its_params_hold_the_quick_settings(tmp_path):
    quick = ablations.get("chunk-sizing").quick
    for over, expected in ((quick, True), ({**quick, "repeats": 2}, False), ({}, False)):
        config = ablations.validate("chunk-sizing", {**over, "data_dir": str(tmp_path)})
        with ablations.recording(config, "chunk-sizing") as run:
            run.write_rows("summary", [{"x": 1}])
        manifest = run.manifest
        assert manifest["quick"] is expected, over
        assert manifest["params"] == {k: v for k, v in config.items() if k not in ablations.RUNNER_PARAMS}
        assert set(manifest["params"]) == {p.name for p in ablations.get("chunk-sizing").params}


def test_plan_sweep_expands_scalar_lists_into_independent_runs(tmp_path):
    specs = ablations.plan_sweep("chunk-sizing", {"concurrency": [2, 3], "seed": [0, 1]}, quick=True,
                                 data_dir=tmp_path)
    assert [s.swept for s in specs] == [{"concurrency": 2, "seed": 0}, {"concurrency": 2, "seed": 1},
                                        {"concurrency": 3, "seed": 0}, {"concurrency": 3, "seed": 1}]
    quick = ablations.get("chunk-sizing").quick
    assert all(s.params["chunk_sizes"] == quick["chunk_sizes"] for s in specs)  # list params stay in one run
    assert all(s.quick for s in specs)
    assert all(set(s.params) == {p.name for p in ablations.get("chunk-sizing").params} for s in specs)
    (full,) = ablations.plan_sweep("chunk-sizing", {"repeats": 1}, data_dir=tmp_path)
    assert not full.quick and full.params == {**ablations.get("chunk-sizing").defaults(), "repeats": 1}
    assert all(s.data_dir == str(tmp_path.resolve()) and "run_id" not in s.params for s in specs)
    with pytest.raises(WorkbenchError, match="concurrency=1 is out of range"):
        ablations.plan_sweep("chunk-sizing", {"concurrency": [2, 1]}, data_dir=tmp_path)
    assert not (tmp_path / "runs").exists()


def test_parse_overrides():
    parsed = ablations.parse_overrides("chunk-sizing", ["chunk_sizes=16, 64,auto", "concurrency=3",
                                                        "prompt_lens=[32]", "model=none", "seed=1,2"])
    assert parsed == {"chunk_sizes": [16, 64, "auto"], "concurrency": 3, "prompt_lens": [32], "model": None,
                      "seed": [1, 2]}


def test_ablate_list(capsys):
    assert cli.main(["ablate", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chunk-sizing: ")
    for line in ("concurrency = 4:", "chunk_sizes = [32, 128, 512, 'auto']:", "model = None:",
                 "--quick: concurrency=2, prompt_lens=[64, 256], chunk_sizes=[16, 64, 'auto']"):
        assert line in out


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("concurrency=99", "concurrency=99 is out of range: allowed an integer 2..64"),
        ("chunk_sizes=16,huge", "chunk_sizes=[16, 'huge'] has a non-integer item 'huge'"),
        ("chunk_size=16", "chunk-sizing has no parameter 'chunk_size'; parameters: model, concurrency"),
        ("data_dir=/tmp", "-p data_dir: set by the runner"),
        ("progress=False", "-p progress: set by the runner"),
        ("concurrency", "-p 'concurrency' is not name=value"),
    ],
)
def test_ablate_bad_param_is_one_line_exit_2_before_anything_runs(arg, message, tmp_path, capsys):
    assert cli.main(["ablate", "chunk-sizing", "-p", arg, "--data-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err
    assert not (tmp_path / "runs").exists()


def test_ablate_bad_param_in_a_fresh_process(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "ablate", "chunk-sizing", "-p", "repeats=0",
         "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "workbench: error: repeats=0 is out of range: allowed an integer 1..1000\n"


def test_kernel_runs_this_python():
    km = ablations.this_python_kernel_manager()(kernel_name=ablations.KERNEL_NAME)
    assert km.kernel_spec.argv[0] == sys.executable
    assert km.kernel_spec.language == "python"


SUMMARY_COLUMNS = {
    # tags and config fields
    "run_id", "ablation", "hardware_id", "model", "concurrency", "prompt_lens", "chunk_sizes", "chunk_cap",
    "gen_tokens", "decode_prompt_len", "repeats", "seed",
    # one measurement
    "prompt_len", "chunk_setting", "chunk_size", "repeat", "ttft_s", "ttft_s_max", "itl_s_max", "itl_s_p99",
    "itl_s_p50", "decode_tok_s_aggregate", "wall_s", "generated_tokens", "peak_memory_bytes", "peak_kv_bytes",
    "num_mixed_steps", "outputs_identical", "tokens_sha256",
}


def test_chunk_sizing_notebook_headless(tiny_gguf, tmp_path, capsys):
    model = tiny_gguf("llama")
    # --quick with every quick setting overridden: the flag, not the values, makes the run quick
    argv = ["ablate", "chunk-sizing", "--quick", "--data-dir", str(tmp_path), "--no-progress",
            "-p", f"model={model}", "-p", "concurrency=2", "-p", "prompt_lens=24,40", "-p", "chunk_sizes=8,auto",
            "-p", "chunk_cap=64", "-p", "gen_tokens=3", "-p", "decode_prompt_len=5", "-p", "repeats=1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out

    (manifest,) = RunStore(tmp_path).manifests()
    run_dir = tmp_path / "runs" / manifest["run_id"]
    assert f"run {manifest['run_id']} complete" in out and str(run_dir) in out
    assert manifest["status"] == "complete" and manifest["error"] is None and manifest["ended_at"]
    assert manifest["ablation"] == "chunk-sizing" and manifest["tables"] == ["summary"]
    assert manifest["params"]["model"] == str(model) and manifest["params"]["chunk_sizes"] == [8, "auto"]
    assert manifest["quick"] is True
    assert manifest["params"] == {**ablations.get("chunk-sizing").defaults(), "model": str(model), "concurrency": 2,
                                  "prompt_lens": [24, 40], "chunk_sizes": [8, "auto"], "chunk_cap": 64,
                                  "gen_tokens": 3, "decode_prompt_len": 5, "repeats": 1}
    assert manifest["hardware_id"] and "git_commit" in manifest and manifest["versions"]

    rows = pl.read_parquet(run_dir / "summary.parquet")
    assert SUMMARY_COLUMNS <= set(rows.columns)
    assert rows.height == 2 * 2  # prompt lengths x chunk sizes x 1 repeat
    assert rows["outputs_identical"].all()
    assert rows.group_by("prompt_len").agg(pl.col("tokens_sha256").n_unique())["tokens_sha256"].to_list() == [1, 1]
    fixed = rows.filter(pl.col("chunk_setting") == "8")
    assert fixed["chunk_size"].to_list() == [8, 8] and (fixed["max_prefill_rows"] == 8).all()
    assert (rows.filter(pl.col("chunk_setting") == "auto")["chunk_size"] == 64).all()  # capped
    assert (rows["num_mixed_steps"] >= 1).all()  # the long prompt prefilled while a slot decoded
    assert rows["itl_s_max"].is_not_null().all() and (rows["decode_tok_s_aggregate"] > 0).all()
    assert set(rows["concurrency"]) == {2} and set(rows["run_id"]) == {manifest["run_id"]}

    notebook = nbformat.read(run_dir / "chunk_sizing.ipynb", as_version=4)
    injected = [c for c in notebook.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and f"run_id = \"{manifest['run_id']}\"" in injected[0].source
    assert "progress = false" in injected[0].source.lower()  # --no-progress reaches the notebook
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(o.output_type == "display_data" for o in outputs) >= 1 + 4  # the proof table + 4 charts
    assert not [o for o in outputs if o.output_type == "stream" and "measurement" in o.text]  # no bar


def documented_papermill_command() -> list[str]:
    """The papermill command line of the notebook's first cell (the one the README shows too)."""
    intro = nbformat.read(ablations.get("chunk-sizing").notebook_path, as_version=4).cells[0]
    (line,) = [ln.strip() for ln in intro.source.splitlines() if ln.strip().startswith("papermill ")]
    return shlex.split(line)


def test_the_documented_papermill_command_runs(tiny_gguf, tmp_path):
    command = documented_papermill_command()
    assert command[:4] == ["papermill", "notebooks/chunk_sizing.ipynb", "out.ipynb", "-p"]
    # as written, from a folder laid out like the repository's root (so data/ is the test's),
    # with the tiny model and small settings appended
    (tmp_path / "notebooks").symlink_to(ablations.NOTEBOOK_DIR)
    tiny = {"model": str(tiny_gguf("llama")), "concurrency": "2", "chunk_sizes": '[8, "auto"]', "chunk_cap": "64",
            "gen_tokens": "3", "decode_prompt_len": "5", "repeats": "1"}
    extra = [arg for name, value in tiny.items() for arg in ("-p", name, value)]
    done = subprocess.run([sys.executable, "-m", *command, *extra, "--log-output"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    (manifest,) = RunStore(tmp_path / "data").manifests()
    assert manifest["status"] == "complete" and manifest["tables"] == ["summary"]
    assert manifest["quick"] is False  # by hand, and not the quick settings
    assert manifest["params"] == {**ablations.get("chunk-sizing").defaults(), "model": tiny["model"],
                                  "concurrency": 2, "prompt_lens": [32], "chunk_sizes": [8, "auto"],
                                  "chunk_cap": 64, "gen_tokens": 3, "decode_prompt_len": 5, "repeats": 1}
    rows = pl.read_parquet(tmp_path / "data" / "runs" / manifest["run_id"] / "summary.parquet")
    assert rows["prompt_len"].to_list() == [32, 32] and rows["outputs_identical"].all()
    # the progress bar, as text lines in papermill's log: one step per measurement, described
    assert "prompt_len=32 chunk=8 repeat=1/1" in done.stderr
    assert "prompt_len=32 chunk=auto repeat=1/1: 100%" in done.stderr and "2/2" in done.stderr
    notebook = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    streams = [o.text for c in notebook.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type == "stream" and o.name == "stderr"]
    assert any("2/2" in text for text in streams)  # and kept in the executed notebook


def test_a_failing_notebook_ends_the_run_failed(tmp_path):
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_bytes(b"not a gguf file")
    (spec,) = ablations.plan_sweep("chunk-sizing", chunk_params(model=str(not_a_model)),
                                   data_dir=tmp_path / "store")
    (result,) = ablations.LocalExecutor(progress_bar=False).run([spec])
    assert result.status == "failed" and result.error
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == result.error
    assert manifest["tables"] == [] and not list(result.run_dir.glob("*.parquet"))
    assert result.notebook_path.exists()  # the executed notebook shows where it failed
