"""`workbench bench` on a tiny model: the table, and tidy parquet with config and fingerprint."""

import polars as pl
import pytest

from workbench.bench import format_table, run_bench
from workbench.model import load_model


def test_bench_writes_tidy_rows(tiny_gguf, tmp_path):
    m = load_model(tiny_gguf("gemma3"), dtype="bfloat16")
    lines = []
    run, rows = run_bench(m, concurrency=[1, 2], prompt_len=12, gen=3, chunk=None, repeats=1,
                          data_dir=str(tmp_path), progress=lines.append)
    # progress: the plan, the bandwidth, one line per measurement with its result, the total
    assert len(lines) == 2 + len(rows) + 1
    for i, (line, row) in enumerate(zip(lines[2:], rows)):
        assert line.startswith(f"[{i + 1}/2] concurrency {row['concurrency']}, "
                               f"prompt 12, repeat 1/1: decode {row['decode_tok_s_aggregate']:.1f} tok/s aggregate")
    assert lines[-1].startswith("bench: 2 measurements in ")
    frame = pl.read_parquet(run.path / "summary.parquet")
    assert frame.height == 2
    for col in ("concurrency", "decode_tok_s_aggregate", "prefill_tok_s", "ttft_s_max", "peak_memory_bytes",
                "bandwidth_floor_tok_s", "matches_solo", "hardware_id", "run_id", "prompt_len", "gen", "backend"):
        assert col in frame.columns, col
    assert frame["matches_solo"].to_list() == [True, True]
    assert (frame["decode_tok_s_aggregate"] > 0).all()
    table = format_table(rows)
    assert table.count("\n") == 3 and "| 2 |" in table
    assert run.manifest["status"] == "complete"


def test_options_text_reads_back_and_goes_into_the_params(tiny_gguf, tmp_path):
    """The run's params record the triton options that differ from the defaults as text that
    TritonOptions.parse reads back ("default" for none); the torch backend refuses options."""
    import pytest

    from workbench.bench import options_text
    from workbench.errors import ConfigError
    from workbench.runners.triton_options import TritonOptions

    assert options_text(TritonOptions()) == ""
    for opts in (TritonOptions(pdl=False, graphs="emulate", layer_forms={}),
                 TritonOptions(head_matmul="dense", layer_forms={"Q4_K": "gemv", "Q8_0": "mma"}, attn_segment=32,
                               kv_dtype="bfloat16", graphs=False, graph_history=7)):
        text = options_text(opts)
        assert TritonOptions.parse(text) == opts and text.split(",")[0].startswith(opts.changed()[0] + "=")
    m = load_model(tiny_gguf("gemma3"), dtype="bfloat16")
    run, _ = run_bench(m, concurrency=[1], prompt_len=4, gen=2, chunk=None, repeats=1, data_dir=str(tmp_path),
                       progress=lambda line: None)
    assert run.manifest["params"]["triton_options"] == "default"
    assert pl.read_parquet(run.path / "summary.parquet")["triton_options"].to_list() == ["default"]
    with pytest.raises(ConfigError, match=r"triton options \(pdl\) are the triton backend's"):
        run_bench(m, concurrency=[1], prompt_len=4, gen=2, chunk=None, repeats=1, data_dir=str(tmp_path / "x"),
                  triton=TritonOptions(pdl=False), progress=lambda line: None)
    assert not (tmp_path / "x").exists() or not list((tmp_path / "x").rglob("*.parquet"))


def test_triton_options_reach_every_engine_of_the_run(tiny_gguf, tmp_path, monkeypatch):
    """`workbench bench --backend triton --triton-options ...`: every engine of the run (warm-up
    included) gets the options, --head-matmul joins them, and the params record both."""
    from workbench import engine as engine_mod
    from workbench.cli import main
    from workbench.runners.triton_options import TritonOptions

    seen = []
    init = engine_mod.Engine.__init__

    def spy(self, model, config=None, **kw):
        seen.append(config.triton)
        init(self, model, config, **kw)

    monkeypatch.setattr(engine_mod.Engine, "__init__", spy)
    assert main(["bench", "--backend", "triton", "--triton-options", "graphs=emulate,attn_segment=32,pdl=false",
                 "--head-matmul", "dense", "--model", str(tiny_gguf("gemma3")), "--concurrency", "1",
                 "--prompt-len", "4", "--gen", "2", "--data-dir", str(tmp_path), "--no-progress"]) == 0
    want = TritonOptions(graphs="emulate", attn_segment=32, pdl=False, head_matmul="dense")
    assert seen == [want, want]  # (the warm-up, then the measurement)
    (manifest,) = tmp_path.rglob("manifest.json")
    frame = pl.read_parquet(manifest.parent / "summary.parquet")
    assert frame["triton_options"].to_list() == ["graphs=emulate,head_matmul=dense,attn_segment=32,pdl=false"]
    assert frame["head_matmul"].to_list() == ["dense"]


def test_floor_bytes_are_what_a_step_reads(tiny_model):
    """The bandwidth floor counts the weights a decode step reads: the resident bytes minus the
    embedding table, of which a step gathers only its rows."""
    from workbench.runner import TorchRunner

    m = tiny_model("gemma3", "bfloat16", "Q8_0")
    r = TorchRunner(m, 256)
    assert r.fixed_bytes - r.step_weight_bytes == m.embed_raw.numel()


def test_decode_time_counts_the_host_between_steps(tiny_gguf, monkeypatch):
    """A decode step's time runs until the next step starts, so host work after a step's own
    wall time (its telemetry record, the loop) is in the run's decode time: with each record
    made 20 ms slower, decode tok/s is at most tokens / (20 ms for each decode step but the last,
    whose time ends with its own bookkeeping)."""
    import time

    from workbench.bench import measure
    from workbench.telemetry import Telemetry

    m = load_model(tiny_gguf("gemma3"), dtype="bfloat16")
    record = Telemetry.record_step

    def slow_record(self, rec):
        record(self, rec)
        time.sleep(0.02)

    monkeypatch.setattr(Telemetry, "record_step", slow_record)
    got, _ = measure(m, 2, 8, 4, None)
    # 2 slots x 3 pure decode steps (the first token comes with the prefill): 6 tokens, >= 40 ms
    assert 0 < got["decode_tok_s_aggregate"] <= 6 / 0.04


def test_bench_shared_prefix_hits_the_prefix_cache_and_says_so(tiny_gguf, tmp_path, capsys):
    """--shared-prefix-len: the measured requests start with cached pages (hit tokens > 0, not
    flagged), their outputs stay exact vs solo; with --no-prefix-cache nothing is cached and
    nothing is flagged (the cache was not asked for); the params record the paging options."""
    import polars as pl

    from workbench.cli import main

    base = ["bench", "--model", str(tiny_gguf("gemma3")), "--concurrency", "1,2", "--prompt-len", "300",
            "--gen", "2", "--shared-prefix-len", "280", "--no-progress"]
    assert main([*base, "--data-dir", str(tmp_path / "on")]) == 0
    out = capsys.readouterr().out
    assert "TTFT alone and cold" in out and "FLAGGED" not in out
    (run_dir,) = (tmp_path / "on" / "runs").iterdir()
    rows = pl.read_parquet(run_dir / "summary.parquet")
    assert rows["paged"].all() and (rows["prefix_hit_tokens"] >= 256).all()  # at least one full page each
    assert rows["flag"].is_null().all() and rows["matches_solo"].drop_nulls().all()
    manifest = (run_dir / "manifest.json").read_text()
    assert '"shared_prefix_len": 280' in manifest and '"prefix_cache": true' in manifest

    assert main([*base, "--no-prefix-cache", "--data-dir", str(tmp_path / "off")]) == 0
    (run_dir,) = (tmp_path / "off" / "runs").iterdir()
    rows = pl.read_parquet(run_dir / "summary.parquet")
    assert (rows["prefix_hit_tokens"] == 0).all() and rows["flag"].is_null().all()


def test_prefill_rate_counts_only_the_tokens_prefilled(tiny_gguf):
    """prefill_tok_s is the tokens actually prefilled over the time to the last first token: with
    the prefix cache on, the shared prefix's cached pages are not counted (a hit: fewer tokens,
    the same formula); off, every prompt token is prefilled."""
    from workbench.bench import measure

    m = load_model(tiny_gguf("gemma3"), dtype="bfloat16")
    on, _ = measure(m, 2, 300, 2, None, prefix_cache=True, shared_prefix_len=280)
    off, _ = measure(m, 2, 300, 2, None, prefix_cache=False, shared_prefix_len=280)
    assert on["cached_prompt_tokens"] >= 2 * 256 and off["cached_prompt_tokens"] == 0  # (a full page each)
    for row in (on, off):
        assert row["num_preemptions"] == 0 and row["recomputed_tokens"] == 0
        assert row["prefill_tokens"] == 2 * 300 - row["cached_prompt_tokens"] + row["recomputed_tokens"]
        assert row["prefill_tok_s"] == pytest.approx(row["prefill_tokens"] / row["prefill_s"])
    assert on["prefill_tokens"] <= 2 * (300 - 256) and off["prefill_tokens"] == 600


def test_activation_flag_names_what_did_not_run():
    from workbench.bench import activation_flag

    assert activation_flag({"paged": True, "prefix_hit_tokens": 0}, prefix_cache=True, shared_prefix_len=300)
    assert "not paged" in activation_flag({"paged": False}, prefix_cache=True, shared_prefix_len=300)
    assert activation_flag({"paged": True, "prefix_hit_tokens": 256}, prefix_cache=True, shared_prefix_len=300) is None
    assert activation_flag({"paged": True, "prefix_hit_tokens": 0}, prefix_cache=False, shared_prefix_len=300) is None
    assert activation_flag({"paged": True, "prefix_hit_tokens": 0}, prefix_cache=True, shared_prefix_len=0) is None


def test_bench_shared_prefix_out_of_range_is_one_line(tiny_gguf, tmp_path, capsys):
    from workbench.cli import main

    rc = main(["bench", "--model", str(tiny_gguf("gemma3")), "--concurrency", "1", "--prompt-len", "16", "--gen", "2",
               "--shared-prefix-len", "16", "--data-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shared-prefix-len 16 is out of range: allowed 0..15" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_bench_host_store_too_small_for_one_request_is_one_line(tiny_gguf, tmp_path, capsys):
    from workbench.cli import main

    rc = main(["bench", "--model", str(tiny_gguf("gemma3")), "--concurrency", "1", "--prompt-len", "300", "--gen", "2",
               "--kv-host-tokens", "16", "--data-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-host-tokens 16 cannot hold one request" in err[0] and "allowed >= 512" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_bench_rows_prove_host_backing_ran_or_flag_it(tiny_gguf, tmp_path):
    """--kv-host-tokens: four 300-token requests on a two-page pool page out and in (the row's
    counters), and one request alone on the same pool shows none of it and is flagged."""
    from workbench.bench import run_bench
    from workbench.model import load_model

    m = load_model(tiny_gguf("llama"), dtype="bfloat16")
    _, rows = run_bench(m, concurrency=[1, 4], prompt_len=300, gen=40, chunk=64, repeats=1, data_dir=str(tmp_path),
                        kv_resident_tokens=1024, kv_host_tokens=4096, residency_quantum=4, progress=lambda line: None)
    alone, four = rows
    assert alone["pages_out"] == 0 and "host backing asked, but no page was paged out" in alone["flag"]
    assert four["pages_out"] > 0 and four["pages_out"] == four["pages_in"] and four["num_swaps"] > 0
    assert four["bytes_out"] > 0 and four["flag"] is None and four["matches_solo"]


def test_prefill_rate_counts_the_admitted_tokens_with_compression(tiny_gguf):
    """--prompt-compression: prefill tok/s counts the effective (admitted) prompt tokens, and the
    row carries raw and effective sums, how many requests compressed and the scorer's time; off,
    raw equals effective and nothing is counted as compressed. (llama: every layer global, so
    the default scorer has a layer that scores.)"""
    from workbench.bench import measure

    m = load_model(tiny_gguf("llama"), dtype="bfloat16")
    on, _ = measure(m, 2, 300, 2, None, prompt_compression=0.5)
    off, _ = measure(m, 2, 300, 2, None)
    assert on["raw_prompt_tokens"] == off["raw_prompt_tokens"] == off["effective_prompt_tokens"] == 600
    assert on["num_compressed"] == 2 and on["compress_s"] > 0
    assert off["num_compressed"] is None and off["compress_s"] is None
    assert abs(on["effective_prompt_tokens"] - 300) <= 2 * 16  # half of each, to half a 32-token block
    for row in (on, off):
        assert row["prefill_tokens"] == (row["effective_prompt_tokens"] - row["cached_prompt_tokens"]
                                         + row["recomputed_tokens"])
        assert row["prefill_tok_s"] == pytest.approx(row["prefill_tokens"] / row["prefill_s"])


def test_bench_prompt_compression_flags_a_run_that_compressed_nothing(tiny_gguf, tmp_path, capsys):
    """`auto` leaves a 200-token prompt whole (below its threshold): the row is flagged and says
    so on stdout; a ratio compresses it, unflagged; the params record what was asked."""
    from workbench.cli import main

    base = ["bench", "--model", str(tiny_gguf("llama")), "--concurrency", "1", "--prompt-len", "200", "--gen", "2",
            "--no-progress"]
    assert main([*base, "--prompt-compression", "auto", "--data-dir", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out
    assert ("prompt compression auto, concurrency 1: prompt tokens 200 raw, 200 admitted, 0 of 1 requests "
            "compressed -- FLAGGED: prompt compression auto asked, but no prompt was compressed") in out
    (run_dir,) = (tmp_path / "auto" / "runs").iterdir()
    rows = pl.read_parquet(run_dir / "summary.parquet")
    assert rows["flag"].to_list() == [
        "prompt compression auto asked, but no prompt was compressed (auto leaves a prompt below its threshold whole)"]
    assert rows["raw_prompt_tokens"].to_list() == rows["effective_prompt_tokens"].to_list() == [200]
    assert rows["prompt_compression"].to_list() == ["auto"] and rows["num_compressed"].to_list() == [0]

    assert main([*base, "--prompt-compression", "0.5", "--data-dir", str(tmp_path / "half")]) == 0
    assert "FLAGGED" not in capsys.readouterr().out
    (run_dir,) = (tmp_path / "half" / "runs").iterdir()
    rows = pl.read_parquet(run_dir / "summary.parquet")
    assert rows["flag"].is_null().all() and rows["num_compressed"].to_list() == [1]
    assert rows["raw_prompt_tokens"].to_list() == [200] and 0 < rows["effective_prompt_tokens"][0] < 200
    assert rows["prompt_compression"].to_list() == ["0.5"]


def test_bench_scored_eviction_shows_its_evictions_or_is_flagged(tiny_gguf, tmp_path):
    """--eviction scored: a shared prefix primes the cache alone (its second full page holds
    its own tokens past the prefix, so no measured request hits it), then the measured requests
    need the page that one holds, so it is evicted (pages_evicted); the same run on a pool that
    holds everything evicts none and is flagged."""
    from workbench.bench import run_bench
    from workbench.model import load_model

    m = load_model(tiny_gguf("llama", "Q8_0"), dtype="float32")
    for pool, evicts in ((5 * 256, True), (16 * 256, False)):
        _, rows = run_bench(m, concurrency=[2], prompt_len=600, gen=4, chunk=None, repeats=1,
                            data_dir=str(tmp_path), kv_resident_tokens=pool, shared_prefix_len=260,
                            eviction="scored", progress=lambda line: None)
        (r,) = rows
        assert (r["pages_evicted"] > 0) is evicts and r["prefix_hit_tokens"] > 0
        assert (r["flag"] is None) is evicts
        if not evicts:
            assert r["flag"].startswith("eviction='scored' asked, but no cached page was evicted")


def test_activation_flag_names_compression_that_did_not_run():
    from workbench.bench import activation_flag

    none = {"paged": True, "prefix_hit_tokens": 0, "num_compressed": 0}
    assert "a whole block" in activation_flag(none, prefix_cache=True, shared_prefix_len=0, prompt_compression=0.25)
    assert activation_flag({**none, "num_compressed": 1}, prefix_cache=True, shared_prefix_len=0,
                           prompt_compression=0.25) is None
    assert activation_flag(none, prefix_cache=True, shared_prefix_len=0, prompt_compression="off") is None
    both = activation_flag(none, prefix_cache=True, shared_prefix_len=300, prompt_compression="auto")
    assert both.startswith("a shared prefix with the prefix cache asked") and "; prompt compression auto asked" in both


@pytest.mark.parametrize("text,needle", [
    ("half", "'half' is not allowed: allowed off, auto or a ratio in (0, 1]"),
    ("1.5", "1.5 is out of range: allowed off, auto or a ratio in (0, 1]"),
    ("0", "0 is out of range: allowed off, auto or a ratio in (0, 1]"),
    ("nan", "nan is out of range"),
])
def test_bench_bad_prompt_compression_is_one_line(text, needle, tmp_path, capsys):
    """A bad --prompt-compression: one line naming the value and what is allowed, exit 2, before
    any model is read (the model path does not exist)."""
    from workbench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompt-compression", text, "--model", str(tmp_path / "absent.gguf")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("workbench bench: error: argument --prompt-compression: "), err
    assert needle in err, err
