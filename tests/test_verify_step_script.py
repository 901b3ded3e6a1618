"""scripts/verify_step_bench.py --dry-run (a tiny random model under the Triton interpreter): one
row per (variant, rows per slot) is written, the attention-runs variant's logits are bitwise the
default's at every verify width; a bad variant or rows list is one line and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "verify_step_bench.py"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_variants_are_timed_and_bitwise_the_first(tmp_path):
    r = bench("--rows", "1,5", "--variants", "default;attention_runs=true", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "verify_step.json").read_text())
    assert [(x["variant"], x["rows_per_slot"]) for x in rows] == [
        ("default", 1), ("default", 5), ("attention_runs=true", 1), ("attention_runs=true", 5)]
    assert [x["bitwise_first_setting"] for x in rows] == [None, None, True, True]
    assert pl.read_parquet(tmp_path / "verify_step.parquet").height == 4
    assert not list(tmp_path.glob("*.gguf"))  # (the random model stays out of --out)


def test_bad_arguments_are_one_line(tmp_path):
    for args, want in ((("--variants", "attention_runs=4"), "attention_runs='4' is not allowed"),
                       (("--variants", "foo=1"), "unknown triton option 'foo'"),
                       (("--rows", "0,2"), "allowed comma-separated positive integers")):
        r = bench(*args, "--out", str(tmp_path))
        assert r.returncode == 2
        assert want in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()[-1]) < 400
