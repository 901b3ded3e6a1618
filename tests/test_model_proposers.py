"""Model-based proposers (issue 21): the self-draft (the target's first K layers and its head)
and a draft GGUF given by path. Whatever they draft, the output is bitwise speculation-off's;
a draft that is the target itself drafts the target's own tokens, so every draft is kept."""

import pytest
import torch

import workbench
from workbench.errors import ConfigError, WorkbenchError
from workbench.spec import SpecConfig

from test_paged_engine import _no_page_left, _same
from test_speculation import TRITON_GRAPHS, _engine, _ids, _refs, _run


def _check_draft_pages_freed(e):
    p = e.speculator.proposer
    assert p.alloc.num_sequences == 0 and not p.fed
    for pool in p.alloc.pools.values():
        assert pool.num_available == pool.num_pages


@pytest.mark.parametrize("n", [1, 4])
def test_a_self_draft_is_bitwise_ar_and_runs_its_layers(tiny_model, n):
    m = tiny_model("gemma3", "float32", "Q8_0", n_layers=3, sliding_window=8)
    prompts = [_ids(6 + 9 * i, 30 + i, vocab=m.config.vocab_size) for i in range(n)]
    max_tokens = [10 + 3 * (i % 2) for i in range(n)]
    refs = _refs(m, prompts, max_tokens)
    e = _engine(m, n, SpecConfig(proposer="self", draft_layers=2, k=3, guard=False))
    p = e.speculator.proposer
    assert p.name == "self:2" and len(p.model.layers) == 2 and p.model.layers[0] is m.layers[0]
    out = _run(e, prompts, max_tokens)
    for r, ref in zip(out, refs):
        _same(r, ref)
        assert r.spec.verify_steps > 0 and r.spec.drafted > 0
    # the draft ran batched: k rounds a step, not k per request
    assert p.stats.forwards <= 3 * sum(r.spec.verify_steps for r in out)
    # every drafted token the target verified came from the draft's forwards
    assert p.stats.tokens >= sum(r.spec.drafted for r in out) and p.stats.rows > p.stats.tokens
    _no_page_left(e)
    _check_draft_pages_freed(e)


@pytest.mark.parametrize("n", [1, 4])
def test_the_target_as_its_own_draft_gguf_is_kept_whole(tiny_model, n):
    m = tiny_model("gemma3", "float32", "Q8_0")
    prompts = [_ids(5 + 11 * i, 40 + i, vocab=m.config.vocab_size) for i in range(n)]
    refs = _refs(m, prompts, 13)
    e = _engine(m, n, SpecConfig(proposer="draft", draft_model=str(m.path), k=4, guard=False))
    out = _run(e, prompts, 13)
    for r, ref in zip(out, refs):
        _same(r, ref)
        # the draft is the target: every draft token is its own pick (bursts of 4 + 1)
        assert r.spec.drafted == r.spec.accepted > 0 and r.spec.hist[4] >= 2
    _check_draft_pages_freed(e)


def test_a_draft_gguf_with_another_vocabulary_is_refused(tiny_model):
    from workbench.default_model import default_model_path

    m = tiny_model("gemma3", "float32", "Q8_0")
    with pytest.raises(WorkbenchError, match=r"the draft model .* has another vocabulary \(262144 tokens\) than the "
                                             r"model .* allowed a draft with the same tokenizer"):
        _engine(m, 1, SpecConfig(proposer="draft", draft_model=str(default_model_path())))
    with pytest.raises(WorkbenchError, match="is not a file: allowed a path to a .gguf file"):
        _engine(m, 1, SpecConfig(proposer="draft", draft_model="/nonexistent.gguf"))


def test_self_draft_layers_out_of_range_are_refused(tiny_model):
    m = tiny_model("gemma3", "float32", "Q8_0")  # 2 layers
    with pytest.raises(WorkbenchError, match=r"draft_layers=2 is out of range for this model: allowed an integer 1..1"):
        _engine(m, 1, SpecConfig(proposer="self", draft_layers=2))
    for kw, msg in [(dict(proposer="self"), "needs draft_layers"),
                    (dict(proposer="ngram", draft_layers=1), "allowed with proposer='self' only"),
                    (dict(proposer="draft"), "needs draft_model"),
                    (dict(proposer="suffix", draft_model="x.gguf"), "allowed with proposer='draft' only"),
                    (dict(proposer="self", draft_layers=1, draft_kv_tokens=0), "draft_kv_tokens=0 is out of range")]:
        with pytest.raises(ConfigError, match=msg):
            SpecConfig(**kw)


def test_a_draft_pool_too_small_drafts_less_and_stays_exact(tiny_model):
    """Four requests share a draft pool of 2 pages of 256 positions (the torch pages): some find
    no room and decode plainly that step; the output is unchanged."""
    m = tiny_model("gemma3", "float32", "Q8_0", n_layers=3)
    prompts = [_ids(200 + 30 * i, 50 + i, vocab=m.config.vocab_size) for i in range(4)]
    refs = _refs(m, prompts, 6)
    e = _engine(m, 4, SpecConfig(proposer="self", draft_layers=1, k=2, guard=False, draft_kv_tokens=512))
    out = _run(e, prompts, 6)
    for r, ref in zip(out, refs):
        _same(r, ref)
    p = e.speculator.proposer
    assert p.stats.full > 0 and sum(r.spec.empty for r in out) > 0 and sum(r.spec.verify_steps for r in out) > 0
    _check_draft_pages_freed(e)


# ---- the Triton runner (the interpreter here, natively on the device) -------------------------

def _triton(m, n, spec=None):
    from workbench.runners.triton_options import TritonOptions

    cfg = workbench.EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=n, max_context=64,
                                 memory_budget_bytes=1 << 30, chunk_size=8, speculation=spec,
                                 triton=TritonOptions(graphs=TRITON_GRAPHS, page_size=64))
    return workbench.Engine(m, cfg, keep_logits=True)


@pytest.mark.parametrize("proposer", ["self", "draft"])
def test_triton_model_drafts_are_bitwise_plain_decoding(tiny_model, proposer):
    """Two slots on the Triton runner drafting with the self-draft (sharing the target runner's
    device weights) or the target's own GGUF: tokens and logits are plain decoding's."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=8)
    prompts = [_ids(n, 80 + n, vocab=m.config.vocab_size) for n in (5, 12)]
    kw = dict(max_tokens=7, ignore_eos=True)
    plain = _triton(m, 2).generate(prompts, **kw)
    spec = (SpecConfig(proposer="self", draft_layers=1, k=3, guard=False) if proposer == "self"
            else SpecConfig(proposer="draft", draft_model=str(m.path), k=3, guard=False))
    e = _triton(m, 2, spec)
    out = e.generate(prompts, **kw)
    for r, s in zip(out, plain):
        assert r.token_ids == s.token_ids and torch.equal(r.logits, s.logits)
        assert r.spec.verify_steps > 0
    p = e.speculator.proposer
    if proposer == "self":
        assert p.runner.layers[0] is e.runner.layers[0] and p.runner.fixed_bytes == 0
    else:
        assert all(r.spec.drafted == r.spec.accepted for r in out)
    _check_draft_pages_freed(e)


def test_bench_spec_self_rows_prove_the_draft_ran(tiny_gguf, tmp_path):
    import polars as pl

    from workbench.cli import main

    rc = main(["bench", "--model", str(tiny_gguf("gemma3", n_layers=3)), "--concurrency", "2", "--prompt-len", "24",
               "--gen", "6", "--spec", "self:1", "--spec-k", "2", "--no-spec-guard", "--data-dir", str(tmp_path),
               "--no-progress"])
    assert rc == 0
    [summary] = list(tmp_path.glob("runs/*/summary.parquet"))
    row = pl.read_parquet(summary).row(0, named=True)
    assert row["speculation"] == "self:1:k2+noguard" and row["draft_forwards"] > 0 and row["draft_ms"] > 0
    assert row["spec_verify_steps"] > 0 and row["flag"] is None


def test_bench_spec_bad_proposers_are_one_line(tiny_gguf, tmp_path, capsys):
    from workbench.cli import main

    base = ["bench", "--model", str(tiny_gguf("gemma3")), "--concurrency", "1", "--prompt-len", "16", "--gen", "2",
            "--data-dir", str(tmp_path), "--no-progress"]
    with pytest.raises(SystemExit) as e:
        main([*base, "--spec", "self"])
    assert e.value.code == 2
    assert "allowed ngram, suffix, self:K" in capsys.readouterr().err
    assert main([*base, "--spec", "draft:/nonexistent.gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculation draft_model='/nonexistent.gguf' is not a file" in err[0]
    assert main([*base, "--spec", "self:2"]) == 2  # (the tiny model has 2 layers)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "draft_layers=2 is out of range for this model: allowed an integer 1..1" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_draft_yield_ablation_takes_model_proposers():
    from workbench import ablations

    got = ablations.validate("draft-yield", {"proposers": ["ngram", "self:4", "draft:/x.gguf"]})
    assert got["proposers"] == ["ngram", "self:4", "draft:/x.gguf"]
    with pytest.raises(WorkbenchError, match="'self:K'"):
        ablations.validate("draft-yield", {"proposers": ["self"]})
