"""eviction="scored" (issue 20): cached prefix pages leave the device by the attention mass they
received, not by recency. The mass is measured by the torch path's dense attention
(`attention.attend(mass=)`), read and zeroed by the page pool before a page is handed out
again (`state/pages.py`), and never touches a result: outputs are bitwise the LRU run's and
the model's own, and each test asserts the evictions it is about."""

from __future__ import annotations

import random

import pytest
import torch

import workbench
from workbench.attention import attend, plan_tiles, to_blocks
from workbench.errors import ConfigError
from workbench.state.pages import PagePool
from workbench.state.prefix_cache import PrefixCache


def _ids(n, seed, vocab=390):
    rnd = random.Random(seed)
    return [rnd.randrange(4, vocab) for _ in range(n)]


# -- the order ------------------------------------------------------------------------------

def test_the_scored_cache_evicts_the_least_attended_page_ties_by_age():
    c = PrefixCache(scored=True)
    for page in range(5):
        c.register(page, bytes([page]))
    for page, score in ((0, 3.0), (1, 0.5), (2, 0.5), (3, 9.0)):
        c.rescore(page, score)
        c.make_evictable(page)
    c.make_evictable(4)  # never read: no mass
    c.claim(2)  # a prefix hit took it back: not evictable
    assert [c.evict() for _ in range(3)] == [4, 1, 0]
    c.rescore(3, 0.1)  # a page's score can fall below another's only by a new read: it moves
    c.make_evictable(2)
    assert c.evict() == 3 and c.evict() == 2 and c.evict() is None
    c.check()
    lru = PrefixCache()
    for page in (5, 6):
        lru.register(page, bytes([page]))
        lru.make_evictable(page)
    lru.rescore(5, 100.0)  # (kept, but LRU order ignores it)
    assert lru.evict() == 5


def test_the_pool_reads_released_pages_before_it_hands_any_out():
    """Mass is read (and zeroed) in one call per allocation that follows a release; a hashed page
    adds every read to its score, a free one's is dropped."""
    device = {"g": {}}  # the runner's side: page -> mass since its last read
    reads = []

    def reader(group, pages):
        reads.append(list(pages))
        got = [device[group].get(p, 0.0) for p in pages]
        for p in pages:
            device[group][p] = 0.0
        return got

    pool = PagePool("g", 3, reader)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert reads == []  # nothing released yet: no read
    for page, h in ((a, b"a"), (b, b"b")):
        pool.cache.register(page, h)
    device["g"].update({a: 2.0, b: 0.25, c: 7.0})
    for page in (a, b, c):
        pool.decref(page)
    assert pool.num_cached == 2 and pool.num_free == 1
    page = pool.allocate()  # the free page (c): but first the three released ones are read
    assert reads == [sorted((a, b, c))] and page == c and device["g"][c] == 0.0
    assert pool.cache.score == {a: 2.0, b: 0.25}
    assert pool.allocate() == b  # the least attended cached page goes first
    pool.incref(a)  # a hit: a keeps its score and adds what it receives next
    device["g"][a] = 1.0
    pool.decref(a)
    pool.decref(b)
    pool.allocate()
    assert pool.cache.score == {a: 3.0} and reads[-1] == sorted((a, b))
    pool.check()


# -- the measurement ------------------------------------------------------------------------

@pytest.mark.parametrize("window, rows", [(0, 1), (0, 37), (96, 5)])
def test_attend_measures_each_pages_share_of_the_softmax_and_changes_no_bit(window, rows):
    """The mass a page receives is its share of every row's and head's softmax: per row and head
    the shares sum to 1, and each page's total is what a plain softmax gives, to rounding."""
    g = torch.Generator().manual_seed(3)
    L, H, Hkv, D, P = 700, 4, 2, 16, 256
    k_rows, v_rows = torch.randn(768, Hkv, D, generator=g), torch.randn(768, Hkv, D, generator=g)
    kb, vb = to_blocks(k_rows, v_rows)
    table = torch.tensor([2, 0, 1])  # logical blocks on scattered pages
    kp, vp = torch.empty_like(kb), torch.empty_like(vb)
    kp[table], vp[table] = kb, vb
    pos = torch.arange(L - rows, L)
    q = torch.randn(rows, H, D, generator=g)
    mass = torch.zeros(3, dtype=torch.float64)
    out = attend(q, kp, vp, pos, window, 0.25, plan_tiles(pos, window), table, mass=mass)
    assert torch.equal(out, attend(q, kp, vp, pos, window, 0.25, plan_tiles(pos, window), table))
    assert abs(float(mass.sum()) - rows * H) < 1e-6 * rows * H  # (float32 shares)
    s = torch.einsum("rhd,lhd->rhl", q.double(), k_rows[:L].double().repeat_interleave(H // Hkv, 1)) * 0.25
    kpos, qpos = torch.arange(L).view(1, 1, L), pos.view(-1, 1, 1)
    hidden = (kpos > qpos) | (((qpos - kpos) >= window) if window else torch.zeros((), dtype=torch.bool))
    prob = s.masked_fill(hidden, float("-inf")).softmax(-1).sum((0, 1))  # [L]
    want = torch.zeros(3, dtype=torch.float64)
    for blk in range(3):
        want[table[blk]] = prob[blk * P : (blk + 1) * P].sum()
    assert torch.allclose(mass, want, rtol=1e-5, atol=1e-6)


# -- the engine -----------------------------------------------------------------------------

def _engine(m, eviction, page=256, **kw):
    cfg = workbench.EngineConfig(max_concurrency=1, dtype=m.dtype_name, kv_resident_tokens=4 * page,
                                 admission_headroom_tokens=0, eviction=eviction, **kw)
    return workbench.Engine(m, cfg, keep_logits=True)


def _serve(e, prompts):
    """The prompts one after another; every cache eviction with the scores the cache held then."""
    evicted = []
    for pool in e.scheduler.allocator.pools.values():
        real = pool.cache.evict

        def watch(real=real, cache=pool.cache):
            before = {p: cache.score.get(p, 0.0) for p in cache.evictable()}
            page = real()
            if page is not None:
                evicted.append((page, before))
            return page

        pool.cache.evict = watch
    out = [e.generate([p], max_tokens=3, ignore_eos=True)[0] for p in prompts]
    steps = e.telemetry.steps()
    return (out, evicted, int(steps.select(pl_sum("pages_evicted_")).item()), int(steps["prefix_hit_tokens"].sum()))


def test_scored_eviction_keeps_the_attended_pages_and_every_bit(tiny_model):
    """Requests one after another on a four-page pool: each leaves its full prompt pages cached,
    the next ones evict some. Scored and LRU evict different pages; every request's tokens and
    logits are the same bits either way, and the scored run's evictions each took the least
    attended page then cached (so the last request, which repeats the second prompt's start,
    hits its first page under scored and misses under LRU)."""
    m = tiny_model("llama", "float32")
    prompts = [_ids(520, s) for s in range(3)] + [_ids(260, 9)]
    prompts.append(prompts[1][:512] + _ids(10, 10))  # a later hit on the second prompt's pages
    runs = {ev: _serve(_engine(m, ev), prompts) for ev in ("lru", "scored")}
    (lru_out, lru_ev, lru_n, _), (out, ev, n, hits) = runs["lru"], runs["scored"]
    for a, b in zip(out, lru_out):
        assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)
    assert n == len(ev) > 0 and lru_n == len(lru_ev) > 0
    for page, before in ev:  # each scored eviction took a least attended page, all read
        assert before[page] == min(before.values()) and all(v > 0 for v in before.values())
    assert [p for p, _ in ev] != [p for p, _ in lru_ev]
    # a prompt's first page takes most of its rows' mass (the sink), so scored keeps the first
    # pages and the last request's hit on the second prompt's finds it; LRU had evicted it
    assert hits == 256 and runs["lru"][3] == 0


def pl_sum(prefix: str):
    import polars as pl

    return pl.sum_horizontal(pl.col(f"^{prefix}.*$").sum())


def test_the_triton_runner_measures_the_mass_in_its_graphs_with_the_same_bits(tiny_model):
    """The Triton runner (under the interpreter: graphs emulated, 64-position pages) measures the
    mass from its attention partials (kernels/attention.py's segment_mass), in decode graphs and
    chunk graphs alike; scored and LRU runs give the same bits, and each scored eviction took a
    least attended page."""
    from workbench.runners.triton_options import TritonOptions

    m = tiny_model("llama", "float32", "Q8_0", n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)
    prompts = [_ids(70, s) for s in range(3)] + [_ids(35, 9)]
    prompts.append(prompts[1][:64] + _ids(3, 10))
    kw = dict(backend="triton", max_context=128, memory_budget_bytes=1 << 30,
              triton=TritonOptions(graphs=True if torch.cuda.is_available() else "emulate", page_size=32,
                                   attn_segment=32))
    runs = {ev: _serve(_engine(m, ev, page=32, **kw), prompts) for ev in ("lru", "scored")}
    (lru_out, lru_ev, lru_n, _), (out, ev, n, hits) = runs["lru"], runs["scored"]
    for a, b in zip(out, lru_out):
        assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)
    assert n == len(ev) > 0 and lru_n == len(lru_ev) > 0
    for page, before in ev:
        assert before[page] == min(before.values()) and all(v > 0 for v in before.values())
    assert [p for p, _ in ev] != [p for p, _ in lru_ev] and hits > runs["lru"][3]


def test_scored_eviction_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="prefix_cache is off: allowed eviction='lru', or prefix_cache=True"):
        workbench.EngineConfig(eviction="scored", prefix_cache=False)
    with pytest.raises(ConfigError, match="eviction='mru' is not allowed: allowed lru, scored"):
        workbench.EngineConfig(eviction="mru")
