"""Ablation registry, parameter validation, sweeps, the `workbench ablate` CLI, and the
chunk-sizing notebook run headless through papermill on a tiny random GGUF."""

from __future__ import annotations

import ast
import json
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
        (chunk_params(concurrency="4"), "concurrency='4'", "an integer 2..64"),
        (chunk_params(concurrency=True), "concurrency=True", "an integer 2..64"),
        (chunk_params(chunk_sizes=[16, "big"]), "chunk_sizes=", "integers >= 1 or 'auto'"),
        (chunk_params(chunk_sizes=[0]), "chunk_sizes=[0]", "integers >= 1 or 'auto'"),
        (chunk_params(chunk_sizes=[]), "chunk_sizes=[]", "a non-empty list"),
        (chunk_params(chunk_sizes=[16, 16]), "chunk_sizes=[16, 16]", "distinct"),
        (chunk_params(prompt_lens=64), "prompt_lens=64", "a non-empty list of distinct integers >= 1"),
        (chunk_params(prompt_lens=["auto"]), "prompt_lens=['auto']", "distinct integers >= 1"),
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
                      "data_dir": "data", "run_id": None}


def parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    tree = ast.parse(cell.source)
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body}


@pytest.mark.parametrize("name", list(ablations.registry()))
def test_notebook_parameters_cell_matches_the_registry(name):
    ablation = ablations.get(name)
    assert parameters_cell(ablation.notebook_path) == {**ablation.defaults(), "data_dir": "data", "run_id": None}
    ablations.validate(name, ablation.quick)


def test_plan_sweep_expands_scalar_lists_into_independent_runs(tmp_path):
    specs = ablations.plan_sweep("chunk-sizing", {"concurrency": [2, 3], "seed": [0, 1]}, quick=True,
                                 data_dir=tmp_path)
    assert [s.swept for s in specs] == [{"concurrency": 2, "seed": 0}, {"concurrency": 2, "seed": 1},
                                        {"concurrency": 3, "seed": 0}, {"concurrency": 3, "seed": 1}]
    quick = ablations.get("chunk-sizing").quick
    assert all(s.params["chunk_sizes"] == quick["chunk_sizes"] for s in specs)  # list params stay in one run
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
    argv = ["ablate", "chunk-sizing", "--data-dir", str(tmp_path), "--no-progress",
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
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(o.output_type == "display_data" for o in outputs) >= 1 + 4  # the proof table + 4 charts


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
