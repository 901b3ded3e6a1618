"""scripts/family_summary.py: the family stage's logs tabled, a row per arm and pass (the
committed run112's logs), and a line that does not parse refused in one line, nothing written."""

import subprocess
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "family_summary.py"
RUN = ROOT / "data" / "gpu" / "run112_pipeline_family"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_the_logs_become_a_row_per_arm_and_pass(tmp_path):
    out = tmp_path / "s.parquet"
    r = _run(RUN, "--run", "run112", "--device", "H100", "--commit", "abc", "--out", out)
    assert r.returncode == 0, r.stderr
    d = pl.read_parquet(out)
    assert d.height == 2 * 3 * 3  # two workloads, three arms, three passes
    assert d.filter(pl.col("arm") == "AR")["x_ar"].to_list() == [1.0] * 6
    piped = d.filter((pl.col("workload") == "code-edit") & pl.col("arm").str.contains("pipeline"))
    assert piped["pipelined_steps"].min() > 0 and piped["x_ar"].min() > 1.2 and piped["tokens_same"].all()
    # essays verified nothing in the pipeline arm: flagged, not a result
    essays = d.filter((pl.col("workload") == "essay") & (pl.col("arm") != "AR"))
    assert essays.filter(pl.col("verify_steps") == 0)["no_verify_ran"].all()


def test_a_line_that_does_not_parse_is_refused(tmp_path):
    (tmp_path / "spec_overhead_essay_c16_ngram8.log").write_text("          AR pass 0:   12.0 tok/s, garbled\n")
    out = tmp_path / "s.parquet"
    r = _run(tmp_path, "--run", "x", "--device", "d", "--commit", "c", "--out", out)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "does not parse" in err[0]
    assert not out.exists()


def test_each_arm_is_summed_up_by_its_passes_and_its_best_over_ars_best():
    """`arms`: one row per arm, the median of its passes' x AR, and its fastest pass over AR's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from family_summary import arms

    frame = pl.DataFrame({
        "workload": ["essay"] * 6, "concurrency": [16] * 6, "arm": ["AR", "ngram:8"] * 3, "pass": [0, 0, 1, 1, 2, 2],
        "tok_s": [100.0, 90.0, 200.0, 150.0, 120.0, 210.0], "verify_steps": [0, 3, 0, 4, 0, 5],
        "pipelined_steps": [0] * 6, "tokens_same": [True] * 6})
    frame = frame.with_columns((pl.col("tok_s") / pl.col("tok_s").filter(pl.col("arm") == "AR")
                                .gather(pl.col("pass"))).alias("x_ar"))
    got = arms(frame).filter(pl.col("arm") == "ngram:8").row(0, named=True)
    assert got["passes"] == 3 and got["best_x"] == 1.05  # (210 against AR's 200)
    assert got["med_x"] == 0.9 and got["min_x"] == 0.75 and got["max_x"] == 1.75 and got["verify_steps"] == 5
