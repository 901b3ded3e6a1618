"""The paging-cliff ablation (issue 20, item 5): the measurement on a tiny random model, its
activation check, its parameters, and the notebook run headless through `workbench ablate`.

The measurement's rows are asserted exactly where they are arithmetic (live KV, pages, prompt
tokens) and by what the engine did where they are counters: a row whose pool the requests
outgrow shows pages moved (swap) or requests recomputed (recompute), and its outputs are
bitwise the all-resident run's. A row that outgrew its pool with nothing paged, or that asked
for PFlash and compressed nothing, is flagged."""

from __future__ import annotations

import nbformat
import polars as pl
import pytest

from workbench import ablations, cli, paging_cliff
from workbench.dashboard.pages import load_pages
from workbench.errors import WorkbenchError
from workbench.runstore import RunStore

# 240 + 280 positions: three 256-position pages a request at its peak, two at admission (the
# prompt and the admission headroom), so that on a four-page pool two requests are admitted
# and outgrow it as they decode, whatever the admission policy promises them
PROMPT, GEN, PAGE = 240, 280, 256
ROW_COLUMNS = {
    "concurrency", "prompt_len", "resident_tokens", "live_kv_tokens", "oversubscription", "pflash", "preemption",
    "decode_tok_s_aggregate", "ttft_s_p50", "ttft_s_max", "pages_out", "pages_in", "bytes_out", "bytes_in", "swaps",
    "recomputes", "transfer_ms", "max_wait_steps", "effective_prompt_tokens", "raw_prompt_tokens",
    "outputs_identical", "activation_ok", "activation_flag", "throughput_vs_resident", "resident_pages",
    "live_kv_pages", "resident_decode_tok_s_aggregate", "arm", "compress_s_mean", "compress_device",
}


@pytest.fixture(scope="module")
def cliff(tiny_model):
    """C1 and C2 on a four-page pool: C1 needs three pages, C2 six."""
    m = tiny_model("llama", "bfloat16")
    return paging_cliff.measure_paging_cliff(m, concurrency=[1, 2], resident_tokens=[4 * PAGE], prompt_lens=[PROMPT],
                                             gen_tokens=GEN, preemption=["swap", "recompute"], progress=False)


def test_rows_are_exact_and_paging_ran_where_the_pool_is_outgrown(cliff):
    rows = cliff
    assert ROW_COLUMNS <= set(rows.columns)
    assert rows.select("concurrency", "preemption").rows() == [(1, "swap"), (1, "recompute"), (2, "swap"),
                                                               (2, "recompute")]
    for r in rows.iter_rows(named=True):
        c = r["concurrency"]
        assert r["live_kv_tokens"] == c * (PROMPT + GEN) and r["live_kv_pages"] == 3 * c
        assert r["resident_pages"] == 4 and r["oversubscription"] == c * (PROMPT + GEN) / (4 * PAGE)
        assert r["raw_prompt_tokens"] == r["effective_prompt_tokens"] == c * PROMPT
        assert r["generated_tokens"] == c * GEN and r["pflash"] == "off" and r["prompt_compression"] == "off"
        assert r["throughput_vs_resident"] == r["decode_tok_s_aggregate"] / r["resident_decode_tok_s_aggregate"]
        assert r["outputs_identical"] and r["tokens_identical"]
        assert r["activation_ok"] and r["activation_flag"] is None
        assert r["host_store_tokens"] == c * 3 * PAGE  # the default host store holds every request
    fits = rows.filter(pl.col("concurrency") == 1)
    assert fits["pages_out"].to_list() == [0, 0] and fits["recomputes"].to_list() == [0, 0]
    swap = rows.filter((pl.col("concurrency") == 2) & (pl.col("preemption") == "swap")).row(0, named=True)
    assert swap["pages_out"] > 0 and swap["pages_in"] == swap["pages_out"] and swap["swaps"] > 0
    assert swap["bytes_out"] > 0 and swap["bytes_in"] == swap["bytes_out"] and swap["recomputes"] == 0
    assert swap["max_wait_steps"] > 0
    recompute = rows.filter((pl.col("concurrency") == 2) & (pl.col("preemption") == "recompute")).row(0, named=True)
    assert recompute["recomputes"] > 0 and recompute["pages_out"] == 0 and recompute["swaps"] == 0
    assert recompute["recomputed_tokens"] > 0
    assert paging_cliff.differing(rows) is None and paging_cliff.flagged(rows).is_empty()
    paging_cliff.require_identical(rows)


def test_pflash_on_that_compresses_nothing_is_flagged_not_reported(tiny_model):
    """PFlash on ("auto") leaves 240-token prompts whole: the row runs, compares bitwise with
    its reference (which asked for compression too), and says that nothing was compressed. The
    pool holds both requests, so the paging check has nothing to say."""
    m = tiny_model("llama", "bfloat16")
    rows = paging_cliff.measure_paging_cliff(m, concurrency=[2], resident_tokens=[4 * PAGE], prompt_lens=[PROMPT],
                                             gen_tokens=30, pflash=["on"], preemption=["swap"], progress=False)
    (r,) = rows.iter_rows(named=True)
    assert r["live_kv_pages"] == 4 and r["resident_pages"] == 4 and r["pages_out"] == 0 and r["recomputes"] == 0
    assert r["prompt_compression"] == "auto" and r["num_compressed"] == 0 and r["outputs_identical"]
    assert r["activation_ok"] is False
    assert r["activation_flag"] == "pflash on but no prompt was compressed (shorter than compression.auto_min_tokens)"
    assert paging_cliff.flagged(rows).height == 1


@pytest.mark.parametrize(("case", "ok", "flag"), [
    # the pool outgrown, yet nothing paged or recomputed (the engine queued the excess at admission)
    (dict(live_kv_pages=8, resident_pages=4, pages_out=0, recomputes=0), False, "live KV of 8 pages exceeds the "
     "pool's 4 but no page moved and nothing was recomputed (the excess waited for admission)"),
    (dict(live_kv_pages=8, resident_pages=4, pages_out=3, recomputes=0), True, None),
    (dict(live_kv_pages=8, resident_pages=4, pages_out=0, recomputes=1), True, None),
    (dict(live_kv_pages=4, resident_pages=4, pages_out=0, recomputes=0), True, None),  # the pool holds them
    (dict(live_kv_pages=4, resident_pages=8, pages_out=0, recomputes=0, pflash="on"), False,
     "pflash on but no prompt was compressed"),
    (dict(live_kv_pages=4, resident_pages=8, pages_out=0, recomputes=0, pflash="on", num_compressed=1), True, None),
    (dict(live_kv_pages=9, resident_pages=8, pages_out=0, recomputes=0, pflash="on"), False,
     "exceeds the pool's 8 but no page moved and nothing was recomputed (the excess waited for admission); "
     "pflash on but"),
])
def test_the_activation_check_on_fabricated_rows(case, ok, flag):
    got_ok, got_flag = paging_cliff.activation(**{"pflash": "off", "num_compressed": 0, **case})
    assert got_ok is ok
    assert (got_flag is None) if flag is None else (flag in got_flag)


def test_outputs_that_differ_are_named_and_refused():
    rows = pl.DataFrame({"concurrency": [1, 4], "resident_tokens": [1024, 1024], "preemption": ["swap", "recompute"],
                         "pflash": ["off", "off"], "prompt_len": [256, 256], "outputs_identical": [True, False],
                         "tokens_identical": [True, False]})
    line = "outputs differ from the all-resident run in 1 measurement(s): C=4 pool=1024 recompute pflash=off " \
           "prompt_len=256 (tokens too)"
    assert paging_cliff.differing(rows) == line
    with pytest.raises(WorkbenchError, match=r"^outputs differ from the all-resident run in 1 measurement"):
        paging_cliff.require_identical(rows)


def test_the_measurement_refuses_what_cannot_run(tiny_model):
    m = tiny_model("llama", "bfloat16")
    context = m.config.context_length
    with pytest.raises(WorkbenchError, match=rf"prompt_len={context} with gen_tokens=8 does not fit the model's "
                                             rf"context of {context} tokens uncompressed \(pflash 'off'\): allowed "
                                             rf"prompt_len <= {context - 8}"):
        paging_cliff.measure_paging_cliff(m, concurrency=[1], resident_tokens=[512], prompt_lens=[context],
                                          gen_tokens=8, progress=False)
    with pytest.raises(WorkbenchError, match="pflash='maybe' is not allowed: allowed off, on"):
        paging_cliff.measure_paging_cliff(m, concurrency=[1], resident_tokens=[512], prompt_lens=[8], gen_tokens=2,
                                          pflash=["maybe"], progress=False)


# -- parameters -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("over", "message"), [
    ({"pflash_modes": ["maybe"]}, "pflash_modes=['maybe'] has an item 'maybe' not allowed: allowed a non-empty "
                                  "list of distinct values from 'off', 'on'"),
    ({"pflash_modes": "off,maybe"}, "pflash_modes=['off', 'maybe'] has an item 'maybe' not allowed"),
    ({"preemptions": []}, "preemptions=[] is not a non-empty list: allowed a non-empty list of distinct values from "
                          "'swap', 'recompute'"),
    ({"preemptions": ["swap", "swap"]}, "preemptions=['swap', 'swap'] repeats a value"),
    ({"preemptions": [1]}, "preemptions=[1] has an item 1 not allowed"),
    ({"preemptions": "swap"}, None),  # one word of a list parameter is a list of one
    ({"backend": "cuda"}, "backend='cuda' is not allowed: allowed one of 'torch', 'triton'"),
    ({"backend": ["torch"]}, "backend=['torch'] is not allowed: allowed one of 'torch', 'triton'"),
    ({"host_tokens": 0}, "host_tokens=0 is out of range: allowed an integer >= 1 or None"),
    ({"host_tokens": "None"}, None),
    ({"concurrencies": [0, 4]}, "concurrencies=[0, 4] has an item 0 out of range: allowed a non-empty list of "
                                "distinct integers 1..64"),
    ({"resident_pools": ["auto"]}, "resident_pools=['auto'] has a non-integer item 'auto'"),
    ({"quantum": 0}, "quantum=0 is out of range: allowed an integer >= 1"),
])
def test_params_refuse_bad_values_in_one_line_naming_what_is_allowed(over, message):
    if message is None:
        config = ablations.validate("paging-cliff", over)
        assert config["preemptions"] == ["swap"] if "preemptions" in over else config["host_tokens"] is None
        return
    with pytest.raises(WorkbenchError) as err:
        ablations.validate("paging-cliff", over)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_word_params_read_text_as_the_cli_and_papermill_pass_it():
    a = ablations.get("paging-cliff")
    assert a.param("pflash_modes").parse("off,on") == ["off", "on"]
    assert a.param("pflash_modes").parse("['off', 'on']") == ["off", "on"]
    assert a.param("preemptions").parse("recompute") == ["recompute"]
    assert a.param("backend").parse("triton") == "triton"
    assert a.param("backend").parse("'torch'") == "torch"
    assert a.param("host_tokens").parse("null") is None
    assert a.param("pflash_modes").is_list and not a.param("backend").is_list
    # a scalar word given several values is a sweep across runs, like any scalar
    specs = ablations.plan_sweep("paging-cliff", {"backend": ["torch", "triton"]}, quick=True)
    assert [s.params["backend"] for s in specs] == ["torch", "triton"] and all(s.quick for s in specs)
    assert specs[0].params["pflash_modes"] == ["off"] and specs[0].params["preemptions"] == ["swap", "recompute"]


def test_ablate_refuses_a_bad_word_in_one_line_before_anything_runs(tmp_path, capsys):
    assert cli.main(["ablate", "paging-cliff", "-p", "preemptions=swap,drop", "--data-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "preemptions=['swap', 'drop'] has an item 'drop' not allowed: allowed a non-empty list of distinct values " \
           "from 'swap', 'recompute'" in captured.err
    assert not (tmp_path / "runs").exists()


# -- the notebook -----------------------------------------------------------------------------------

def test_paging_cliff_notebook_headless(tiny_gguf, tmp_path, capsys):
    model = tiny_gguf("llama")
    argv = ["ablate", "paging-cliff", "--quick", "--data-dir", str(tmp_path), "--no-progress",
            "-p", f"model={model}", "-p", "concurrencies=1,2", "-p", f"resident_pools={4 * PAGE}",
            "-p", f"prompt_lens={PROMPT}", "-p", f"gen_tokens={GEN}"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    (manifest,) = RunStore(tmp_path).manifests()
    run_dir = tmp_path / "runs" / manifest["run_id"]
    assert f"run {manifest['run_id']} complete" in out
    assert manifest["status"] == "complete" and manifest["tables"] == ["summary"] and manifest["quick"] is True
    assert manifest["params"] == {**ablations.get("paging-cliff").defaults(), **ablations.get("paging-cliff").quick,
                                  "model": str(model), "concurrencies": [1, 2], "resident_pools": [4 * PAGE],
                                  "prompt_lens": [PROMPT], "gen_tokens": GEN}
    rows = pl.read_parquet(run_dir / "summary.parquet")
    assert ROW_COLUMNS <= set(rows.columns) and rows.height == 4
    assert rows["outputs_identical"].all() and rows["activation_ok"].all()
    assert rows.filter(pl.col("concurrency") == 2)["pages_out"].to_list()[0] > 0
    notebook = nbformat.read(run_dir / "paging_cliff.ipynb", as_version=4)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "0 flagged row(s)" in text and "every row's tokens and logits are bitwise the all-resident run's" in text
    shown = [o for o in outputs if o.output_type == "display_data"]
    # the table, a chart per metric of the dashboard page (every one drawable here), the cliff beside seed 002's
    metrics = load_pages().ablation("paging-cliff").metrics
    assert len(shown) == 1 + len(metrics) + 1, [o.data.get("text/plain", "")[:80] for o in shown]
    assert "The paging cliff beside seed 002" in shown[-1].data["text/html"]
    assert "Throughput over the all-resident run" in shown[2].data["text/html"]


def test_the_dashboard_page_draws_seed_002s_screen_beside_ours_whatever_the_machine():
    """pages.toml's paging-cliff page asks for seed 002's screenshot rows (another machine) by
    configuration, and for its page_in/page_out under our pages_in/pages_out."""
    import polars as pl

    from workbench.dashboard.pages import load_pages
    from workbench.dashboard.views import refs_for

    page = load_pages().ablation("paging-cliff")
    seeds = pl.read_parquet("data/reference/seeds.parquet")
    got = {m: refs_for(seeds, page.reference_names.get(m, m), ["no-such-machine"], page.reference_configurations)
           for m in page.reference}
    assert sorted(got["decode_tok_s_aggregate"]["value"].to_list()) == [12.39, 18.73, 31.61, 52.6]
    assert sorted(got["pages_out"]["value"].to_list()) == [0, 18, 792, 1880]
    assert sorted(got["pages_in"]["value"].to_list()) == [0, 1, 245, 293]
    assert refs_for(seeds, "page_out", ["no-such-machine"]) is None  # (without the prefix: same machine only)
