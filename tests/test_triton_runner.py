"""The Triton backend (workbench.triton_runner) on tiny models.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py
before triton is imported): slow but exact, so the models are tiny. On a CUDA machine the same
tests run natively (tl.dot forms, CUDA graphs for decode steps).
"""

from __future__ import annotations

import pytest
import torch

from workbench import Engine, EngineConfig, triton_runner
from workbench.errors import WorkbenchError
from workbench.model import Segment as ModelSegment
from workbench.scheduler import Segment
from workbench.triton_runner import TritonRunner

WINDOW = 8  # small sliding window, so that short prompts cross it


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch,weight_type", [("gemma3", "Q8_0"), ("llama", "Q5_0")])
def test_logits_close_to_torch(tiny_model, arch, weight_type):
    """Teacher-forced: chunked prefill then decode steps, triton vs the torch reference (fp32).
    Llama checks the NORM-rope row permutation; gemma3 the QK-norm, post-norms and window."""
    m = tiny_model(arch, "float32", weight_type, sliding_window=WINDOW)
    r = TritonRunner(m, 256)
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(0, m.config.vocab_size, (20,), generator=gen).tolist()
    st = m.new_state(256)
    ctx = {3: 64}
    # chunk 1 (not sampled), chunk 2 (sampled), then decode
    assert r.run([Segment(3, "a", tuple(toks[:7]), 0, False)], ctx) == {}
    m.forward([ModelSegment(st, toks[:7], "none")])
    got = r.run([Segment(3, "a", tuple(toks[7:13]), 7, True)], ctx)[3]
    ref = m.forward([ModelSegment(st, toks[7:13], "last")])[0][0]
    assert got.dtype == torch.float32 and got.shape == (m.config.vocab_size,)
    assert _rel(got, ref) < 1e-4
    for i in range(13, 18):
        got = r.run([Segment(3, "a", (toks[i],), i, True)], ctx)[3]
        ref = m.forward([ModelSegment(st, [toks[i]], "last")])[0][0]
        assert _rel(got, ref) < 1e-4, i
    with pytest.raises(RuntimeError, match="KV holds"):
        r.run([Segment(3, "a", (toks[0],), 5, True)], ctx)


def _generate(model, prompts, concurrency, chunk_size, **kw):
    cfg = EngineConfig(backend="triton", dtype="float32", max_concurrency=concurrency, chunk_size=chunk_size,
                       max_context=64, memory_budget_bytes=1 << 30)
    eng = Engine(model, cfg, keep_logits=True)
    if concurrency == 1:
        return [eng.submit(p, index=i, **kw).result() for i, p in enumerate(prompts)]  # one at a time
    return eng.generate(prompts, **kw)


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
    assert eng(tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)) == "dense"
    q5 = tiny_model("gemma3", "bfloat16", "Q5_0", sliding_window=WINDOW)
    assert eng(q5) == "dense"
    with pytest.raises(WorkbenchError, match="head_matmul='q8i8' reads a Q8_0 head"):
        eng(q5, head_matmul="q8i8")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_batched_equals_solo(tiny_model, monkeypatch, temperature):
    """Three slots (mixed prefill chunks + decode rows in one forward; prompts crossing the
    window) give bitwise the tokens and logits of each request run alone. The batched engine
    takes the graph path (3 rows padded to a bucket of 4, the pad row writing the scratch slot:
    real CUDA graphs on a GPU, the same path replayed eagerly on the CPU); solo runs plain."""
    import workbench.triton_runner as tr

    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, m.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 11, 6)]
    kw = dict(max_tokens=5, temperature=temperature, seed=7, ignore_eos=True)
    monkeypatch.setattr(tr, "GRAPHS", True if torch.cuda.is_available() else "emulate")
    batched = _generate(m, prompts, 3, 4, **kw)
    monkeypatch.setattr(tr, "GRAPHS", False)
    solo = _generate(m, prompts, 1, None, **kw)
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


@pytest.mark.parametrize("history", [1024, 3, 0])
def test_decode_loop_matches_engine_steps(tiny_model, monkeypatch, history):
    """The benchmark fast path (graph replays, greedy tokens fed back on the device) gives the
    tokens of step-by-step runs, the tokens kept in the graph (GRAPH_HISTORY, gathered in chunks
    of that many steps) or copied after each replay (0)."""
    monkeypatch.setattr(triton_runner, "GRAPH_HISTORY", history)
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    graphs = True if torch.cuda.is_available() else "emulate"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, m.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 9)]
    a, b = TritonRunner(m, 256, graphs=graphs), TritonRunner(m, 256, graphs=False)
    first, want = [], []
    for sl, p in enumerate(prompts):
        first.append(int(a.run([Segment(sl, sl, tuple(p), 0, True)], {sl: 32})[sl].argmax()))
        t = [int(b.run([Segment(sl, sl, tuple(p), 0, True)], {sl: 32})[sl].argmax())]
        for i in range(4):
            t.append(int(b.run([Segment(sl, sl, (t[-1],), len(p) + i, True)], {sl: 32})[sl].argmax()))
        want.append(t[1:])
    hist = a.decode_loop([0, 1], first, 4)
    assert hist.T.tolist() == want
    assert a.launches > 0


@pytest.mark.parametrize("head", ["dense", "q8f16", "q8i8"])
def test_argmax_in_head_gives_the_same_tokens(tiny_model, monkeypatch, head):
    """ARGMAX_IN_HEAD: the head's streaming programs keep the greedy argmax's first stage (one
    launch fewer per decode graph); the decode loop's tokens and last logits are the separate
    argmax's, for the dense, the float16 Q8_0 and the int8 head (ARGMAX_IN_HEAD_FORMS; the int8
    head's only up to 16 rows: a bucket above the form's limit keeps the separate argmax)."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    graphs = True if torch.cuda.is_available() else "emulate"
    a, b = _tokens(m, 21, 6, 11)
    got = {}
    for on in (False, True):
        monkeypatch.setattr(triton_runner, "ARGMAX_IN_HEAD", on)
        r = TritonRunner(m, 256, graphs=graphs, head_matmul=head)
        first = [int(r.run([Segment(sl, sl, tuple(p), 0, True)], {sl: 32})[sl].argmax()) for sl, p in enumerate((a, b))]
        got[on] = (r.decode_loop([0, 1], first, 4).tolist(), r.launches, r._g_logits[:2].clone())
    assert got[True][0] == got[False][0]
    assert torch.equal(got[True][2], got[False][2])
    assert got[True][1] == got[False][1] - 1
    monkeypatch.setattr(triton_runner, "ARGMAX_IN_HEAD_FORMS", {head: 1})  # (2 rows: above the form's limit)
    r = TritonRunner(m, 256, graphs=graphs, head_matmul=head)
    first = [int(r.run([Segment(sl, sl, tuple(p), 0, True)], {sl: 32})[sl].argmax()) for sl, p in enumerate((a, b))]
    assert r.decode_loop([0, 1], first, 4).tolist() == got[True][0] and r.launches == got[False][1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_glu_in_down_is_bitwise_the_fold(tiny_model, dtype):
    """glu_in_down: the FFN down product forms act(gate) * up from gate|up's partials itself
    (kernels.qmma glu_x) instead of the GLU fold writing it: under the interpreter the same
    logits bitwise, eager (prefill and decode) and through the decode graph's loop (on a GPU
    the two kernels' GLU may contract into FMAs differently: close there, and one form per
    runner), with as many launches; a slot batched with others is bitwise the slot alone."""
    m = tiny_model("gemma3", dtype, "Q5_0", sliding_window=WINDOW)
    graphs = True if torch.cuda.is_available() else "emulate"
    a, b = _tokens(m, 17, 12, 6)
    got = {}
    for on in (False, True):
        r = TritonRunner(m, 256, graphs=graphs, matmul="mma", glu_in_down=on)
        solo = _solo(r, a, 10)
        first = [int(r.run([Segment(sl, sl, tuple(p), 0, True)], {sl: 32})[sl].argmax()) for sl, p in
                 ((2, a), (3, b))]
        got[on] = (solo, r.decode_loop([2, 3], first, 3).tolist(), r._g_logits[:2].clone(), r.launches, r)
    if torch.cuda.is_available():
        torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-3, atol=1e-3)
    else:
        assert torch.equal(got[True][0], got[False][0])
        assert got[True][1] == got[False][1] and torch.equal(got[True][2], got[False][2])
    assert got[True][3] == got[False][3]
    r = got[True][4]
    assert r._glu_in_down(r.layers[0].gate_up, r.layers[0].down)  # (the form was taken)
    assert not got[False][4]._glu_in_down(r.layers[0].gate_up, r.layers[0].down)
    _assert_batched_is_solo(r, a, b, 10, got[True][0])


def test_unsupported_weights_raise(tiny_model):
    m = tiny_model("gemma3", "float32", "F32")
    with pytest.raises(WorkbenchError, match="quant type F32"):
        TritonRunner(m, 256)


@pytest.mark.parametrize("matmul", ["mma", "gemv"])
def test_bf16_engine_tokens_on_device(tiny_model, monkeypatch, matmul):
    """A bfloat16 engine (the tensor-core form with bf16 operands, or the FMA form): batched
    greedy requests whose logits nobody keeps get their tokens from the device argmax (no logits
    copy), and those tokens are the ones each request gets alone with its logits kept (host
    argmax); batched logits, when kept, equal the solo ones bitwise."""
    import workbench.triton_runner as tr

    monkeypatch.setattr(tr, "MATMUL", matmul)
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, m.config.vocab_size, (n,), generator=gen).tolist() for n in (4, 10, 7)]
    kw = dict(max_tokens=4, ignore_eos=True)

    def engine(concurrency, keep):
        cfg = EngineConfig(backend="triton", dtype="bfloat16", max_concurrency=concurrency, chunk_size=4,
                           max_context=64, memory_budget_bytes=1 << 30)
        eng = Engine(m, cfg, keep_logits=keep)
        assert eng.runner.matmul == matmul and eng.runner.mma_prec == "bf16"
        return eng

    calls = []
    real = tr.TritonRunner._rows_out
    monkeypatch.setattr(tr.TritonRunner, "_rows_out",
                        lambda self, slots, lg, tok, am: calls.append(len(am)) or real(self, slots, lg, tok, am))
    monkeypatch.setattr(tr, "GRAPHS", True if torch.cuda.is_available() else "emulate")
    fast = engine(3, False).generate(prompts, **kw)
    assert calls and all(calls)  # every forward was offered device tokens
    kept = engine(3, True).generate(prompts, **kw)
    monkeypatch.setattr(tr, "GRAPHS", False)
    solo = [engine(1, True).submit(p, **kw).result() for p in prompts]
    for f, k, s in zip(fast, kept, solo):
        assert f.logits is None
        assert f.token_ids == k.token_ids == s.token_ids
        assert torch.equal(k.logits.cpu(), s.logits.cpu())


def test_bad_matmul_form(tiny_model):
    with pytest.raises(WorkbenchError, match="matmul='fast' is not allowed: allowed mma, gemv, raw"):
        TritonRunner(tiny_model("gemma3", "float32", "Q8_0"), 64, matmul="fast")


@pytest.mark.parametrize("in_graph", [False, True])
def test_run_ahead_is_exact_and_used(tiny_model, monkeypatch, in_graph):
    """Greedy steady state: the runner launches each next decode step before returning the
    current one (ahead). More requests than slots (admissions change the membership), one
    request stopped early by a small max_tokens, one cancelled mid-run: every request's tokens
    equal its solo run, and early launches were both used and discarded along the way; the
    tokens copied to the host, or written there by the graph (TOKENS_IN_GRAPH)."""
    import workbench.triton_runner as tr

    monkeypatch.setattr(tr, "TOKENS_IN_GRAPH", in_graph)

    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, m.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 6)]
    max_tokens = [6, 2, 7, 5, 6]
    monkeypatch.setattr(tr, "GRAPHS", True if torch.cuda.is_available() else "emulate")
    cfg = EngineConfig(backend="triton", dtype="float32", max_concurrency=3, chunk_size=8, max_context=64,
                       memory_budget_bytes=1 << 30)
    eng = Engine(m, cfg)
    used, launched = [], []
    real_run, real_next = tr.TritonRunner.run, tr.TritonRunner._tokens_then_next

    def run(self, fwd, ctx, argmax=frozenset(), ahead=False):
        used.append(self._ahead is not None and self._ahead[0] == tuple((s.slot_id, s.start_pos, s.token_ids[0]) for s in fwd))
        return real_run(self, fwd, ctx, argmax, ahead)

    monkeypatch.setattr(tr.TritonRunner, "run", run)
    monkeypatch.setattr(tr.TritonRunner, "_tokens_then_next",
                        lambda self, n, p, at: launched.append(n) or real_next(self, n, p, at))
    handles = [eng.submit(p, max_tokens=k, ignore_eos=True) for p, k in zip(prompts, max_tokens)]
    cancelled = handles[2]
    for _ in range(4):
        eng.step()
    cancelled.cancel()
    eng.run_until_done()
    assert any(used) and launched and not all(used)
    monkeypatch.setattr(tr, "GRAPHS", False)
    solo = Engine(m, EngineConfig(backend="triton", dtype="float32", max_concurrency=1, max_context=64,
                                  memory_budget_bytes=1 << 30))
    for i, (h, p, k) in enumerate(zip(handles, prompts, max_tokens)):
        if h is cancelled:
            assert h.result().finish_reason == "cancelled"
            continue
        assert h.result().token_ids == solo.submit(p, max_tokens=k, ignore_eos=True).result().token_ids, i


@pytest.mark.parametrize("option", ["fuse_combine", "fuse_glu"])
def test_folded_launches_are_bitwise_the_separate_ones(tiny_model, option):
    """The runner's defaults fold the attention combine into the partial kernel and the GLU into
    the gate|up product; the separate launches give bitwise the same logits (prefill chunk
    across the window, then decode), one launch more per layer."""
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    gen = torch.Generator().manual_seed(11)
    toks = torch.randint(0, m.config.vocab_size, (14,), generator=gen).tolist()
    outs = []
    for fuse in (True, False):
        r = TritonRunner(m, 256, graphs=False, **{option: fuse})
        got = [r.run([Segment(0, "a", tuple(toks[:12]), 0, True)], {0: 64})[0]]
        got += [r.run([Segment(0, "a", (toks[i],), i, True)], {0: 64})[0] for i in (12, 13)]
        outs.append(torch.stack(got))
        outs.append(r.launches)
    assert torch.equal(outs[0], outs[2])
    assert outs[3] - outs[1] == m.config.n_layers  # one launch fewer per layer


def test_step_weight_bytes_leave_out_the_embedding_table(tiny_model):
    m = tiny_model("gemma3", "float32", "Q8_0")
    r = TritonRunner(m, 64, graphs=False)
    assert r.fixed_bytes - r.step_weight_bytes == r.embed.raw.numel()
    raw = TritonRunner(m, 64, graphs=False, matmul="raw")  # the raw form's tied head reads the table itself
    assert raw.fixed_bytes == raw.step_weight_bytes


def _tokens(m, seed: int, *lengths: int) -> list[list[int]]:
    """Seeded random token lists of these lengths over m's vocabulary (one generator, in order)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, m.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("option,fewer", [("fuse_qk_rope", 1), ("fuse_add_norm", 2)])
def test_close_folds_are_invariant_and_save_launches(tiny_model, monkeypatch, option, fewer):
    """fuse_qk_rope: QK-norm + rope + the KV write ride on the q|k|v product's launch;
    fuse_add_norm: the residual add + next norm on the attention-output and down products'.
    Their logits are close to the separate kernels' (another layout for the norms' sums, so not
    bitwise), a slot batched with another is bitwise the slot alone, and each layer has
    ``fewer`` launches."""
    from workbench.kernels import qmma

    # heads of 32 must not straddle tensor-core tiles: 32-wide tiles here (and on the GPU)
    monkeypatch.setattr(qmma, "QMMA_INTERPRETER_MIN_BLOCK_N", 32)
    for table in (qmma.QMMA_CONFIGS, qmma.QMMA_WIDE_CONFIGS):  # (K = 128: one split, the "wide" table)
        monkeypatch.setitem(table, "Q8_0", qmma.MmaConfig(block_n=32, block_k=128))
    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    a, b = _tokens(m, 12, 13, 7)

    def alone(fuse):  # (every weight on tensor cores: the folds ride on that form's launches)
        r = TritonRunner(m, 256, graphs=False, matmul="mma", **{option: fuse})
        return _solo(r, a, 12), r.launches

    fused, n_fused = alone(True)
    plain, n_plain = alone(False)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert n_plain - n_fused == fewer * m.config.n_layers
    _assert_batched_is_solo(TritonRunner(m, 256, graphs=False, matmul="mma", **{option: True}), a, b, 12, fused)


def _solo(r, a, n):
    """Slot 0 prefilled with a[:n], then one decode step (a[n]): logits [2, vocab]."""
    got = [r.run([Segment(0, "a", tuple(a[:n]), 0, True)], {0: 64})[0]]
    got.append(r.run([Segment(0, "a", (a[n],), n, True)], {0: 64})[0])
    return torch.stack(got)


def _assert_batched_is_solo(r, a, b, n, solo):
    """The same two forwards for a new request in slot 0, batched with slot 1's prefill of b[:-1]
    and its decode step b[-1]: slot 0's logits bitwise ``solo``."""
    k = len(b) - 1
    o = r.run([Segment(1, "b", tuple(b[:k]), 0, True), Segment(0, "a2", tuple(a[:n]), 0, True)], {0: 64, 1: 64})
    assert torch.equal(o[0], solo[0])
    o = r.run([Segment(0, "a2", (a[n],), n, True), Segment(1, "b", (b[k],), k, True)], {0: 64, 1: 64})
    assert torch.equal(o[0], solo[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_head_is_close_and_invariant(tiny_model, dtype, monkeypatch):
    """head_matmul="dense": the head on its dequantized copy (kernels.dense_mma); "q8dense": the
    same products from the Q8_0 planes (kernels.dense_mma.q8_dense_mma, half the bytes). Logits
    close to the tensor-core head's on the packed blocks (same weight values, another K order),
    q8dense bitwise dense under the interpreter (same operands, same order), a slot batched with
    others bitwise the slot alone, one launch for the head either way."""
    m = tiny_model("gemma3", dtype, "Q8_0", sliding_window=WINDOW)
    a, b = _tokens(m, 13, 11, 5)
    runs = {}
    heads = ("mma", "dense", "q8dense", "q8i8", "q8f16") if dtype == "bfloat16" else ("mma", "dense", "q8dense", "q8i8")
    for head in heads:
        r = TritonRunner(m, 256, graphs=False, matmul="mma", head_matmul=head)
        runs[head] = (_solo(r, a, 10), r.launches, r)
    tol = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(runs["dense"][0], runs["mma"][0], rtol=tol, atol=tol)
    assert runs["dense"][1] == runs["mma"][1] == runs["q8dense"][1]
    assert torch.equal(runs["q8dense"][0], runs["dense"][0])
    assert runs["dense"][2].head.parts[0][1].form == "dense" and runs["dense"][2].head.parts[0][1].packed is None
    assert runs["q8dense"][2].head.parts[0][1].form == "q8dense" and runs["q8dense"][2].head.parts[0][1].dense is None
    # q8i8: x as Q8_0 blocks, integer products: close (x's int8 steps), one launch more (x's quantization)
    assert runs["q8i8"][2].head.parts[0][1].form == "q8i8" and runs["q8i8"][1] == runs["dense"][1] + 1
    y, ref = runs["q8i8"][0], runs["mma"][0]
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()
    for head in heads[1:]:
        _assert_batched_is_solo(runs[head][2], a, b, 10, runs[head][0])
    if dtype == "bfloat16":  # float16 operands: closer to the exact product than bfloat16's
        assert runs["q8f16"][2].head.parts[0][1].form == "q8f16" and runs["q8f16"][1] == runs["dense"][1]
        torch.testing.assert_close(runs["q8f16"][0], runs["dense"][0], rtol=tol, atol=tol)
        # the output norm writes the head's input in float16 (HEAD_X_HALF): the same logits
        assert runs["q8f16"][2].head_x_dtype == torch.float16
        monkeypatch.setattr(triton_runner, "HEAD_X_HALF", False)
        r = TritonRunner(m, 256, graphs=False, matmul="mma", head_matmul="q8f16")
        assert r.head_x_dtype is None and torch.equal(_solo(r, a, 10), runs["q8f16"][0])
    with pytest.raises(WorkbenchError, match="allowed mma, gemv, dense, q8dense, q8f16, q8i8"):
        TritonRunner(m, 64, graphs=False, matmul="mma", head_matmul="cublas")
    m5 = tiny_model("gemma3", dtype, "Q5_0", sliding_window=WINDOW)
    with pytest.raises(WorkbenchError, match="reads a Q8_0 head; this head is Q5_0"):
        TritonRunner(m5, 64, graphs=False, matmul="mma", head_matmul="q8dense")
    with pytest.raises(WorkbenchError, match="reads a Q8_0 head; this head is Q5_0"):
        TritonRunner(m5, 64, graphs=False, matmul="mma", head_matmul="q8i8")


def test_f16_head_only_where_float16_provably_holds(tiny_model, monkeypatch):
    """head_matmul="q8f16" is refused, with the reason, where float16 operands are not proved
    safe: a float32 engine, a non-Q8_0 head, an output norm whose bound sqrt(K) * max|g| passes
    float16's range. As the default (HEAD_MATMUL) it falls back to "dense" there instead."""
    m32 = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    with pytest.raises(WorkbenchError, match="q8f16.*refused: a float32 engine's head"):
        TritonRunner(m32, 64, graphs=False, head_matmul="q8f16")
    m5 = tiny_model("gemma3", "bfloat16", "Q5_0", sliding_window=WINDOW)
    with pytest.raises(WorkbenchError, match=r"refused: the head \(token_embd.weight\) is Q5_0"):
        TritonRunner(m5, 64, graphs=False, head_matmul="q8f16")
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    assert TritonRunner(m, 64, graphs=False, head_matmul="q8f16").head_matmul == "q8f16"
    monkeypatch.setattr(m, "output_norm", m.output_norm * 1e5)  # sqrt(K) * max|g| beyond 65504
    with pytest.raises(WorkbenchError, match="its input may reach .* beyond float16's 65504"):
        TritonRunner(m, 64, graphs=False, head_matmul="q8f16")
    monkeypatch.setattr(triton_runner, "HEAD_MATMUL", "q8f16")
    for model, form in ((m, "dense"), (m32, "dense"), (m5, "dense")):
        assert TritonRunner(model, 64, graphs=False).head_matmul == form


def test_bf16_attention_products_are_invariant(tiny_model):
    """attn_bf16: a bfloat16 engine's attention products as single bf16 MMAs. Close to the
    tf32x3 products at bfloat16 tolerance; a slot batched with another bitwise the slot alone;
    a float32 engine ignores it."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    a, b = _tokens(m, 14, 11, 6)
    outs = {}
    for bf16 in (False, True):
        r = TritonRunner(m, 256, graphs=False, attn_bf16=bf16)
        assert r.attn_prec == ("bf16" if bf16 else None)
        outs[bf16] = _solo(r, a, 10)
    torch.testing.assert_close(outs[True], outs[False], rtol=3e-2, atol=3e-2)
    _assert_batched_is_solo(r, a, b, 10, outs[True])
    assert TritonRunner(tiny_model("gemma3", "float32", "Q8_0"), 64, graphs=False, attn_bf16=True).attn_prec is None


def test_cublas_variant_shares_the_dense_head(tiny_model):
    """dense="cublas_bf16" (the non-invariant comparison variant) reuses the dense head's bf16
    tensor instead of a second copy, and its logits are close to the invariant runner's."""
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    toks = (3, 9, 4, 17, 5)
    ref = TritonRunner(m, 64, graphs=False).run([Segment(0, "a", toks, 0, True)], {0: 32})[0]
    r = TritonRunner(m, 64, graphs=False, dense="cublas_bf16")
    assert r.head.dense is r.head.parts[0][1].dense
    assert r.batch_verdict(None)[0] is False  # not batch-invariant: never batched for exactness
    got = r.run([Segment(0, "a", toks, 0, True)], {0: 32})[0]
    torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2)


def _decode_steps(r, a, b, steps=3):
    """Prefill two slots, then greedy-free decode steps of both (teacher-forced tokens): logits."""
    r.run([Segment(0, "a", tuple(a[:10]), 0, True), Segment(1, "b", tuple(b[:5]), 0, True)], {0: 64, 1: 64})
    got = []
    for i in range(steps):
        o = r.run([Segment(0, "a", (a[10 + i],), 10 + i, True), Segment(1, "b", (b[5 + i],), 5 + i, True)],
                  {0: 64, 1: 64})
        got.append(torch.stack([o[0], o[1]]))
    return torch.stack(got)


@pytest.mark.parametrize("dtype,forms", [("float32", None), ("bfloat16", {"Q8_0": "gemv"})])
def test_persistent_step_is_bitwise_the_chain(tiny_model, dtype, forms):
    """The graphed decode step's layer loop as one persistent launch (kernels/persistent.py)
    gives bitwise the logits of the chain of launches, in a few launches instead of ~8 per
    layer; a slot batched with another is bitwise the slot alone."""
    m = tiny_model("gemma3", dtype, "Q8_0", sliding_window=WINDOW)
    graphs = True if torch.cuda.is_available() else "emulate"
    a, b = _tokens(m, 21, 14, 9)
    out, launches = {}, {}
    for pers in (False, True):
        r = TritonRunner(m, 256, graphs=graphs, persistent=pers, matmul="mma", layer_forms=forms)
        if not pers:
            r.uniform_warps = 4  # the persistent runner's warps (the same arithmetic on a GPU)
        out[pers] = _decode_steps(r, a, b)
        launches[pers] = r.launches
        assert r.persistent == pers and r.persistent_off is None
    assert torch.equal(out[True], out[False])
    assert launches[True] < launches[False] - 5 * m.config.n_layers
    solo = TritonRunner(m, 256, graphs=graphs, persistent=True, matmul="mma", layer_forms=forms)
    solo.run([Segment(0, "a", tuple(a[:10]), 0, True)], {0: 64})
    for i in range(3):
        o = solo.run([Segment(0, "a", (a[10 + i],), 10 + i, True)], {0: 64})
        assert torch.equal(o[0], out[True][i, 0])


def test_persistent_step_falls_back_to_the_chain(tiny_model, monkeypatch):
    """A loop with a launch the persistent kernel has no item for runs as the chain (nothing of
    the recorded attempt ran: the logits are the chain's) and says why; so do the folds."""
    from workbench.kernels import persistent as ps

    m = tiny_model("gemma3", "float32", "Q8_0", sliding_window=WINDOW)
    graphs = True if torch.cuda.is_available() else "emulate"
    a, b = _tokens(m, 22, 14, 9)
    r = TritonRunner(m, 256, graphs=graphs, persistent=False, matmul="mma")
    r.uniform_warps = 4
    want = _decode_steps(r, a, b)
    monkeypatch.delitem(ps._JIT, "_add_rmsnorm_kernel")
    r = TritonRunner(m, 256, graphs=graphs, persistent=True, matmul="mma")
    got = _decode_steps(r, a, b)
    assert not r.persistent and "_add_rmsnorm_kernel" in r.persistent_off
    assert torch.equal(got, want)
    assert not TritonRunner(m, 256, graphs=graphs, persistent=True, fuse_qk_rope=True).persistent
    assert not TritonRunner(m, 256, graphs=False, persistent=True).persistent  # graphed steps only


def test_pair_launch_fuses_a_mixed_format_qkv(tiny_model):
    """pair_launch: a q|k|v whose V has another format (Q5_0 q|k on tensor cores, Q8_0 V on the
    GEMV, as in Gemma 3 270M) goes as one launch per layer: one launch fewer per layer, a slot
    batched with another bitwise the slot alone, and (interpreter) bitwise the two launches."""
    m = tiny_model("gemma3", "bfloat16", "Q5_0", sliding_window=WINDOW, tensor_types=(("attn_v.weight", "Q8_0"),))
    a, b = _tokens(m, 21, 9, 6)
    runs = {}
    for pair in (False, True):
        r = TritonRunner(m, 256, graphs=False, pair_launch=pair)
        assert [w.form for _, w in r.layers[0].qkv.parts] == ["mma", "gemv"]
        runs[pair] = (_solo(r, a, 8), r.launches, r)
    assert runs[False][1] - runs[True][1] == m.config.n_layers
    if runs[True][0].device.type == "cpu":
        assert torch.equal(runs[True][0], runs[False][0])
    _assert_batched_is_solo(runs[True][2], a, b, 8, runs[True][0])


def test_rope_in_attention_is_bitwise_the_separate_kernel(tiny_model, monkeypatch):
    """rope_in_attention: in graphed decode steps QK-norm + rope + the KV write run inside the
    attention launch (one launch fewer per layer); prefill and mixed steps keep the separate
    kernel, so the two forms must agree bitwise: decode logits equal with it on and off, and
    through Engine (chunked prefill mixed with decode rows) batched equals solo, tokens and logits."""
    import workbench.triton_runner as tr

    graphs = True if torch.cuda.is_available() else "emulate"
    m = tiny_model("gemma3", "bfloat16", "Q8_0", sliding_window=WINDOW)
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(4, m.config.vocab_size, (n,), generator=gen).tolist() for n in (6, 11, 3)]
    got = {}
    for on in (False, True):
        r = TritonRunner(m, 256, graphs=graphs, rope_in_attention=on)
        toks = [int(r.run([Segment(sl, sl, tuple(p), 0, True)], {sl: 64})[sl].argmax()) for sl, p in enumerate(prompts)]
        steps = []
        for i in range(3):
            o = r.run([Segment(sl, sl, (toks[sl],), len(p) + i, True) for sl, p in enumerate(prompts)],
                      {sl: 64 for sl in range(3)})
            steps.append(torch.stack([o[sl] for sl in range(3)]))
            toks = [int(o[sl].argmax()) for sl in range(3)]
        got[on] = (torch.stack(steps), r.launches)
    assert torch.equal(got[True][0], got[False][0])
    assert got[False][1] - got[True][1] == m.config.n_layers
    monkeypatch.setattr(tr, "ROPE_IN_ATTENTION", True)
    monkeypatch.setattr(tr, "GRAPHS", graphs)
    kw = dict(max_tokens=5, ignore_eos=True)
    cfg = EngineConfig(backend="triton", dtype="bfloat16", max_concurrency=3, chunk_size=4, max_context=64,
                       memory_budget_bytes=1 << 30)
    eng = Engine(m, cfg, keep_logits=True)
    assert eng.runner.rope_in_attention
    batched = eng.generate(prompts, **kw)
    solo_eng = Engine(m, EngineConfig(backend="triton", dtype="bfloat16", max_concurrency=1, max_context=64,
                                      memory_budget_bytes=1 << 30), keep_logits=True)
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
    base = TritonRunner(m, 256, graphs=False)
    want = _solo(base, a, 8)
    monkeypatch.setattr(qm, "QMATMUL_FORMAT_SPLIT_K", {"Q5_0": 64})
    r = TritonRunner(m, 256, graphs=False)
    L, L0 = r.layers[0], base.layers[0]
    c = m.config
    assert (L.qkv.splits, L.gate_up.splits, L.down.splits) == (c.n_embd // 64, c.n_embd // 64, L0.down.splits)
    assert {w.packed.slice_k for _, w in L.qkv.parts} == {64}
    got = _solo(r, a, 8)
    assert r.launches == base.launches
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    _assert_batched_is_solo(r, a, b, 8, got)
