"""Prompt compression before admission (workbench/compression.py): options refused with one
line, the kept set's invariants, the scorer's layer stack held to Model.logits bitwise, and the
engine: "off" changes nothing, a compressed request is bitwise the kept prompt submitted
directly, usage reports raw and effective tokens. Random-weight models: plumbing, no quality
claim (scripts/compression_quality.py measures that on the real model)."""

from __future__ import annotations

import random

import pytest
import torch

from workbench import Engine, EngineConfig
from workbench.compression import (CompressionOptions, DeviceScorer, candidate_blocks, compress, load_scorer,
                                   run_layers, scorer_device, scoring_layers, select_blocks, window_scores)
from workbench.compression_quality import compare, needle_prompt, needle_trial
from workbench.errors import ConfigError, WorkbenchError
from workbench.linear import linear
from workbench.model import rms_norm

# small enough for 100-300-token prompts of the tiny models
SMALL = CompressionOptions(window=16, block_size=8, sink_tokens=4)


def _prompt(n: int, seed: int, vocab: int = 390) -> list[int]:
    rnd = random.Random(seed)
    return [2] + [rnd.randrange(4, vocab) for _ in range(n - 1)]


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(max_concurrency=4, dtype=model.dtype_name, max_context=512, **kw),
                  keep_logits=True)


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert torch.equal(a.logits, b.logits)


# -- options -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(prompt_compression=1.5), "prompt_compression=1.5 is out of range: allowed 'off', 'auto' or a ratio in (0, 1]"),
    (dict(prompt_compression=0), "prompt_compression=0 is out of range: allowed 'off', 'auto' or a ratio in (0, 1]"),
    (dict(prompt_compression=True), "prompt_compression=True is out of range: allowed"),
    (dict(prompt_compression="half"), "prompt_compression='half' is not allowed: allowed 'off', 'auto' or a ratio"),
    (dict(compression=CompressionOptions(window=8)), "compression options are prompt compression's: allowed with "
                                                     "prompt_compression 'auto' or a ratio only"),
    (dict(prompt_compression="auto", compression={"window": 8}), "compression={'window': 8} is not allowed: "
                                                                 "allowed a CompressionOptions"),
])
def test_engine_config_refuses_bad_compression(kw, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(scorer="oracle"), "compression.scorer='oracle' is not allowed: allowed target, draft"),
    (dict(scorer="draft"), "compression.scorer='draft' needs compression.draft_path: allowed a path"),
    (dict(draft_path="d.gguf"), "compression.draft_path is the draft scorer's: allowed with scorer='draft' only"),
    (dict(window=0), "compression.window=0 is out of range: allowed an integer >= 1"),
    (dict(block_size=2.5), "compression.block_size=2.5 is out of range: allowed an integer >= 1"),
    (dict(sink_tokens=-1), "compression.sink_tokens=-1 is out of range: allowed an integer >= 0"),
    (dict(pool="sum"), "compression.pool='sum' is not allowed: allowed mean, max"),
    (dict(score_layers="sliding"), "compression.score_layers='sliding' is not allowed: allowed global, all"),
    (dict(auto_kept_tokens=9000), "compression.auto_kept_tokens=9000 is out of range: allowed 36..8192"),
    (dict(device="tpu"), "compression.device='tpu' is not allowed: allowed auto, cpu, cuda"),
])
def test_options_refuse_bad_values(kw, message):
    with pytest.raises(ConfigError) as e:
        CompressionOptions(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_round_trips_and_ratio_is_a_float():
    cfg = EngineConfig(prompt_compression=1, compression=CompressionOptions(window=8, pool="mean"))
    assert cfg.prompt_compression == 1.0 and isinstance(cfg.prompt_compression, float)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown compression key.*'windw'.*valid keys: scorer"):
        EngineConfig.from_dict({**cfg.to_dict(), "compression": {"windw": 8}})


def test_scorer_without_a_global_layer_is_refused(tiny_model, tiny_gguf):
    gemma = tiny_model("gemma3", "float32")  # two layers, both sliding
    with pytest.raises(WorkbenchError, match=r"num_layers=6 holds no full-attention layer of the scorer: "
                                             r"allowed score_layers='all'$"):
        Engine(gemma, EngineConfig(dtype="float32", prompt_compression=0.5))
    llama = tiny_model("llama", "bfloat16")
    with pytest.raises(WorkbenchError, match="is not a file: allowed a path to a .gguf file"):
        load_scorer(llama, CompressionOptions(scorer="draft", draft_path="/nonexistent.gguf"))


def test_draft_scorer_needs_the_same_vocabulary(tiny_model, tiny_gguf):
    from workbench.default_model import default_model_path

    llama = tiny_model("llama", "bfloat16")
    draft = load_scorer(llama, CompressionOptions(scorer="draft", draft_path=str(tiny_gguf("gemma3", n_layers=6))))
    assert draft is not llama and draft.config.n_layers == 6
    cp = compress(draft, _prompt(200, 0), 0.5, CompressionOptions(scorer="draft", draft_path=str(draft.path),
                                                                  window=16, block_size=8))
    assert cp.compressed and cp.scores.layers == (5,)  # the draft's own first global layer
    with pytest.raises(WorkbenchError) as e:  # Gemma 3's 262,144-token vocabulary against the tiny one
        load_scorer(llama, CompressionOptions(scorer="draft", draft_path=str(default_model_path())))
    assert "has another vocabulary (262144 tokens) than the model" in str(e.value)
    assert "allowed a draft with the same tokenizer" in str(e.value)


# -- the kept set --------------------------------------------------------------------------

@pytest.mark.parametrize("n, ratio", [(300, 0.25), (300, 0.5), (157, 0.4), (101, 0.9), (64, 0.1)])
def test_kept_set_sinks_tail_order_ratio_blocks(tiny_model, n, ratio):
    m = tiny_model("llama", "bfloat16")
    ids = _prompt(n, seed=n)
    cp = compress(m, ids, ratio, SMALL)
    again = compress(m, ids, ratio, SMALL)
    assert cp.kept_ids == again.kept_ids and cp.kept_positions == again.kept_positions  # deterministic
    pos = cp.kept_positions
    assert list(pos) == sorted(set(pos))  # in order, each once
    assert cp.kept_ids == tuple(ids[p] for p in pos)
    assert set(range(4)) <= set(pos) and set(range(n - 16, n)) <= set(pos)  # sinks and the tail
    assert cp.raw_tokens == n and cp.effective_tokens == len(pos)
    blocks = candidate_blocks(n, SMALL)
    always = n - 8 * len(blocks)  # the sinks, the tail and the remainder no whole block holds
    # the asked ratio to half a block (or all that is always kept, when that is more)
    assert abs(len(pos) - max(ratio * n, always)) <= SMALL.block_size / 2 + 1
    middle = set(pos) - set(range(4)) - set(range(n - 16, n))
    for a, b in blocks:  # whole blocks only
        assert b - a == 8 and (set(range(a, b)) <= middle or not set(range(a, b)) & middle)
    assert cp.compressed == (len(pos) < n)


def test_select_blocks_breaks_ties_by_position():
    blocks = candidate_blocks(100, SMALL)  # 10 blocks of 8 between 4 sinks and a 16-token tail
    flat = torch.zeros(100, dtype=torch.float64)
    assert select_blocks(flat, blocks, 3, SMALL) == [0, 1, 2]
    scores = flat.clone()
    scores[60] = scores[20] = 1.0  # blocks 7 and 2, tied
    assert select_blocks(scores, blocks, 1, CompressionOptions(spread=0)) == [2]
    assert select_blocks(scores, blocks, 2, CompressionOptions(spread=0)) == [2, 7]
    # spread: a score 1 token before a boundary lifts the next block too (block 3 spans 28..35)
    edge = flat.clone()
    edge[35] = 1.0
    assert select_blocks(edge, blocks, 2, CompressionOptions(spread=2, block_size=8)) == [3, 4]


def test_short_prompts_and_auto_below_threshold_are_left_whole(tiny_model):
    m = tiny_model("llama", "bfloat16")
    ids = _prompt(120, 3)
    for mode, opts in ((1.0, SMALL), ("auto", SMALL), (0.5, CompressionOptions(window=200))):
        cp = compress(m, ids, mode, opts)
        assert not cp.compressed and cp.kept_ids == tuple(ids) and cp.scores is None
    auto = compress(m, ids, "auto", CompressionOptions(window=16, block_size=8, auto_min_tokens=100, auto_kept_tokens=40))
    assert auto.compressed and abs(auto.effective_tokens - 40) <= 8


# -- the scorer ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch, dtype", [("gemma3", "float32"), ("llama", "bfloat16")])
def test_scorer_layer_stack_is_the_model_bitwise(tiny_model, arch, dtype):
    """run_layers over every layer, then the output head: the last row is Model.logits' bitwise
    (chunks of 512 and 100 rows, across the tiny gemma's 64-token sliding window)."""
    m = tiny_model(arch, dtype)
    ids = _prompt(601, 7)
    ref = m.logits(ids)[-1]
    for chunk in (512, 100):
        last, queries, keys = run_layers(m, ids, m.config.n_layers, 16, chunk)
        got = linear(rms_norm(last[None], m.output_norm, m.config.rms_eps), m.head)[0]
        assert torch.equal(got, ref)
        assert [q.shape for q in queries] == [(16, m.config.n_heads, m.config.head_dim)] * m.config.n_layers
        assert [k.shape for k in keys] == [(601, m.config.n_kv_heads, m.config.head_dim)] * m.config.n_layers


def test_window_scores_are_probabilities_of_the_window(tiny_model):
    m = tiny_model("gemma3", "float32")
    ids = _prompt(300, 1)
    s = window_scores(m, ids, (0, 1), 16)
    # each window row's softmax sums to 1 per head per layer; no key after the last row
    assert s.shape == (300,) and float(s.min()) >= 0
    assert abs(float(s.sum()) - 2 * m.config.n_heads * 16) < 1e-6
    one = window_scores(m, ids, (1,), 16)
    assert not torch.equal(one, s) and abs(float(one.sum()) - m.config.n_heads * 16) < 1e-6
    # a chunking of the scorer's prefill changes no bit
    assert torch.equal(window_scores(m, ids, (0, 1), 16, chunk_size=37), s)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_the_device_scorer_scores_as_the_cpu_scorer_to_rounding(tiny_model, arch):
    """DeviceScorer's own loop (SDPA attention, chunks of its own size, sliding windows) run on
    the CPU: the same scores as the reference path to float rounding, and so the same blocks."""
    m = tiny_model(arch, "float32")
    ids = _prompt(600, 5)
    layers = tuple(range(m.config.n_layers))
    ref = window_scores(m, ids, layers, 16)
    for chunk in (64, 2048):
        got = DeviceScorer(m, m.config.n_layers, "cpu", chunk_rows=chunk).window_scores(ids, layers, 16)
        assert got.dtype == torch.float64 and got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-6), float((got - ref).abs().max())
    opts = CompressionOptions(window=16, block_size=8, sink_tokens=2, score_layers="all")
    kept = compress(m, ids, 0.25, opts, DeviceScorer(m, m.config.n_layers, "cpu"))
    assert kept.kept_ids == compress(m, ids, 0.25, opts).kept_ids and kept.compressed


def test_the_scorer_device_resolves_and_cuda_is_refused_without_one(tiny_model):
    cpu_only = not torch.cuda.is_available()
    assert scorer_device(CompressionOptions(), "torch") == "cpu"
    assert scorer_device(CompressionOptions(device="cpu"), "triton") == "cpu"
    assert scorer_device(CompressionOptions(), "triton") == ("cpu" if cpu_only else "cuda")
    if cpu_only:
        with pytest.raises(ConfigError) as e:
            Engine(tiny_model("llama", "float32"), EngineConfig(prompt_compression="auto",
                                                                compression=CompressionOptions(device="cuda")))
        assert str(e.value) == ("compression.device='cuda' needs a CUDA device, and this machine has none: "
                                "allowed 'cpu' or 'auto' here")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_the_cuda_scorer_keeps_the_cpu_scorers_blocks(tiny_model):
    m = tiny_model("gemma3", "float32")
    ids = _prompt(900, 9)
    opts = CompressionOptions(window=16, block_size=8, sink_tokens=2, score_layers="all")
    layers = scoring_layers(m.config, opts)
    on = DeviceScorer(m, max(layers) + 1, "cuda")
    got, ref = on.window_scores(ids, layers, 16), window_scores(m, ids, layers, 16)
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-5), float((got - ref).abs().max())
    eng = Engine(m, EngineConfig(backend="triton", prompt_compression=0.25, compression=opts, max_context=1024))
    assert eng.compressor.device == "cuda"
    kept = eng.compressor.compress(ids)
    assert kept.kept_ids == compress(m, ids, 0.25, opts, on).kept_ids and kept.scores.device == "cuda"


# -- the engine ----------------------------------------------------------------------------

def test_off_and_nothing_compressed_leave_the_engine_bitwise_unchanged(tiny_model):
    m = tiny_model("llama", "bfloat16")
    prompts = [_prompt(n, n) for n in (40, 130, 7)]
    base = _engine(m).generate(prompts, max_tokens=6, ignore_eos=True)
    for kw, asked in ((dict(prompt_compression="off"), "off"), (dict(prompt_compression=1.0, compression=SMALL), "1"),
                      (dict(prompt_compression="auto", compression=SMALL), "auto")):
        eng = _engine(m, **kw)
        got = eng.generate(prompts, max_tokens=6, ignore_eos=True)
        for a, b, p in zip(got, base, prompts):
            _same(a, b)
            assert a.raw_prompt_tokens == a.effective_prompt_tokens == len(p)
        rows = eng.telemetry.requests()
        assert rows["compressed"].to_list() == [False] * 3  # asked (or not) and compressed nothing: says so
        assert rows["prompt_compression"].to_list() == [asked] * 3


def test_compressed_request_is_the_kept_prompt_submitted_directly(tiny_model):
    m = tiny_model("llama", "bfloat16")
    prompts = [_prompt(n, n) for n in (300, 170, 250)]
    eng = _engine(m, prompt_compression=0.3, compression=SMALL)
    got = eng.generate(prompts, max_tokens=8, ignore_eos=True)
    kept = [list(compress(m, p, 0.3, SMALL).kept_ids) for p in prompts]
    direct = _engine(m).generate(kept, max_tokens=8, ignore_eos=True)
    rows = eng.telemetry.requests().sort("request_id")
    for r, d, p, k in zip(got, direct, prompts, kept):
        _same(r, d)
        assert r.prompt_ids == p and r.effective_prompt_ids == k  # raw kept as prompt_ids
        assert r.raw_prompt_tokens == len(p) and r.effective_prompt_tokens == len(k) < len(p)
        assert r.compression.compressed and r.compression.asked == "0.3"
    assert rows["raw_prompt_tokens"].to_list() == [len(p) for p in prompts]
    assert rows["prompt_tokens"].to_list() == [len(p) for p in prompts]  # usage bills raw
    assert rows["effective_prompt_tokens"].to_list() == [len(k) for k in kept]
    assert rows["compressed"].to_list() == [True] * 3 and rows["compress_s"].min() > 0
    assert rows["compress_device"].to_list() == ["cpu"] * 3 and eng.compressor.on_device is None


def test_compression_lets_a_prompt_longer_than_the_context_in(tiny_model):
    m = tiny_model("llama", "bfloat16")
    ids = _prompt(700, 5)
    with pytest.raises(WorkbenchError, match="prompt of 700 tokens does not fit the context of 512 tokens"):
        _engine(m).submit(ids)
    r = _engine(m, prompt_compression=0.25, compression=SMALL).submit(ids, max_tokens=2).result()
    assert r.raw_prompt_tokens == 700 and r.effective_prompt_tokens <= 175 + 8


def test_triton_backend_compressed_is_the_kept_prompt(tiny_model):
    """The scorer runs on the CPU torch model; the engine serves the kept prompt on the Triton
    runner (the interpreter without a GPU) bitwise as that prompt submitted directly."""
    from workbench.runners.triton_options import TritonOptions

    m = tiny_model("llama", "float32")
    opts = CompressionOptions(window=8, block_size=4, sink_tokens=2, device="cpu")
    cfg = dict(backend="triton", dtype="float32", max_concurrency=2, max_context=64,
               memory_budget_bytes=1 << 30, triton=TritonOptions(graphs=False))
    ids = _prompt(48, 11)
    eng = Engine(m, EngineConfig(prompt_compression=0.5, compression=opts, **cfg), keep_logits=True)
    got = eng.generate([ids], max_tokens=3, ignore_eos=True)[0]
    kept = compress(m, ids, 0.5, opts).kept_ids
    direct = Engine(m, EngineConfig(**cfg), keep_logits=True).generate([list(kept)], max_tokens=3, ignore_eos=True)[0]
    _same(got, direct)
    assert got.effective_prompt_ids == list(kept) and got.raw_prompt_tokens == 48


# -- quality plumbing ----------------------------------------------------------------------

def test_compare_is_exact_when_nothing_is_dropped_and_measures_when_it_is(tiny_model):
    m = tiny_model("llama", "bfloat16")
    ids = _prompt(200, 9)
    same = compare(m, ids, 1.0, SMALL, max_tokens=6)
    # nothing compressed: the teacher-forced kept side is the engine's own logits, so KL is 0
    assert not same.compressed and same.prefix_match == 6 and same.top1_agreement == 1.0 and same.mean_kl == 0.0
    lossy = compare(m, ids, 0.2, SMALL, max_tokens=6)
    assert lossy.compressed and lossy.effective_tokens < lossy.raw_tokens and lossy.num_tokens == 6
    assert 0 <= lossy.prefix_match <= 6 and 0 <= lossy.top1_agreement <= 1 and lossy.mean_kl > 0


def test_needle_prompt_plants_the_code_at_its_depth(real_model_bf16):
    m = real_model_bf16
    shallow, deep = (needle_prompt(m, 600, d, seed=4) for d in (0.1, 0.9))
    for nd in (shallow, deep):
        assert abs(len(nd.ids) - 600) <= 16
        assert m.detokenize([nd.ids[p] for p in nd.code_positions]) == nd.code and len(nd.code) == 6
        assert m.detokenize(nd.ids[-12:]).endswith(f"secret code for {nd.name} is")
    assert shallow.code_positions[0] < 0.25 * 600 < 0.75 * 600 < deep.code_positions[0]
    row = needle_trial(m, 600, 0.5, 0.5, seed=4, max_tokens=2)
    assert row["compressed"] and row["code"] == shallow.code
    assert set(row) >= {"retrieved_whole", "retrieved_kept", "code_kept", "prefix_match", "top1_agreement", "mean_kl"}
