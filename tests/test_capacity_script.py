"""scripts/capacity.py on a tiny random-weight Gemma 3 (six layers: five sliding, one global):
the paged form holds more sequences than the reserved one in the same KV memory, every request
finishes in both, and the outputs are written; a bad argument is one line and exit 2."""

import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "capacity.py"


def capacity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_gemma(tiny_gguf):
    return tiny_gguf("gemma3", n_layers=6, context_length=2048, sliding_window=64)


def test_paged_holds_more_sequences_and_outputs_are_written(tiny_gemma, tmp_path):
    out = tmp_path / "capacity"
    r = capacity("--model", str(tiny_gemma), "--requests", "24", "--min-prompt", "100", "--max-prompt", "1000",
                 "--max-tokens", "128", "--max-context", "1280", "--chunk-size", "256", "--kv-gib", "0.005",
                 "--max-concurrency", "16", "--out", str(out))
    assert r.returncode == 0, r.stderr
    frame = pl.read_parquet(out / "capacity.parquet")
    assert frame["form"].to_list() == ["reserved", "paged"]
    reserved, paged = frame.row(0, named=True), frame.row(1, named=True)
    assert paged["kv_bytes"] <= reserved["kv_bytes"]  # the same memory (the reserved form's, if anything, more)
    assert 1 < reserved["peak_running"] < 16  # memory-bound, below the slot limit
    assert paged["mean_running_while_waiting"] > reserved["mean_running_while_waiting"]
    assert paged["peak_running"] > reserved["peak_running"]
    assert paged["mean_running_while_waiting_ratio"] == pytest.approx(
        paged["mean_running_while_waiting"] / reserved["mean_running_while_waiting"])
    for row in (reserved, paged):
        assert row["generated_tokens"] == 24 * 128  # every request ran to max_tokens
    assert reserved["num_preemptions"] == 0 and reserved["reprefill_rows"] == 0
    assert paged["prefill_rows"] == paged["prompt_tokens"] + paged["reprefill_rows"] >= reserved["prefill_rows"]
    steps = pl.read_parquet(out / "capacity_steps.parquet")
    assert steps.group_by("form").len().sort("form")["len"].to_list() == [paged["num_steps"], reserved["num_steps"]]
    assert steps["num_running"].max() <= 16
    table = (out / "capacity.md").read_text()
    assert table == r.stdout
    assert "| paged / reserved |" in table and "| reserved |" in table
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


@pytest.mark.parametrize("args, message", [
    (["--requests", "0"], "argument --requests: 0 is out of range: allowed > 0"),
    (["--min-prompt", "50", "--max-prompt", "10"], "--min-prompt=50 exceeds --max-prompt=10"),
])
def test_a_bad_argument_is_one_line_and_exit_2(args, message, tmp_path):
    r = capacity(*args, "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert message in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()
