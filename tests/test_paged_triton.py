"""The paged engine on the Triton runner (issue 19, item 8): admission by pages, preemption by
recompute, prefix-cache hits, cancels and sliding-window drops leave every request's tokens and
logits bitwise what it gives alone on the contiguous layout.

The reference (`_reference`) is the same request alone on a fresh Triton engine: one slot, no
prefix cache, a pool nothing is preempted from and the whole prompt in one chunk, so that its
pages are 0, 1, 2, ... (the contiguous layout; `_reference` asserts it). Every test but the
soak asserts the counter of the event it is about (preemptions, prefix-hit tokens, sliding pages
freed, steps launched ahead), so that it cannot pass without that event (the soak reports them
as hypothesis events); every engine's KV pool is poisoned with NaN first (a read of a position
nobody wrote turns logits into NaN, never equal); and every test ends with no page held, used
or fenced (`_no_page_left`).

Cost. Under the Triton interpreter (no CUDA: tests/conftest.py sets TRITON_INTERPRET=1) a prefill
row costs about 0.1 s of CPU per layer, whatever the model's width, and a decode step 0.3 s
(measured on the one-layer float32 llama below: 67 rows in 6.3 s; bfloat16 7.5 s and 0.7 s). So,
without CUDA, the models are one layer in float32, the pages 64 positions
(`TritonOptions(page_size=64)`: a prompt of 62 tokens grows into its second page in decode; a
66-token prefix holds one full, cacheable page), and every test draws its requests from one
`MENU` whose references are computed once per session: the whole file takes about 3 minutes of
CPU. With CUDA the same tests run natively on the fuller tiny models (llama: two layers, in
bfloat16; gemma3: six layers, five sliding and one global).
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from workbench import Engine, EngineConfig
from workbench.runners.triton_options import TritonOptions

from engine_drive import serve_arrivals

CUDA = torch.cuda.is_available()
GRAPHS = True if CUDA else "emulate"  # the graph path: CUDA graphs, or the same path replayed eagerly
PAGE = 64
MAX_CONTEXT = 256  # every engine's (the runner's slot capacity; its block tables are 4 pages wide)
DTYPE = "bfloat16" if CUDA else "float32"
LLAMA = {} if CUDA else dict(n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
# gemma3 makes every sixth layer global: six layers for both KV groups, one (sliding only) to
# keep the interpreter's cost down
GEMMA = dict(n_layers=6) if CUDA else dict(n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
WINDOW = 8


def _ids(n: int, seed: int, vocab: int = 390) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, vocab) for _ in range(n)]


SHARED = _ids(PAGE + 2, seed=100)  # one full page (what the prefix cache keeps) and two positions
# name -> (prompt, submit keywords); the references are computed once per (model, prompt, keywords)
MENU: dict[str, tuple[list[int], dict]] = {
    # prefix-cache hits: 64 shared positions, then 2 of SHARED's own and 1-4 of the request's
    **{f"r{i}": (SHARED + _ids(1 + i, seed=200 + i), dict(max_tokens=2)) for i in range(4)},
    # crossing into its second page at its third decode step (62 + 6 positions)
    "p0": (_ids(62, seed=1), dict(max_tokens=6)),
    # short ones, holding a page each (sampled; greedy, as run-ahead takes greedy rows only)
    "p1": (_ids(12, seed=2), dict(max_tokens=6, temperature=0.9, top_k=40, seed=7, index=1)),
    "q": (_ids(5, seed=3), dict(max_tokens=6)),
}


def _llama(tiny_model):
    return tiny_model("llama", DTYPE, **LLAMA)


def _engine(m, slots: int, *, graphs=GRAPHS, keep_logits: bool = True, **kw) -> Engine:
    kw.setdefault("admission_headroom_tokens", 0)
    cfg = EngineConfig(backend="triton", dtype=m.dtype_name, max_concurrency=slots, max_context=MAX_CONTEXT,
                       memory_budget_bytes=1 << 30, triton=TritonOptions(page_size=PAGE, graphs=graphs), **kw)
    e = Engine(m, cfg, keep_logits=keep_logits)
    e.runner.kv.poison()
    return e


def _submit(e: Engine, name: str):
    prompt, kw = MENU[name]
    return e.submit(prompt, ignore_eos=True, **kw)


_REFS: dict = {}


def _reference(m, prompt: list[int], kw: dict) -> tuple[list[int], torch.Tensor]:
    """(tokens, logits) of the request alone: a fresh one-slot engine, no prefix cache, the whole
    prompt in one chunk on pages 0, 1, ... (eager, so the graph path is checked against it)."""
    key = (id(m), tuple(prompt), tuple(sorted(kw.items())))
    if key not in _REFS:
        e = _engine(m, 1, graphs=False, prefix_cache=False, chunk_size=len(prompt))
        h = e.submit(prompt, ignore_eos=True, **kw)
        e.step()
        alloc = e.scheduler.allocator
        for g in alloc.layout.group_names:  # the contiguous layout
            assert alloc.block_table(h.request_id, g).ids() == list(range(-(-len(prompt) // PAGE))), g
        r = h.result()
        assert r.num_preemptions == 0 and r.cached_tokens == 0 and len(r.token_ids) == kw["max_tokens"]
        _REFS[key] = (r.token_ids, r.logits)
    return _REFS[key]


def _ref(m, name: str):
    return _reference(m, *MENU[name])


def _same(result, ref, tokens_only: bool = False) -> None:
    toks, logits = ref
    assert result.token_ids == toks
    if not tokens_only:
        assert torch.equal(result.logits, logits)


def _no_page_left(e: Engine) -> None:
    """Nothing in flight, no sequence, every page free or cached, every slot free."""
    assert not e.runner.ahead_in_flight
    alloc = e.scheduler.allocator
    alloc.check()
    assert alloc.num_sequences == 0
    for pool in alloc.pools.values():
        assert pool.num_used == 0 and pool.num_quarantined == 0, pool.name
    assert e.scheduler.slots.num_free == e.config.max_concurrency


def test_a_pool_too_small_preempts_and_recomputes_bitwise(tiny_model):
    """Two requests of a page each on a pool of two pages: when the older (greedy) grows into its
    second page in decode, the newer (sampled) is preempted, waits for the older to finish,
    re-prefills its prompt and tokens, and both are bitwise their solo runs, tokens and logits.
    Their decode steps take the graph path (two rows in a bucket of two)."""
    m = _llama(tiny_model)
    e = _engine(m, 2, kv_resident_tokens=2 * PAGE)
    names = ("p0", "p1")
    hs = [_submit(e, n) for n in names]
    e.run_until_done()
    rs = [h.result() for h in hs]
    assert [r.num_preemptions for r in rs] == [0, 1]
    assert rs[1].recomputed_tokens > 0
    assert e.telemetry.steps()["num_preemptions"].sum() == 1
    for n, r in zip(names, rs):
        _same(r, _ref(m, n))
    _no_page_left(e)


def test_prefix_hits_at_1_4_and_8_are_bitwise_a_cold_run(tiny_model):
    """A cold request commits the shared page; then 1, 4 and 8 concurrent requests starting with
    it each take it from the cache (64 cached tokens apiece), prefill only their rest, and are
    bitwise their cold solo runs; the batched decode rows take the graph path (buckets 1, 4, 8).
    The eight are the four prompts twice (two users sending one prompt at once): four
    references fewer, each a full prefill under the interpreter."""
    m = _llama(tiny_model)
    e = _engine(m, 8)
    cold = _submit(e, "r0").result()
    assert cold.cached_tokens == 0
    _same(cold, _ref(m, "r0"))
    for n in (1, 4, 8):
        e.telemetry.clear()
        names = [f"r{i % 4}" for i in range(n)]
        hs = [_submit(e, x) for x in names]
        e.run_until_done()
        rs = [h.result() for h in hs]
        assert [r.cached_tokens for r in rs] == [PAGE] * n, n
        assert e.telemetry.steps()["prefix_hit_tokens"].sum() == PAGE * n
        assert (e.telemetry.requests()["cached_tokens"] == PAGE).all()
        for x, r in zip(names, rs):
            _same(r, _ref(m, x))
    _no_page_left(e)


def test_cancel_in_the_middle_of_a_shared_prefix_keeps_refcounts(tiny_model):
    """Three requests share the cached page; a prefill budget of three rows a step moves each one
    row into SHARED's uncached tail. One is cancelled there, one later in its own suffix: the
    shared page's refcount follows its holders (3, 2, 1), the allocator's invariants hold after
    each cancel, the survivor is bitwise its solo run (eager steps) and the page stays cached."""
    m = _llama(tiny_model)
    e = _engine(m, 3, graphs=False, chunk_size=3)
    _same(_submit(e, "r0").result(), _ref(m, "r0"))  # cold: commits the shared page
    hs = [_submit(e, n) for n in ("r1", "r2", "r3")]
    e.step()
    alloc = e.scheduler.allocator
    pool = alloc.pools["global"]
    assert all(PAGE < alloc.sequence(h.request_id).length < len(SHARED) for h in hs)  # mid-prefix
    page = alloc.block_table(hs[0].request_id, "global")[0]
    assert all(alloc.block_table(h.request_id, "global")[0] == page for h in hs)
    assert pool.refcount[page] == 3
    hs[1].cancel()
    alloc.check()
    assert pool.refcount[page] == 2
    e.step()
    e.step()
    assert alloc.sequence(hs[2].request_id).length > len(SHARED)  # in its own suffix
    hs[2].cancel()
    alloc.check()
    assert pool.refcount[page] == 1
    _same(hs[0].result(), _ref(m, "r1"))
    assert [h.result().finish_reason for h in hs] == ["max_tokens", "cancelled", "cancelled"]
    assert all(h.result().cached_tokens == PAGE for h in hs)
    _no_page_left(e)
    assert pool.num_cached >= 1 and pool.refcount[page] == 0


def test_sliding_pages_are_freed_past_the_window(tiny_model):
    """A 72-token prompt in two chunks of 36 (window 8): the second chunk's queries (36-71)
    still see page 0 (positions 0-63), so it stays; the first decode row, at 72, cannot, and
    drops it (a hole in the sliding table, the page freed); tokens and logits are bitwise the
    solo run's (eager steps). A global group (six layers, with CUDA) keeps both pages."""
    m = tiny_model("gemma3", "float32", sliding_window=WINDOW, **GEMMA)
    prompt, kw = _ids(72, seed=8), dict(max_tokens=3)
    e = _engine(m, 1, graphs=False, chunk_size=36, prefix_cache=False)
    h = e.submit(prompt, ignore_eos=True, **kw)
    alloc = e.scheduler.allocator
    e.step()
    e.step()
    assert alloc.block_table(h.request_id, "sliding").num_holes == 0
    e.step()
    assert alloc.block_table(h.request_id, "sliding").num_holes == 1
    if "global" in alloc.pools:
        assert alloc.block_table(h.request_id, "global").num_holes == 0
    r = h.result()
    _same(r, _reference(m, prompt, kw))
    steps = e.telemetry.steps()
    assert steps["pages_freed_sliding"][:3].sum() == 1  # dropped before the request finished
    assert steps["pages_used_sliding"].max() == 2
    if "global" in alloc.pools:
        assert steps["pages_used_global"].max() == 2
    _no_page_left(e)


def test_run_ahead_keeps_released_pages_fenced(tiny_model):
    """Greedy requests whose logits nobody keeps: a decode step is graphed and the next one is
    launched ahead where every row's next position lies in a page the row holds. A request
    cancelled while such a launch is in flight leaves its page fenced (quarantined) until the
    next step is done; the page then serves the other request's growth into its second page
    (no launch ahead across that boundary, one after it), and the tokens are the solo run's."""
    m = _llama(tiny_model)
    e = _engine(m, 2, keep_logits=False, kv_resident_tokens=2 * PAGE)
    keep, drop = _submit(e, "p0"), _submit(e, "q")
    e.step()  # the prefills
    e.step()  # a decode step, the next one launched ahead
    g = e.runner.graphs
    assert e.runner.ahead_in_flight and g.ahead_launched == 1
    pool = e.scheduler.allocator.pools["global"]
    drop.cancel()
    assert pool.num_quarantined == 1 and pool.num_available == 0
    e.step()
    assert pool.num_quarantined == 0 and pool.num_available == 1
    e.run_until_done()
    assert g.ahead_used > 0
    r = keep.result()
    assert r.logits is None and r.num_preemptions == 0
    _same(r, _ref(m, "p0"), tokens_only=True)
    assert drop.result().finish_reason == "cancelled"
    _no_page_left(e)


def test_a_preempted_hit_comes_back_through_the_cache(tiny_model):
    """r0 and p0 fill a pool of three pages; r1 arrives once r0 is done and takes r0's shared page
    from the cache; when p0 grows into its second page, r1 (the newest) is preempted, its shared
    page going back to the cache, and once p0 is done r1 is admitted again through a second hit
    and recomputes only its own positions. All three are bitwise their solo runs."""
    m = _llama(tiny_model)
    e = _engine(m, 3, kv_resident_tokens=3 * PAGE)
    p0, r0 = _submit(e, "p0"), _submit(e, "r0")
    e.step()
    e.step()  # r0's last token: its shared page is cached
    r1 = _submit(e, "r1")
    e.run_until_done()
    assert r0.result().cached_tokens == 0 and p0.result().num_preemptions == 0
    res = r1.result()
    assert res.num_preemptions == 1 and res.cached_tokens == PAGE
    assert 0 < res.recomputed_tokens < len(MENU["r1"][0]) - PAGE + 2  # only past the cached page
    assert e.telemetry.steps()["prefix_hit_tokens"].sum() == 2 * PAGE
    for name, h in (("p0", p0), ("r0", r0), ("r1", r1)):
        _same(h.result(), _ref(m, name))
    _no_page_left(e)


# the short ones hold a page while p0 grows (a pool of two preempts); two r's give a hit
SOAK_MENU = ("q", "p1", "r0", "r1")


@settings(max_examples=4, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=st.integers(2, 3), pages=st.sampled_from([2, 3]), graphs=st.sampled_from([GRAPHS, False]),
       chunk=st.sampled_from([None, 40]), prefix_cache=st.booleans(), headroom=st.sampled_from([0, PAGE]),
       others=st.lists(st.sampled_from(SOAK_MENU), min_size=2, max_size=2),
       arrive=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       cancel_at=st.lists(st.sampled_from([None, None, 2, 3, 4, 6]), min_size=3, max_size=3))
def test_soak_arrivals_cancels_preemptions_and_hits(tiny_model, slots, pages, graphs, chunk, prefix_cache,
                                                     headroom, others, arrive, cancel_at):
    """Random slots, pool (two or three pages), chunk budget, prefix cache, headroom and path
    (graphed or eager); p0 (which grows into a second page, so that a full pool preempts) and
    two requests from the menu arrive and are cancelled at random steps. Every request that is
    not cancelled is bitwise its solo run, and nothing is left behind.
    `--hypothesis-show-statistics` counts the examples that preempted, hit the prefix cache and
    cancelled. (No shrinking: under the interpreter an example takes about 10 s of CPU. A
    request too large for the pool is refused at submit: tests/test_paged_engine.py.)"""
    m = _llama(tiny_model)
    e = _engine(m, slots, graphs=graphs, kv_resident_tokens=PAGE * pages, chunk_size=chunk, prefix_cache=prefix_cache,
                admission_headroom_tokens=headroom)
    names = ["p0", *others]
    handles = serve_arrivals(e, lambda i: _submit(e, names[i]), arrive, cancel_at, 100,
                             after_cancel=e.scheduler.allocator.check)
    for i, h in handles.items():
        r = h.result()
        if r.finish_reason != "cancelled":
            _same(r, _ref(m, names[i]))
    results = [h.result() for h in handles.values()]
    event(f"preempted: {any(r.num_preemptions for r in results)}")
    event(f"prefix hit: {any(r.cached_tokens for r in results)}")
    event(f"cancelled: {any(r.finish_reason == 'cancelled' for r in results)}")
    _no_page_left(e)
