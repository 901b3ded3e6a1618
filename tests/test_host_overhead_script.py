"""scripts/host_overhead.py: the engine's host time per step with every scored row answered from a
recorded plain run. On a tiny random model, drafting from its own first layer with the guard off
(so every step verifies: a random model's text gives n-gram lookups nothing to copy): every
pass's tokens equal the recorded run's, verify steps are reported, and the step telemetry is
written; plain decoding alone too; a bad --spec is one line and exit 2."""

import subprocess
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "host_overhead.py"


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_replayed_passes_match_the_recorded_run_and_report_host_time(tiny_gguf, tmp_path):
    out = tmp_path / "steps.parquet"
    r = script("--model", str(tiny_gguf("gemma3")), "--workload", "code-edit", "--concurrency", "3",
               "--spec", "self:1:2", "--spec-variant", "guard=false", "--passes", "2", "--max-tokens", "24", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("pass ") == 2
    steps = pl.read_parquet(out)
    decode = steps.filter(pl.col("phase") == "decode")
    assert decode.height and (decode["wall_ms"] > 0).all()
    assert decode["draft_tokens"].fill_null(0).sum() > 0
    assert "verify steps:" in r.stdout


def test_plain_decoding_and_bad_arguments(tiny_gguf):
    model = str(tiny_gguf("gemma3"))
    r = script("--model", model, "--concurrency", "2", "--spec", "off", "--passes", "1", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "plain steps:" in r.stdout and "verify steps:" not in r.stdout
    r = script("--model", model, "--spec", "ngram")
    assert r.returncode == 2 and "is not PROPOSER:K" in r.stderr and "Traceback" not in r.stderr


def test_a_simulated_device_times_plain_decoding_beside_speculation(tiny_gguf):
    """--device-ms: each forward also takes a modelled device's time on one stream, and plain
    decoding (AR) is timed beside speculation, pass by pass, with the same tokens (the pipeline's
    half steps too); a malformed or negative model is one line and exit 2."""
    model = str(tiny_gguf("gemma3"))
    r = script("--model", model, "--workload", "code-edit", "--concurrency", "4", "--spec", "ngram:2",
               "--spec-variant", "guard=false,pipeline=2", "--passes", "1", "--max-tokens", "24",
               "--device-ms", "0.2,0.01,0.3,0.02")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "AR pass 0:" in r.stdout and "x AR" in r.stdout and "half verify steps:" in r.stdout
    assert "wall" in r.stdout  # (step times are the simulated device's and the host's, not the host's alone)
    for bad, says in (("1,2,3", "is not PA,PB,VA,VB"), ("0.2,-1,0.3,0.02", "negative")):
        r = script("--model", model, "--concurrency", "2", "--device-ms", bad, "--passes", "1", "--max-tokens", "4")
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
