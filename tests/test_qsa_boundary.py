"""The QSA-boundary ablation (issue 22, item 4): its rows on a tiny random model (the exactness
columns asserted, the activation check), its charts, and the notebook run headless through
`workbench ablate`."""

from __future__ import annotations

import nbformat
import polars as pl
import pytest

from workbench import ablations, cli, qsa_boundary
from workbench.errors import WorkbenchError
from workbench.runstore import RunStore

# boundaries of (1 + 16 + 1) * 4 = 72 and (1 + 40 + 1) * 4 = 168 positions: the 160-token prompts
# (the tiny vocabulary spells a needle prompt in many tokens) are past the first and below the
# second (a dense-equality row, flagged), 320 past both
LENS, TOP_KS, GEN = [160, 320], [16, 40], 6


@pytest.fixture(scope="module")
def rows(tiny_model):
    m = tiny_model("gemma3", "float32", n_layers=6)
    return qsa_boundary.measure_qsa_boundary(m, context_lens=LENS, top_ks=TOP_KS, blocks=[4], concurrencies=[1, 3],
                                             depths=[0.2, 0.8], gen_tokens=GEN, progress=False)


def test_rows_hold_the_exactness_claims_and_flag_dense_rows(rows):
    assert rows.height == len(LENS) * len(TOP_KS) * 2
    assert rows["dense_equal_below"].all() and rows["batched_equals_solo"].all()
    for r in rows.iter_rows(named=True):
        b = (1 + r["top_k"] + 1) * 4
        assert r["boundary"] == b
        past = r["context_len"] + GEN > b
        assert r["activation_ok"] == past and r["past_boundary"] == past
        if past:
            assert r["qsa_sparse_rows"] > 0 and r["qsa_blocks_kept"] > 0 and r["activation_flag"] is None
            assert r["qsa_blocks_scored"] > r["qsa_blocks_kept"] - r["qsa_sparse_rows"] * 2  # (sinks, locals unscored)
        else:
            assert r["qsa_sparse_rows"] == 0 and "never pass the boundary" in r["activation_flag"]
            assert r["tokens_equal_dense"]  # dense by design: the same tokens
        if r["context_len"] > b:  # the prompt itself passes it: the first row that differs is the boundary
            assert r["first_diff_position"] == b and r["kl_mean"] is not None and 0 <= r["top1_agreement"] <= 1
        else:
            assert r["kl_mean"] is None
    assert qsa_boundary.not_exact(rows) is None
    assert qsa_boundary.flagged(rows).height == 2


def test_rows_that_break_exactness_are_named_and_refused(rows):
    bad = rows.with_columns(pl.when(pl.col("concurrency") == 3).then(False).otherwise(pl.col("batched_equals_solo"))
                            .alias("batched_equals_solo"))
    with pytest.raises(WorkbenchError, match=r"^exactness fails in 4 row\(s\): context=160 "):
        qsa_boundary.require_exact(bad)


def test_the_measurement_refuses_what_cannot_run(tiny_model):
    m = tiny_model("gemma3", "float32", n_layers=6)
    with pytest.raises(WorkbenchError, match=r"^context_len=2048 with gen_tokens=6 does not fit the model's context "
                                             r"of 2048 tokens: allowed context_len <= 2042$"):
        qsa_boundary.measure_qsa_boundary(m, context_lens=[2048], top_ks=[8], blocks=[4], concurrencies=[1],
                                          depths=[0.5], gen_tokens=6, progress=False)
    with pytest.raises(WorkbenchError, match=r"^QSA needs full-attention layers"):
        qsa_boundary.measure_qsa_boundary(tiny_model("gemma3", "float32", n_layers=3), context_lens=[160],
                                          top_ks=[8], blocks=[4], concurrencies=[1], depths=[0.5], gen_tokens=6,
                                          progress=False)
    with pytest.raises(WorkbenchError, match=r"^qsa block=3 is not allowed"):
        qsa_boundary.measure_qsa_boundary(m, context_lens=[160], top_ks=[8], blocks=[3], concurrencies=[1],
                                          depths=[0.5], gen_tokens=6, progress=False)


def test_qsa_boundary_notebook_headless(tiny_gguf, tmp_path, capsys):
    model = tiny_gguf("gemma3", "F32", n_layers=6)
    argv = ["ablate", "qsa-boundary", "--quick", "--data-dir", str(tmp_path), "--no-progress",
            "-p", f"model={model}", "-p", "context_lens=160,320", "-p", "top_ks=8", "-p", "concurrencies=1,2",
            "-p", "depths_pct=50"]
    assert cli.main(argv) == 0
    (manifest,) = RunStore(tmp_path).manifests()
    assert manifest["status"] == "complete" and manifest["quick"] is True
    run_dir = tmp_path / "runs" / manifest["run_id"]
    got = pl.read_parquet(run_dir / "summary.parquet")
    assert got.height == 4 and got["activation_ok"].all() and got["batched_equals_solo"].all()
    notebook = nbformat.read(run_dir / "qsa_boundary.ipynb", as_version=4)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert "0 flagged row(s)" in "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    html = "".join(o.data.get("text/html", "") for o in outputs if o.output_type == "display_data")
    assert "Batching past the boundary beside seed 000" in html
    assert "Top-1 agreement with dense, past the boundary" in html


def test_bad_params_are_one_line(tmp_path, capsys):
    assert cli.main(["ablate", "qsa-boundary", "--data-dir", str(tmp_path), "-p", "summary=max"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "workbench: error: summary='max' is not allowed: allowed one of 'mean', 'minmax'"
    assert not RunStore(tmp_path).manifests()
