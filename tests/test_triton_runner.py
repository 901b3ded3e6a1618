"""The Triton backend (workbench.runners: TritonRunner and its TritonOptions) on tiny models.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py
before triton is imported): slow but exact, so the models are tiny. On a CUDA machine the same
tests run natively (tl.dot forms, CUDA graphs for decode steps).

The runner is paged: its KV lives in pages allocated once, and every segment names its pages.
Tests that call `runner.run` themselves get pool and tables from a `DirectPages` (one per
runner: the scheduler's page bookkeeping without the scheduler); `TritonOptions(page_size=64)`
where a test should cross pages in a short prompt.
"""

from __future__ import annotations

import pytest
import torch

from workbench import Engine, EngineConfig
from workbench.engine_config import ConfigError
from workbench.errors import WorkbenchError
from workbench.model import Segment as ModelSegment
from workbench.runners import triton_layers
from workbench.runners.direct_pages import DirectPages
from workbench.runners.triton_options import TritonOptions
from workbench.runners.triton_runner import TritonRunner
from workbench.scheduler import Segment

WINDOW = 8  # small sliding window, so that short prompts cross it
GRAPHS = True if torch.cuda.is_available() else "emulate"  # the graph path: CUDA graphs, or replayed eagerly


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm())


def _tokens(m, seed: int, *lengths: int) -> list[list[int]]:
    """Seeded random token lists of these lengths over m's vocabulary (one generator, in order)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, m.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _prompts(m, seed: int, *lengths: int) -> list[list[int]]:
    """Seeded random prompts (tokens 4.. of m's vocabulary) of these lengths (one generator, in order)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, m.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _config(dtype: str, concurrency: int, graphs, chunk_size: int | None = None, **options) -> EngineConfig:
    return EngineConfig(backend="triton", dtype=dtype, max_concurrency=concurrency, chunk_size=chunk_size,
                        max_context=64, memory_budget_bytes=1 << 30, triton=TritonOptions(graphs=graphs, **options))


def _solo(r, pages, a, n):
    """Sequence "a" in slot 0 prefilled with a[:n], then one decode step (a[n]): logits [2, vocab]."""
    got = [r.run([pages.segment(0, "a", a[:n], 0)], {0: 64})[0]]
    got.append(r.run([pages.segment(0, "a", (a[n],), n)], {0: 64})[0])
    return torch.stack(got)


def _assert_batched_is_solo(r, pages, a, b, n, solo):
    """The same two forwards for a new sequence "a2" in slot 0, batched with slot 1's prefill of
    b[:-1] and its decode step b[-1]: slot 0's logits bitwise ``solo``. "a" is freed first, so
    that its page, a's KV still in it, is reused by one of them (2 pages per group)."""
    pages.free("a")
    k = len(b) - 1
    o = r.run([pages.segment(1, "b", b[:k], 0), pages.segment(0, "a2", a[:n], 0)], {0: 64, 1: 64})
    assert torch.equal(o[0], solo[0])
    o = r.run([pages.segment(0, "a2", (a[n],), n), pages.segment(1, "b", (b[k],), k)], {0: 64, 1: 64})
    assert torch.equal(o[0], solo[1])


def _unowned_pages_untouched(r, pages) -> None:
    """After forwards on a pool poisoned with NaN (`DevicePages.poison`), where no page that a
    forward wrote has been freed since: every page no sequence holds is still NaN in every layer,
    K and V (the forwards wrote only their own pages). The scratch page is not an allocator page
    (graph padding rows write it)."""
    for g, pool in pages.allocator.pools.items():
        free = [p for p in range(pool.num_pages) if pool.refcount[p] == 0]
        assert free, f"group {g}: every page is held, so nothing is checked"
        for t in (r.kv.k[g], r.kv.v[g]):
            assert torch.isnan(t[:, free]).all(), g


@pytest.mark.parametrize("arch,weight_type", [("gemma3", "Q8_0"), ("llama", "Q5_0")])
def test_logits_close_to_torch(tiny_model, arch, weight_type):
    """Teacher-forced: chunked prefill then decode steps, triton vs the torch reference (fp32).
    Llama checks the NORM-rope row permutation; gemma3 the QK-norm, post-norms and window."""
    m = tiny_model(arch, "float32", weight_type, sliding_window=WINDOW)
    r = TritonRunner(m, 256)
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(0, m.config.vocab_size, (20,), generator=gen).tolist()
    with pytest.raises(RuntimeError, match="the KV pool is not allocated: call init_kv_pool first"):
        r.run([Segment(3, "a", tuple(toks[:7]), 0, False)], {3: 64})
    pages = DirectPages(r, tokens_per_group=256)
    r.kv.poison()  # (the forwards write every position they read)
    st = m.new_state(256)
    ctx = {3: 64}
    # chunk 1 (not sampled), chunk 2 (sampled), then decode
    assert r.run([pages.segment(3, "a", toks[:7], 0, samples=False)], ctx) == {}
    m.forward([ModelSegment(st, toks[:7], "none")])
    got = r.run([pages.segment(3, "a", toks[7:13], 7)], ctx)[3]
    ref = m.forward([ModelSegment(st, toks[7:13], "last")])[0][0]
    assert got.dtype == torch.float32 and got.shape == (m.config.vocab_size,)
    assert _rel(got, ref) < 1e-4
    for i in range(13, 18):
        got = r.run([pages.segment(3, "a", (toks[i],), i)], ctx)[3]
        ref = m.forward([ModelSegment(st, [toks[i]], "last")])[0][0]
        assert _rel(got, ref) < 1e-4, i
    with pytest.raises(RuntimeError, match="slot 3: a segment without block tables"):
        r.run([Segment(3, "a", (toks[18],), 18, True)], ctx)


def test_options_are_validated_and_reach_the_runner(tiny_model):
    """TritonOptions: bad names and values refused with one line naming the field and what is
    allowed; EngineConfig carries them to the runner (one object, no module globals) and round
    trips them through to_dict / from_dict; the torch backend refuses them; the options' format
    list is the kernels'; the products' precisions follow the engine's dtype."""
    from workbench.kernels.quant_tiles import FORMATS
    from workbench.runners import triton_options

    assert tuple(FORMATS) == triton_options.FORMATS
    for kw, message in [
        (dict(layer_forms={"Q8_0": "fast"}), "layer_forms['Q8_0']='fast' is not allowed: allowed mma, gemv"),
        (dict(layer_forms={"F32": "mma"}), "layer_forms: format 'F32' is not allowed: allowed Q8_0, Q5_0, Q4_K, Q6_K"),
        (dict(head_matmul="q8f16"), "head_matmul='q8f16' is not allowed: allowed dense, q8i8 or None"),
        (dict(graphs="sometimes"), "graphs='sometimes' is not allowed: allowed True, False, 'emulate'"),
        (dict(attn_segment=48), "attn_segment=48 is not allowed: allowed 32, 64, 128, 256"),
        (dict(products="fast"), "products='fast' is not allowed: allowed quant, cublas_bf16"),
        (dict(graph_history=0), "graph_history=0 is out of range: allowed 1..65536"),
        (dict(pdl=1), "pdl=1 is not allowed: allowed True, False"),
        (dict(attention_runs=4), "attention_runs=4 is not allowed: allowed True, False"),
    ]:
        with pytest.raises(ConfigError) as e:
            TritonOptions(**kw)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match="unknown triton option 'glu_in_down'; valid options: graphs, head_matmul"):
        TritonOptions.parse("glu_in_down=true")
    with pytest.raises(ConfigError, match="unknown triton option.*'persistent'"):
        TritonOptions.from_dict({"persistent": True})
    parsed = TritonOptions.parse("head_matmul=dense, pdl=off,layer_forms=Q8_0:mma+Q4_K:gemv,graphs=emulate")
    assert parsed == TritonOptions(head_matmul="dense", pdl=False, layer_forms={"Q4_K": "gemv", "Q8_0": "mma"},
                                   graphs="emulate")
    assert parsed.changed() == ["graphs", "head_matmul", "layer_forms", "pdl"]
    assert TritonOptions.parse("") == TritonOptions() and TritonOptions.parse("layer_forms=").forms == {}
    with pytest.raises(ConfigError, match=r"triton options \(pdl\) are the triton backend's: allowed with "
                                          r"backend='triton' only"):
        EngineConfig(triton=TritonOptions(pdl=False))
    with pytest.raises(ConfigError, match="head_matmul='dense' but triton.head_matmul='q8i8'"):
        EngineConfig(backend="triton", head_matmul="dense", triton=TritonOptions(head_matmul="q8i8"))
    cfg = _config("float32", 2, False, attn_segment=32, fuse_glu=False, head_matmul="dense")
    assert cfg.head_matmul == "dense"  # (the shorthand mirrors the options)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    r = Engine(m, cfg).runner
    assert r.options is cfg.triton and r.attn_segment == r.loop.segment == 32 and r.graphs is None
    assert not r.loop.fuse_glu and r.mma_prec == "tf32x3" and r.attn_prec is None
    r16 = TritonRunner(tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW), 64, TritonOptions(graphs=False))
    assert r16.mma_prec == "bf16" and r16.attn_prec == "bf16"
    with pytest.raises(WorkbenchError, match="options=.* is not allowed: allowed a TritonOptions"):
        TritonRunner(m, 64, {"graphs": False})


def test_engine_config_picks_the_head_form(tiny_model):
    """EngineConfig.head_matmul reaches the runner: by default a bfloat16 engine's Q8_0 head takes
    the int8 form (llama.cpp's quantized-activation numerics), a float32 engine's the dense copy;
    head_matmul="dense" asks for the copy; an int8 head for a head of another format is refused."""
    def eng(m, **kw):
        cfg = EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=2, max_context=64,
                           memory_budget_bytes=1 << 30, **kw)
        return Engine(m, cfg).runner.head_matmul

    bf16 = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    assert eng(bf16) == "q8i8" and eng(bf16, head_matmul="dense") == "dense"
    assert eng(bf16, triton=TritonOptions(head_matmul="dense")) == "dense"
    assert eng(tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)) == "dense"
    q5 = tiny_model("gemma3", "bfloat16", "Q5_0", sliding_window=WINDOW)
    assert eng(q5) == "dense"
    with pytest.raises(WorkbenchError, match="head_matmul='q8i8' reads a Q8_0 head; this head is Q5_0: allowed dense"):
        eng(q5, head_matmul="q8i8")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_batched_equals_solo(tiny_model, temperature):
    """Three slots (mixed prefill chunks + decode rows in one forward; prompts crossing the
    window) give bitwise the tokens and logits of each request run alone. The batched engine
    takes the graph path (3 rows padded to a bucket of 4, the pad row writing the scratch page:
    real CUDA graphs on a GPU, the same path replayed eagerly on the CPU); solo runs plain."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    prompts = _prompts(m, 2, 3, 11, 6)
    kw = dict(max_tokens=5, temperature=temperature, seed=7, ignore_eos=True)
    batched = Engine(m, _config("float32", 3, GRAPHS, chunk_size=4), keep_logits=True).generate(prompts, **kw)
    solo_eng = Engine(m, _config("float32", 1, False), keep_logits=True)
    solo = [solo_eng.submit(p, index=i, **kw).result() for i, p in enumerate(prompts)]  # one at a time
    for b, s in zip(batched, solo):
        assert b.token_ids == s.token_ids
        assert b.logits is not None and b.logits.shape == s.logits.shape
        assert torch.equal(b.logits.cpu(), s.logits.cpu())
    # the same requests on the torch backend: same tokens greedy (logits within fp32 tolerance)
    if temperature == 0.0:
        cfg = EngineConfig(backend="torch", dtype="float32", max_concurrency=3, max_context=64,
                           memory_budget_bytes=1 << 30)
        ref = Engine(m, cfg, keep_logits=True).generate(prompts, **kw)
        for b, t in zip(batched, ref):
            assert _rel(b.logits[0], t.logits[0]) < 1e-4
            assert b.token_ids == t.token_ids


@pytest.mark.parametrize("history", [1024, 3])
def test_decode_loop_matches_engine_steps(tiny_model, history):
    """The benchmark fast path (graph replays, greedy tokens fed back on the device) gives the
    tokens of step-by-step runs, kept in the graph's record (graph_history: gathered in chunks of
    that many steps, here 4 steps as 3 + 1); the loop runs on 64-position pages, the eager steps
    it is compared with on 256-position pages. A decode segment whose tables do not cover the
    steps is refused, and so is the loop without graphs."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    prompts = _prompts(m, 3, 5, 9)
    a = TritonRunner(m, 256, TritonOptions(graphs=GRAPHS, graph_history=history, page_size=64))
    b = TritonRunner(m, 256, TritonOptions(graphs=False))
    pa, pb = DirectPages(a, tokens_per_group=2 * 64), DirectPages(b, tokens_per_group=2 * 256)
    first, want = [], []
    for sl, p in enumerate(prompts):
        first.append(int(a.run([pa.segment(sl, sl, p, 0)], {sl: 32})[sl].argmax()))
        t = [int(b.run([pb.segment(sl, sl, p, 0)], {sl: 32})[sl].argmax())]
        for i in range(4):
            t.append(int(b.run([pb.segment(sl, sl, (t[-1],), len(p) + i)], {sl: 32})[sl].argmax()))
        want.append(t[1:])
    segs = [pa.segment(sl, sl, (first[sl],), len(p), reserve=4) for sl, p in enumerate(prompts)]
    with pytest.raises(WorkbenchError, match="slot 1: its block tables do not cover 56 steps from position 9"):
        a.decode_loop(segs, 56)  # (one 64-position page each: slot 0 fits 5 + 56, slot 1 not 9 + 56)
    with pytest.raises(WorkbenchError, match="decode_loop needs CUDA graphs"):
        b.decode_loop([], 4)
    hist = a.decode_loop(segs, 4)
    assert hist.T.tolist() == want
    assert a.launches > 0 and a.graphs.record.shape[1] == history


def test_scattered_pages_are_bitwise_consecutive_pages(tiny_model):
    """A sequence whose pages are scattered (other sequences hold pages, then free some, so
    that its pages come out non-consecutive and out of order between pages others hold) gives
    bitwise the logits of the same sequence on consecutive pages: 64-position pages, a prompt
    over two pages prefilled in two chunks and a two-row segment (chunk graphs), two decode
    steps between them (decode graphs). Llama: one global group, so every row reads all its
    keys through the table. Each pool is poisoned with NaN, so a read of a page the sequence
    does not hold would show; pages nobody holds stay untouched."""
    m = tiny_model("llama", "float32", "Q8_0")
    P = 64
    n = P + 2  # the prompt: positions 0..65, its logical pages 0 and 1
    toks = _tokens(m, 41, n + 4)[0]

    def run(scatter: bool):
        r = TritonRunner(m, 4 * P, TritonOptions(graphs=GRAPHS, page_size=P))
        pages = DirectPages(r, tokens_per_group=6 * P)
        r.kv.poison()
        # scattered: every page held by a one-token sequence (never run), so that freeing the
        # one on page 3 (then 1) leaves it the only free page, the next page of "x"
        owner = {pages.segment(0, f"f{i}", (1,), 0).block_tables["global"][0]: f"f{i}"
                 for i in range(6 if scatter else 0)}
        release = (lambda page: pages.free(owner[page])) if scatter else (lambda page: None)
        ctx = {0: 4 * P}
        release(3)
        assert r.run([pages.segment(0, "x", toks[:P], 0, samples=False)], ctx) == {}
        release(1)
        out = [r.run([pages.segment(0, "x", toks[P:n], P)], ctx)[0]]
        out += [r.run([pages.segment(0, "x", (toks[i],), i)], ctx)[0] for i in (n, n + 1)]
        seg = pages.segment(0, "x", toks[n + 2 : n + 4], n + 2)
        out.append(r.run([seg], ctx)[0])
        assert [b for b, _ in r.graphs.keys] == [1]  # (the decode steps took the graph path, 1 row)
        release(0)
        release(5)
        _unowned_pages_untouched(r, pages)
        return torch.stack(out), seg.block_tables["global"]

    got, scattered = run(True)
    want, consecutive = run(False)
    assert scattered == (3, 1) and consecutive[1] == consecutive[0] + 1
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("head", ["dense", "q8i8"])
def test_argmax_in_head_gives_the_same_tokens(tiny_model, monkeypatch, head):
    """argmax_in_head: the head's streaming programs keep the greedy argmax's first stage (one
    launch fewer per decode graph); the decode loop's tokens and last logits are the separate
    argmax's, for the dense and the int8 head (triton_layers.ARGMAX_IN_HEAD_FORMS: each form up
    to a bucket of so many rows; a bucket above the form's limit keeps the separate argmax)."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    a, b = _tokens(m, 21, 6, 11)

    def decode(**kw):
        r = TritonRunner(m, 256, TritonOptions(graphs=GRAPHS, head_matmul=head, **kw))
        pages = DirectPages(r, tokens_per_group=2 * 256)
        first = [int(r.run([pages.segment(sl, sl, p, 0)], {sl: 32})[sl].argmax()) for sl, p in enumerate((a, b))]
        segs = [pages.segment(sl, sl, (t,), len(p), reserve=4) for sl, (p, t) in enumerate(zip((a, b), first))]
        return r.decode_loop(segs, 4).tolist(), r.launches, r.graphs.logits[:2].clone()

    got = {on: decode(argmax_in_head=on) for on in (False, True)}
    assert got[True][0] == got[False][0]
    assert torch.equal(got[True][2], got[False][2])
    assert got[True][1] == got[False][1] - 1
    monkeypatch.setitem(triton_layers.ARGMAX_IN_HEAD_FORMS, head, 1)  # (2 rows: above the form's limit)
    above = decode()
    assert above[0] == got[True][0] and above[1] == got[False][1]


def test_unsupported_weights_raise(tiny_model):
    m = tiny_model("gemma3", "float32", "F32")
    with pytest.raises(WorkbenchError, match="quant type F32"):
        TritonRunner(m, 256)


@pytest.mark.parametrize("form", ["mma", "gemv"])
def test_bf16_engine_tokens_on_device(tiny_model, monkeypatch, form):
    """A bfloat16 engine (the tensor-core form with bf16 operands, or the FMA form): batched
    greedy requests whose logits nobody keeps get their tokens from the device argmax (no logits
    copy), and those tokens are the ones each request gets alone with its logits kept (host
    argmax); batched logits, when kept, equal the solo ones bitwise."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    prompts = _prompts(m, 5, 4, 10, 7)
    kw = dict(max_tokens=4, ignore_eos=True)

    def engine(concurrency, keep, graphs):
        # (every weight of the tiny model is Q8_0: its form is every layer's)
        eng = Engine(m, _config("bfloat16", concurrency, graphs, chunk_size=4, layer_forms={"Q8_0": form}),
                     keep_logits=keep)
        assert eng.runner.layers[0].qkv.parts[0][1].form == form and eng.runner.mma_prec == "bf16"
        return eng

    calls = []
    real = TritonRunner._rows_out
    monkeypatch.setattr(TritonRunner, "_rows_out",
                        lambda self, slots, lg, tok, am: calls.append(len(am)) or real(self, slots, lg, tok, am))
    fast = engine(3, False, GRAPHS).generate(prompts, **kw)
    assert calls and all(calls)  # every forward was offered device tokens
    kept = engine(3, True, GRAPHS).generate(prompts, **kw)
    solo = [engine(1, True, False).submit(p, **kw).result() for p in prompts]
    for f, k, s in zip(fast, kept, solo):
        assert f.logits is None
        assert f.token_ids == k.token_ids == s.token_ids
        assert torch.equal(k.logits.cpu(), s.logits.cpu())


def test_run_ahead_is_exact_and_used(tiny_model):
    """Greedy steady state: the runner launches each next decode step before returning the
    current one (ahead). More requests than slots (admissions change the membership), one
    request stopped early by a small max_tokens, one cancelled mid-run: every request's tokens
    equal its solo run, and early launches were used. A call whose segments are not the ones
    launched early (another input token) runs its own step: the logits of a runner that never
    launched ahead."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    prompts = _prompts(m, 9, 5, 9, 3, 12, 6)
    max_tokens = [6, 2, 7, 5, 6]
    eng = Engine(m, _config("float32", 3, GRAPHS, chunk_size=8))
    handles = [eng.submit(p, max_tokens=k, ignore_eos=True) for p, k in zip(prompts, max_tokens)]
    cancelled = handles[2]
    for _ in range(4):
        eng.step()
    cancelled.cancel()
    eng.run_until_done()
    g = eng.runner.graphs
    assert 0 < g.ahead_used <= g.ahead_launched
    solo = Engine(m, _config("float32", 1, False))
    for i, (h, p, k) in enumerate(zip(handles, prompts, max_tokens)):
        if h is cancelled:
            assert h.result().finish_reason == "cancelled"
            continue
        assert h.result().token_ids == solo.submit(p, max_tokens=k, ignore_eos=True).result().token_ids, i
    # an early launch the next call does not match is discarded: that call's own step runs
    a, b = prompts[0], prompts[1]
    runs = []
    for ahead in (True, False):
        r = TritonRunner(m, 64, TritonOptions(graphs=GRAPHS))
        pages = DirectPages(r, tokens_per_group=2 * 256)
        ctx = {0: 32, 1: 32}
        r.run([pages.segment(0, "a", a, 0), pages.segment(1, "b", b, 0)], ctx)
        step = [pages.segment(0, "a", (7,), len(a)), pages.segment(1, "b", (8,), len(b))]
        toks = r.run(step, ctx, argmax=frozenset({0, 1}), ahead=ahead)
        other = (toks[0] + 1) % m.config.vocab_size  # (not the token the early launch took)
        runs.append(r.run([pages.segment(0, "a", (other,), len(a) + 1), pages.segment(1, "b", (toks[1],), len(b) + 1)],
                          ctx))
        assert r.graphs.ahead_launched == int(ahead) and r.graphs.ahead_used == 0
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("option", ["fuse_combine", "fuse_glu"])
def test_folded_launches_are_bitwise_the_separate_ones(tiny_model, option):
    """The runner's defaults fold the attention combine into the partial kernel and the GLU into
    the gate|up product; the separate launches give bitwise the same logits (prefill chunk
    across the window, then decode), one launch more per layer."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    toks = _tokens(m, 11, 14)[0]
    outs = []
    for fuse in (True, False):
        r = TritonRunner(m, 256, TritonOptions(graphs=False, **{option: fuse}))
        pages = DirectPages(r, tokens_per_group=256)
        got = [r.run([pages.segment(0, "a", toks[:12], 0)], {0: 64})[0]]
        got += [r.run([pages.segment(0, "a", (toks[i],), i)], {0: 64})[0] for i in (12, 13)]
        outs.append(torch.stack(got))
        outs.append(r.launches)
    assert torch.equal(outs[0], outs[2])
    assert outs[3] - outs[1] == m.config.n_layers  # one launch fewer per layer


def test_step_weight_bytes_leave_out_the_embedding_table(tiny_model):
    m = tiny_model("gemma3", "float32", "Q8_0")
    r = TritonRunner(m, 64, TritonOptions(graphs=False))
    assert r.fixed_bytes - r.step_weight_bytes == r.embed.raw.numel()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_forms_are_close_and_invariant(tiny_model, dtype):
    """head_matmul="dense": the head on its dequantized copy (kernels.dense_mma), one launch;
    "q8i8": its Q8_0 planes against x quantized per 32 values (kernels.dense_mma.q8i8_mma), one
    launch more (x's quantization) and close to the dense head (x's int8 steps); for each, a
    slot batched with others bitwise the slot alone."""
    m = tiny_model("gemma3", dtype, "Q8_0", sliding_window=WINDOW)
    a, b = _tokens(m, 13, 11, 5)
    runs = {}
    for head in ("dense", "q8i8"):
        r = TritonRunner(m, 256, TritonOptions(graphs=False, layer_forms={}, head_matmul=head))
        pages = DirectPages(r, tokens_per_group=2 * 256)
        runs[head] = (_solo(r, pages, a, 10), r.launches, r, pages)
    w = {h: runs[h][2].head.parts[0][1] for h in runs}
    assert w["dense"].form == "dense" and w["dense"].packed is None
    assert w["q8i8"].form == "q8i8" and w["q8i8"].dense is None and runs["q8i8"][1] == runs["dense"][1] + 1
    y, ref = runs["q8i8"][0], runs["dense"][0]
    assert (y - ref).abs().max() < 0.02 * ref.abs().max() and not torch.equal(y, ref)
    for head in runs:
        _assert_batched_is_solo(runs[head][2], runs[head][3], a, b, 10, runs[head][0])


def test_cublas_variant_shares_the_dense_head(tiny_model):
    """products="cublas_bf16" (the non-invariant comparison variant) reuses the dense head's bf16
    tensor instead of a second copy, and its logits are close to the invariant runner's."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    toks = (3, 9, 4, 17, 5)
    base = TritonRunner(m, 64, TritonOptions(graphs=False))
    ref = base.run([DirectPages(base, tokens_per_group=256).segment(0, "a", toks, 0)], {0: 32})[0]
    r = TritonRunner(m, 64, TritonOptions(graphs=False, products="cublas_bf16"))
    assert r.head_matmul == "dense"  # (the default int8 head is the quantized products')
    assert r.head.dense is r.head.parts[0][1].dense
    assert r.batch_verdict(None)[0] is False  # not batch-invariant: never batched for exactness
    got = r.run([DirectPages(r, tokens_per_group=256).segment(0, "a", toks, 0)], {0: 32})[0]
    torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2)


def test_pair_launch_fuses_a_mixed_format_qkv(tiny_model):
    """pair_launch: a q|k|v whose V has another format (Q5_0 q|k on tensor cores, Q8_0 V on the
    GEMV, as in Gemma 3 270M) goes as one launch per layer: one launch fewer per layer, a slot
    batched with another bitwise the slot alone, and (interpreter) bitwise the two launches."""
    m = tiny_model("gemma3", "bfloat16", "Q5_0", sliding_window=WINDOW, tensor_types=(("attn_v.weight", "Q8_0"),))
    a, b = _tokens(m, 21, 9, 6)
    runs = {}
    for pair in (False, True):
        r = TritonRunner(m, 256, TritonOptions(graphs=False, pair_launch=pair))
        assert [w.form for _, w in r.layers[0].qkv.parts] == ["mma", "gemv"]
        pages = DirectPages(r, tokens_per_group=2 * 256)
        runs[pair] = (_solo(r, pages, a, 8), r.launches, r, pages)
    assert runs[False][1] - runs[True][1] == m.config.n_layers
    if runs[True][0].device.type == "cpu":
        assert torch.equal(runs[True][0], runs[False][0])
    _assert_batched_is_solo(runs[True][2], runs[True][3], a, b, 8, runs[True][0])


def test_rope_in_attention_is_bitwise_the_separate_kernel(tiny_model):
    """rope_in_attention: in graphed decode steps QK-norm + rope + the KV write run inside the
    attention launch (one launch fewer per layer); prefill and mixed steps keep the separate
    kernel, so the two forms must agree bitwise: decode logits equal with it on and off, and
    through Engine (chunked prefill mixed with decode rows) batched equals solo, tokens and logits.
    The 3 decode rows are padded to a graph bucket of 4: on a pool poisoned with NaN, the pad row
    writes the scratch page (position 0) and no page that no sequence holds."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    prompts = _prompts(m, 31, 6, 11, 3)
    got = {}
    for on in (False, True):
        r = TritonRunner(m, 256, TritonOptions(graphs=GRAPHS, rope_in_attention=on))
        pages = DirectPages(r, tokens_per_group=5 * 256)  # (3 sequences of one page, 2 pages spare)
        r.kv.poison()
        toks = [int(r.run([pages.segment(sl, sl, p, 0)], {sl: 64})[sl].argmax()) for sl, p in enumerate(prompts)]
        steps = []
        for i in range(3):
            o = r.run([pages.segment(sl, sl, (toks[sl],), len(p) + i) for sl, p in enumerate(prompts)],
                      {sl: 64 for sl in range(3)})
            steps.append(torch.stack([o[sl] for sl in range(3)]))
            toks = [int(o[sl].argmax()) for sl in range(3)]
        got[on] = (torch.stack(steps), r.launches)
        assert torch.isfinite(got[on][0]).all()
        _unowned_pages_untouched(r, pages)
        for g in r.kv.groups:
            assert torch.isfinite(r.kv.k[g][:, r.kv.scratch(g), 0]).all(), g  # (the pad row's KV)
    assert torch.equal(got[True][0], got[False][0])
    assert got[False][1] - got[True][1] == m.config.n_layers
    kw = dict(max_tokens=5, ignore_eos=True)
    eng = Engine(m, _config("bfloat16", 3, GRAPHS, chunk_size=4), keep_logits=True)
    assert eng.runner.rope_in_attention
    batched = eng.generate(prompts, **kw)
    solo_eng = Engine(m, _config("bfloat16", 1, GRAPHS), keep_logits=True)
    for p, b in zip(prompts, batched):
        s = solo_eng.generate([p], **kw)[0]
        assert s.token_ids == b.token_ids and torch.equal(s.logits, b.logits)


def test_per_format_k_slices_are_invariant(tiny_model, monkeypatch):
    """kernels.qmatmul.QMATMUL_FORMAT_SPLIT_K: a product with a Q5_0 member (the mixed q|k|v, the
    gate|up) is cut into 64-weight K slices, the others keep theirs; one slice per fused product
    (the pair launch stays one launch), the kernels' steps follow it. Logits close to the
    unsplit products', a slot batched with another bitwise the slot alone."""
    from workbench.kernels import qmatmul as qm

    m = tiny_model("gemma3", "bfloat16", "Q5_0", sliding_window=WINDOW,
                   tensor_types=(("attn_v.weight", "Q8_0"), ("ffn_down.weight", "Q8_0")))
    a, b = _tokens(m, 23, 9, 6)
    base = TritonRunner(m, 256, TritonOptions(graphs=False))
    want = _solo(base, DirectPages(base, tokens_per_group=256), a, 8)
    monkeypatch.setattr(qm, "QMATMUL_FORMAT_SPLIT_K", {"Q5_0": 64})
    r = TritonRunner(m, 256, TritonOptions(graphs=False))
    pages = DirectPages(r, tokens_per_group=2 * 256)
    L, L0 = r.layers[0], base.layers[0]
    c = m.config
    assert (L.qkv.splits, L.gate_up.splits, L.down.splits) == (c.n_embd // 64, c.n_embd // 64, L0.down.splits)
    assert {w.packed.slice_k for _, w in L.qkv.parts} == {64}
    got = _solo(r, pages, a, 8)
    assert r.launches == base.launches
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    _assert_batched_is_solo(r, pages, a, b, 8, got)


def test_attention_runs_leave_every_scored_row_bitwise(tiny_model):
    """attention_runs=True: a slot's consecutive rows are attended a run at a time (each K/V
    block read once per run); every row's logits are bitwise those of the rows alone: a 40-row
    prefill (runs cut at multiples of RUN) and a 3-slot verify of 9 scored rows each, with a
    sliding window, under the interpreter. (The kernel's own cases: tests/kernels/test_attention.py.)"""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    a, b, c = _tokens(m, 5, 40, 30, 20)
    outs = []
    for runs in (False, True):
        r = TritonRunner(m, 128, TritonOptions(graphs=False, attention_runs=runs))
        pages = DirectPages(r, tokens_per_group=2048)
        got = [r.run([pages.segment(0, "a", a, 0, scored=40)], {0: 64})[0]]
        r.run([pages.segment(1, "b", b, 0), pages.segment(2, "c", c, 0)], {1: 64, 2: 64})
        verify = [pages.segment(s, rid, draft[:9], start, scored=9)
                  for s, rid, draft, start in ((0, "a", b, 40), (1, "b", c, 30), (2, "c", a, 20))]
        got += list(r.run(verify, {0: 64, 1: 64, 2: 64}).values())
        outs.append(torch.cat(got))
    assert outs[0].shape == (40 + 27, m.config.vocab_size)
    assert torch.equal(outs[0], outs[1])
