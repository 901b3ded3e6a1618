"""scripts/pipeline_bench.py --dry-run (a tiny random model under the Triton interpreter): AR,
speculation in whole steps and the pipeline each pass with AR's tokens, the pipeline's verifies
are half steps; bad arguments are one line and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pipeline_bench.py"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_three_engines_pass_with_ars_tokens(tmp_path):
    r = bench("--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {x["engine"]: x for x in json.loads((tmp_path / "pipeline_bench.json").read_text())}
    assert set(rows) == {"ar", "spec", "pipeline"} and all(x["tokens_same"] for x in rows.values())
    assert rows["ar"]["verify_steps"] == 0 and rows["ar"]["ran_ahead"] > 0
    assert rows["spec"]["verify_steps"] > 0 and rows["spec"]["half_steps"] == 0
    assert rows["pipeline"]["half_steps"] > 0 and rows["pipeline"]["half_verify_ms"] is not None
    assert not list(tmp_path.glob("*.gguf"))  # (the random model stays out of --out)


def test_bad_arguments_are_one_line(tmp_path):
    for args, want in ((("--kept", "9"), "allowed positive integers, --kept 0..--k"),
                       (("--k", "99"), "speculation k=99 is out of range")):
        r = bench(*args, "--out", str(tmp_path))
        assert r.returncode == 2, r.stderr[-2000:]
        assert want in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
