"""Run store: manifests, tidy parquet, atomic writes, crash and kill behaviour, filters, CLI."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from workbench import atomic, runstore
from workbench.errors import WorkbenchError
from workbench.hardware import fingerprint, hardware_id, measure_copy_bandwidth
from workbench.runstore import RunStore, atomic_write_bytes, atomic_write_text

REPO = Path(__file__).resolve().parents[1]
CPU = {"hardware_id": "cpu:Fake-CPU:2c", "cpu_model": "Fake CPU"}
GPU = {"hardware_id": "gpu:Fake-GPU", "gpu_name": "Fake GPU"}


def files_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_manifest_fields(tmp_path):
    store = RunStore(tmp_path)
    with store.start_run("chunk-sizing", {"chunk_size": 512}, hardware=CPU) as run:
        manifest = json.loads((run.path / "manifest.json").read_text())
        assert manifest["status"] == "running" and manifest["ended_at"] is None
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", run.run_id)
    assert run.path == tmp_path / "runs" / run.run_id
    manifest = json.loads((run.path / "manifest.json").read_text())
    for key in ("run_id", "ablation", "params", "quick", "hardware", "hardware_id", "git_commit", "git_dirty",
                "versions", "started_at", "ended_at", "status", "error", "tables"):
        assert key in manifest, key
    assert manifest["status"] == "complete" and manifest["ended_at"] >= manifest["started_at"]
    assert manifest["params"] == {"chunk_size": 512}
    assert manifest["quick"] is False
    assert store.start_run("chunk-sizing", {}, hardware=CPU, quick=True).manifest["quick"] is True
    with pytest.raises(WorkbenchError, match="quick='yes' is not allowed: allowed True or False"):
        store.start_run("chunk-sizing", {}, hardware=CPU, quick="yes")
    assert manifest["hardware"] == CPU and manifest["hardware_id"] == CPU["hardware_id"]
    assert set(manifest["versions"]) >= {"workbench", "torch", "triton", "polars", "altair", "gguf"}
    assert manifest["versions"]["polars"] == pl.__version__


def test_rows_are_tidy_with_ids_and_flattened_params(tmp_path):
    store = RunStore(tmp_path)
    params = {"chunk_size": 512, "repeat": 1, "engine": {"num_slots": 4, "mode": "batched"}, "sizes": [1, 2]}
    with store.start_run("chunk-sizing", params, hardware=GPU) as run:
        path = run.write_rows("summary", [{"ttft_s_max": 0.5, "chunk_size": 512}, {"ttft_s_max": 0.7}])
        run.write_rows("summary", pl.DataFrame({"ttft_s_max": [0.9], "extra": ["x"]}))  # appends
    assert path == run.path / "summary.parquet"
    frame = pl.read_parquet(path)
    assert frame.columns[:3] == ["run_id", "ablation", "hardware_id"]
    assert frame.height == 3
    assert frame["run_id"].unique().to_list() == [run.run_id]
    assert frame["hardware_id"].unique().to_list() == ["gpu:Fake-GPU"]
    assert frame["engine_num_slots"].to_list() == [4, 4, 4]
    assert frame["engine_mode"].unique().to_list() == ["batched"]
    assert frame["sizes"].unique().to_list() == ["[1, 2]"]
    assert frame.schema["chunk_size"] == pl.Int64
    assert frame["ttft_s_max"].to_list() == [0.5, 0.7, 0.9]
    assert frame["extra"].to_list() == [None, None, "x"]
    assert run.manifest["tables"] == ["summary"]
    assert (path.stat().st_mode & 0o777) == 0o644


def test_row_column_must_agree_with_params(tmp_path):
    store = RunStore(tmp_path)
    with store.start_run("a", {"chunk_size": 512}, hardware=CPU) as run:
        with pytest.raises(WorkbenchError, match="chunk_size"):
            run.write_rows("summary", [{"chunk_size": 1024}])
        with pytest.raises(WorkbenchError, match="hardware_id"):
            run.write_rows("summary", [{"hardware_id": "other"}])
        run.write_rows("summary", [{"chunk_size": 512}])


def test_exception_in_context_marks_failed_and_removes_parquet(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with store.start_run("chunk-sizing", {"chunk_size": 512}, hardware=CPU) as run:
            run.write_rows("summary", [{"ttft_s_max": 0.5}])
            run.write_rows("steps", [{"step": 0}])
            raise RuntimeError("boom\nsecond line")
    assert files_in(run.path) == ["manifest.json"]
    manifest = json.loads((run.path / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert manifest["error"] == "RuntimeError: boom"
    assert manifest["tables"] == [] and manifest["ended_at"]
    assert store.load("summary", run_status=None).is_empty()
    with pytest.raises(WorkbenchError, match="already failed"):
        run.write_rows("summary", [{"x": 1}])


def test_crash_mid_write_keeps_the_old_table_and_no_temp_file(tmp_path, monkeypatch):
    store = RunStore(tmp_path)
    run = store.start_run("a", {}, hardware=CPU)
    run.write_rows("summary", [{"x": 1}])
    before = (run.path / "summary.parquet").read_bytes()

    def half_written(self, path, *args, **kwargs):
        Path(path).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", half_written)
    with pytest.raises(OSError, match="disk full"):
        run.write_rows("summary", [{"x": 2}])
    monkeypatch.undo()
    assert (run.path / "summary.parquet").read_bytes() == before
    assert files_in(run.path) == ["manifest.json", "summary.parquet"]
    run.finish()
    assert store.load("summary")["x"].to_list() == [1]


def test_atomic_write_helpers(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "file.txt"
    atomic_write_text(target, "one")
    atomic_write_bytes(target, b"two")
    assert target.read_text() == "two"

    def refuse(src, dst):
        raise OSError("replace failed")

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(OSError):
        atomic_write_text(target, "three")
    assert target.read_text() == "two"
    assert files_in(target.parent) == ["file.txt"]


def test_killed_process_leaves_running_run_with_whole_tables(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from workbench.runstore import RunStore
        run = RunStore({str(tmp_path)!r}).start_run("a", {{"n": 1}}, hardware={CPU!r})
        run.write_rows("summary", [{{"x": 1}}, {{"x": 2}}])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    store = RunStore(tmp_path)
    runs = store.list_runs(status="running")
    assert runs.height == 1 and runs["tables"].to_list() == ["summary"]
    run_dir = store.runs_dir / runs["run_id"][0]
    assert files_in(run_dir) == ["manifest.json", "summary.parquet"]
    assert store.load("summary").is_empty()  # only complete runs by default
    assert store.load("summary", run_status="running")["x"].to_list() == [1, 2]


def test_list_runs_filters(tmp_path):
    store = RunStore(tmp_path)
    assert store.list_runs().is_empty() and "run_id" in store.list_runs().columns
    for hw in (CPU, GPU):
        with store.start_run("chunk-sizing", {"c": 1}, hardware=hw):
            pass
    with store.start_run("decode", {}, hardware=GPU):
        pass
    with pytest.raises(ValueError), store.start_run("decode", {}, hardware=CPU):
        raise ValueError("bad")
    store.start_run("decode", {}, hardware=CPU)  # still running
    assert store.list_runs().height == 5
    assert store.list_runs(ablation="chunk-sizing").height == 2
    assert store.list_runs(hardware="gpu:Fake-GPU").height == 2
    assert store.list_runs(status="failed")["error"].to_list() == ["ValueError: bad"]
    assert store.list_runs(ablation="decode", hardware="cpu:Fake-CPU:2c", status="running").height == 1
    assert store.list_runs()["run_id"].is_sorted()
    with pytest.raises(WorkbenchError, match="running, complete, failed"):
        store.list_runs(status="done")


def test_list_runs_quick_column(tmp_path):
    store = RunStore(tmp_path)
    with store.start_run("chunk-sizing", {"repeats": 1}, hardware=CPU, quick=True) as quick:
        pass
    with store.start_run("chunk-sizing", {"repeats": 3}, hardware=CPU) as full:
        pass
    with store.start_run("bench", {}, hardware=CPU) as legacy:  # a manifest from before `quick`
        pass
    manifest = json.loads((legacy.path / "manifest.json").read_text())
    del manifest["quick"]
    (legacy.path / "manifest.json").write_text(json.dumps(manifest))
    (store.runs_dir / "broken").mkdir()
    (store.runs_dir / "broken" / "manifest.json").write_text("{not json")
    runs = store.list_runs()
    assert runs.schema["quick"] == pl.Boolean
    assert dict(zip(runs["run_id"], runs["quick"])) == {quick.run_id: True, full.run_id: False,
                                                        legacy.run_id: False, "broken": False}
    assert store.list_runs(quick=True)["run_id"].to_list() == [quick.run_id]
    assert set(store.list_runs(quick=False)["run_id"]) == {full.run_id, legacy.run_id, "broken"}
    with pytest.raises(WorkbenchError, match="quick='no' is not allowed"):
        store.list_runs(quick="no")


def test_load_concatenates_diagonally_and_filters(tmp_path):
    store = RunStore(tmp_path)
    with store.start_run("a", {"chunk_size": 256}, hardware=CPU) as run:
        run.write_rows("summary", [{"ttft_s_max": 1.0}])
    with store.start_run("a", {"chunk_size": 512, "new_knob": True}, hardware=GPU) as run:
        run.write_rows("summary", [{"ttft_s_max": 0.5, "itl_s_max": 0.1}])
    frame = store.load("summary")
    assert frame.height == 2
    assert frame.filter(pl.col("chunk_size") == 256)["itl_s_max"].to_list() == [None]
    assert store.load("summary", hardware_id="gpu:Fake-GPU")["chunk_size"].to_list() == [512]
    assert store.load("summary", chunk_size=[256, 512]).height == 2
    assert store.load("missing").is_empty()
    with pytest.raises(WorkbenchError, match="cannot filter on 'nope'"):
        store.load("summary", nope=1)


def test_names_and_lifecycle_are_checked(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(WorkbenchError, match="ablation"):
        store.start_run("../escape", {}, hardware=CPU)
    with pytest.raises(WorkbenchError, match="hardware_id"):
        store.start_run("a", {}, hardware={})
    with pytest.raises(WorkbenchError, match="collides"):
        store.start_run("a", {"engine": {"x": 1}, "engine_x": 2}, hardware=CPU)
    run = store.start_run("a", {}, hardware=CPU)
    with pytest.raises(WorkbenchError, match="table name"):
        run.write_rows("a/b", [{"x": 1}])
    with pytest.raises(WorkbenchError, match="reserved"):
        run.write_rows("manifest", [{"x": 1}])
    run.finish()
    with pytest.raises(WorkbenchError, match="already complete"):
        run.finish()


def test_runs_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="workbench")
    runstore.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["runs", "--data-dir", str(tmp_path)])
    assert args.func(args) == 0
    assert "no runs in" in capsys.readouterr().out
    store = RunStore(tmp_path)
    with store.start_run("chunk-sizing", {}, hardware=GPU):
        pass
    with store.start_run("decode", {}, hardware=CPU):
        pass
    args = parser.parse_args(["runs", "--data-dir", str(tmp_path), "--hardware", "gpu:Fake-GPU"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "chunk-sizing" in out and "complete" in out and "decode" not in out
    assert "1 run(s)" in out
    with pytest.raises(SystemExit):
        parser.parse_args(["runs", "--status", "bogus"])
    with pytest.raises(SystemExit):
        parser.parse_args(["runs", "--quick", "--full"])


def test_runs_cli_quick_and_full(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="workbench")
    runstore.register_cli(parser.add_subparsers(dest="command"))
    store = RunStore(tmp_path)
    with store.start_run("chunk-sizing", {}, hardware=CPU, quick=True) as quick:
        pass
    with store.start_run("chunk-sizing", {}, hardware=CPU) as full:
        pass
    for flags, shown, hidden in (([], [quick, full], []), (["--quick"], [quick], [full]),
                                 (["--full"], [full], [quick])):
        args = parser.parse_args(["runs", "--data-dir", str(tmp_path), *flags])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        header = out.splitlines()[0]
        assert "| quick " in header
        assert all(r.run_id in out for r in shown) and not any(r.run_id in out for r in hidden), flags
    quick_line = [line for line in out.splitlines() if full.run_id in line]
    assert quick_line and "false" in quick_line[0]
    args = parser.parse_args(["runs", "--data-dir", str(tmp_path), "--quick", "--ablation", "bench"])
    assert args.func(args) == 0
    assert "matching the filters" in capsys.readouterr().out


def test_default_hardware_is_this_machine(tmp_path):
    info = fingerprint()
    for key in ("cpu_model", "cpu_cores_logical", "cpu_cores_physical", "memory_bytes", "os", "python", "torch",
                "gpu_name", "gpu_driver", "gpu_memory_bytes", "hardware_id"):
        assert key in info, key
    assert info["memory_bytes"] > 0 and info["cpu_cores_logical"] >= 1
    assert re.fullmatch(r"(cpu:[A-Za-z0-9.-]+:\d+c|gpu:(\d+x)?[A-Za-z0-9.-]+)", info["hardware_id"])
    run = RunStore(tmp_path).start_run("a", {})
    assert run.manifest["hardware_id"] == info["hardware_id"]
    assert hardware_id({"gpu_name": "NVIDIA H200", "gpu_count": 2}) == "gpu:2xNVIDIA-H200"
    assert hardware_id({"cpu_model": "AMD EPYC 9654 96-Core Processor", "cpu_cores_available": 2}) == \
        "cpu:AMD-EPYC-9654:2c"


def test_copy_bandwidth_is_measured_only_when_asked():
    assert measure_copy_bandwidth("cpu", nbytes=4 * 2**20, repeats=2) > 1e8
    with pytest.raises(WorkbenchError, match="nbytes"):
        measure_copy_bandwidth("cpu", nbytes=0)
    # importing the hardware module must not import torch
    done = subprocess.run([sys.executable, "-c", "import sys, workbench.hardware, workbench.runstore; "
                           "print('torch' in sys.modules)"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
