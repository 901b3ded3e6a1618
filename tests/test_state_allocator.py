"""PageAllocator: the edge cases, one by one (test_state_machine.py interleaves them)."""

import pytest

from workbench.errors import WorkbenchError
from workbench.state import (
    KVGroup,
    PageAllocator,
    PageCopy,
    SeqStateSpec,
    SlotCopy,
    StateLayout,
    cache_key,
    chain_hashes,
)

P = 4  # small pages keep the tests readable; the real default is checked below


def layout(window: int = 0, page_size: int = P, **kw) -> StateLayout:
    groups = (KVGroup("global", (0,)),) + ((KVGroup("sliding", (1,), window),) if window else ())
    return StateLayout(groups, page_size=page_size, key_blocks=(page_size,), **kw)


def alloc(num_pages=16, window=0, **kw) -> PageAllocator:
    lay = layout(window)
    return PageAllocator(lay, {g: num_pages for g in lay.group_names}, cache_key=cache_key("m", "bf16"), **kw)


def grow(a: PageAllocator, seq, tokens, fence=None):
    """append + commit, as the engine does around a step."""
    copies = a.append(seq, len(tokens), fence)
    a.commit(seq, tokens)
    a.check()
    return copies


def table(a, seq, group="global"):
    return a.block_table(seq, group).entries


def test_append_keeps_each_sequence_in_one_run():
    """A sequence's next page is the one after its last; a new sequence starts halfway along
    the largest free run (at page 0 in an empty pool), so two sequences growing in turn do not
    interleave their pages (with the lowest free id first they would: a 0, 1, 3 and b 2, 4)."""
    a = alloc(8, prefix_cache=False)
    a.add("a")
    a.add("b")
    grow(a, "a", range(5))  # 2 pages, from the pool's start
    grow(a, "b", range(3))  # the largest run is 2..7: b starts halfway along it
    assert table(a, "a") == (0, 1) and table(a, "b") == (5,)
    grow(a, "a", [9] * 4)
    grow(a, "b", [9] * 2)
    assert table(a, "a") == (0, 1, 2) and table(a, "b") == (5, 6)
    assert a.pools["global"].free_runs() == [(3, 5), (7, 8)]
    a.free("b")  # its pages merge back into one run, 3..7
    assert a.pools["global"].free_runs() == [(3, 8)]
    a.add("c")
    grow(a, "c", [1])
    assert table(a, "c") == (5,)
    assert a.block_table("a", "global").locate(9) == (2, 1)
    s = a.read_stats().groups[0]
    assert (s.num_used, s.num_free, s.num_cached, s.num_quarantined) == (4, 4, 0, 0)


def test_a_first_append_of_several_pages_takes_a_run_that_fits():
    """A prompt's pages go to one run when a free run is long enough, even when lower ids are
    free but scattered; when none is, they fill the largest run and continue in the next."""
    a = alloc(12, prefix_cache=False)
    for i in range(5):  # five one-page sequences: page 0, then halfway along the largest run each
        a.add(i)
        grow(a, i, [i] * 4)
    starts = [table(a, i)[0] for i in range(5)]
    assert starts == [0, 6, 3, 9, 2]
    a.free(1)
    assert a.pools["global"].free_runs() == [(1, 2), (4, 9), (10, 12)]
    a.add("p")
    grow(a, "p", range(12))  # 3 pages: the run 4..8 holds them, halfway along it (lowest ids: 1, 4, 5)
    assert table(a, "p") == (6, 7, 8)
    a.add("q")
    grow(a, "q", range(16))  # 4 pages, no run fits: the largest (4..5, the lowest of two), then 10..11
    assert table(a, "q") == (4, 5, 10, 11)
    a.check()


def test_allocation_is_deterministic_and_keeps_the_heap_small():
    """The same calls give the same ids; many allocations and frees leave the heap of free runs
    at most about twice the runs (stale entries are dropped), so no step slows with the pool's age."""
    import random

    def run(seed):
        a, rng, live, out = alloc(64, prefix_cache=False), random.Random(seed), [], []
        for step in range(400):
            if live and (rng.random() < 0.4 or not a.can_append(live[-1], 4)):
                a.free(live.pop(rng.randrange(len(live))))
            else:
                if not live or rng.random() < 0.3:
                    live.append(step)
                    a.add(step)
                seq, n = rng.choice(live), rng.randint(1, 9)
                if a.can_append(seq, n):
                    grow(a, seq, [1] * n)
            pool = a.pools["global"]
            assert len(pool._free._largest) <= 2 * len(pool.free_runs()) + 16
            out.append(tuple(table(a, s) for s in live))
        return out

    assert run(1) == run(1)


def test_can_append_refuses_without_changing_anything():
    a = alloc(2)
    a.add("a")
    assert a.can_append("a", 8) and not a.can_append("a", 9)
    assert a.pages_needed("a", 9) == {"global": 3}
    with pytest.raises(WorkbenchError, match="cannot grow by 9 positions: group 'global' needs 3 pages, 2 available"):
        a.append("a", 9)
    assert a.sequence("a").length == 0 and a.read_stats().groups[0].num_used == 0
    a.check()


def test_free_leaves_no_page_behind():
    a = alloc(8, prefix_cache=False)
    a.add("a")
    grow(a, "a", range(11))
    a.free("a")
    a.check()
    s = a.read_stats().groups[0]
    assert (s.num_used, s.num_free, s.num_allocated, s.num_freed) == (0, 8, 3, 3)
    assert "a" not in a and a.num_sequences == 0
    with pytest.raises(WorkbenchError, match="unknown sequence 'a'"):
        a.free("a")


def test_truncate_frees_pages_past_the_new_length():
    a = alloc(8)
    a.add("a")
    a.append("a", 10)  # pages 0, 1, 2
    a.commit("a", range(6))
    a.truncate("a", 8)  # speculation rejected positions 8, 9
    a.check()
    assert table(a, "a") == (0, 1) and a.sequence("a").length == 8
    a.truncate("a", 5)
    assert table(a, "a") == (0, 1) and a.sequence("a").token_ids == [0, 1, 2, 3, 4]
    assert len(a.sequence("a").hashes) == 1
    with pytest.raises(WorkbenchError, match=r"new_len=6 is out of range: allowed 0\.\.5"):
        a.truncate("a", 6)
    a.check()


def test_truncate_cannot_bring_back_a_dropped_page():
    a = alloc(8, window=8)  # P = 4: a query at q sees q - 7..q
    a.add("a")
    a.append("a", 12)
    a.append("a", 1)  # the query at 12 sees 5..12: sliding page 0 (0..3) is dropped
    assert table(a, "a", "sliding")[0] is None and a.min_length("a") == 11  # 11 sees 4..11
    with pytest.raises(WorkbenchError, match=r"new_len=10 is out of range: allowed 11\.\.13"):
        a.truncate("a", 10)
    a.truncate("a", 11)
    a.check()
    assert a.sequence("a").floor == 11
    with pytest.raises(WorkbenchError, match=r"num_tokens=9 is out of range: allowed 11\.\.11"):
        a.fork("a", "b", 9)
    # max_rollback keeps pages for truncating that far below the last append's start
    b = alloc(8, window=8, max_rollback=2)
    b.add("a")
    b.append("a", 12)
    b.append("a", 1)  # floor 10: the query at 10 sees 3..10, page 0 stays
    assert b.min_length("a") == 0
    b.truncate("a", 5)
    b.check()
    # without sliding groups any length is allowed
    c = alloc(8)
    c.add("a")
    c.append("a", 12)
    c.append("a", 1)
    c.truncate("a", 0)
    assert table(c, "a") == ()


def test_commit_past_length_is_refused():
    a = alloc()
    a.add("a")
    a.append("a", 2)
    with pytest.raises(WorkbenchError, match="commits 3 tokens past its 0 committed: allowed up to its length 2"):
        a.commit("a", [1, 2, 3])


def test_fork_shares_full_pages_and_copies_the_partial_one():
    a = alloc(8)
    a.add("p")
    grow(a, "p", range(10))  # pages 0, 1 full, 2 partial
    copies = a.fork("p", "c", 10)  # (its copy of page 2 starts a run halfway along 3..7)
    a.check()
    assert table(a, "c")[:2] == (0, 1) and table(a, "c")[2] == 5
    assert copies == [PageCopy("global", 2, 5, 2)]
    assert a.pools["global"].refcount[:6] == [2, 2, 1, 0, 0, 1]
    # each writes its own partial page in place: no copy
    assert grow(a, "p", [7]) == [] and grow(a, "c", [8]) == []
    # a fork at a page boundary copies nothing
    assert a.fork("p", "d", 8) == [] and table(a, "d") == (0, 1)
    a.check()
    with pytest.raises(WorkbenchError, match=r"num_tokens=12 is out of range: allowed 0\.\.11"):
        a.fork("p", "e", 12)


def test_appending_into_a_shared_page_copies_it_first():
    a = alloc(8, prefix_cache=False)
    a.add("p")
    a.append("p", 8)
    a.fork("p", "c", 8)  # pages 0, 1 shared
    a.truncate("c", 6)  # c's last page (1) is shared and now partial
    assert table(a, "c") == (0, 1)
    copies = a.append("c", 1)  # (page 2, after 0, is taken: the copy starts a run halfway along 2..7)
    a.check()
    assert copies == [PageCopy("global", 1, 5, 2)]
    assert table(a, "c") == (0, 5) and table(a, "p") == (0, 1)
    assert a.pools["global"].refcount[:6] == [2, 1, 0, 0, 0, 1]


def test_appending_into_a_cached_page_copies_it_and_keeps_the_cache():
    a = alloc(8)
    a.add("a")
    grow(a, "a", range(8))  # pages 0, 1 full and hashed
    a.truncate("a", 6)  # page 1 is private but cached: read-only
    assert a.pools["global"].is_read_only(1)
    assert grow(a, "a", [50]) == [PageCopy("global", 1, 5, 2)]  # (halfway along the free 2..7)
    assert table(a, "a") == (0, 5)
    assert a.pools["global"].cache.evictable() == [1]  # the cached content is kept
    m = a.match(list(range(8)) + [99])
    assert m.num_tokens == 8 and m.pages["global"] == (0, 1)
    # a second page with the same content stays private: the first copy is the cached one
    a.add("b")
    grow(a, "b", range(8))
    assert table(a, "b") == (3, 4)
    assert a.pools["global"].cache.hash_of(3) is None and a.pools["global"].cache.hash_of(4) is None
    assert a.pools["global"].cache.lookup(a.sequence("b").hashes[1]) == 1


def test_pages_for_prompt_counts_the_hit_and_the_peak():
    a = small_sliding()
    prompt = list(range(17))
    a.add("a")
    grow(a, "a", prompt)
    a.free("a")
    m = a.match(prompt + [0] * 16)  # 33 tokens, the first 16 cached
    assert m.num_tokens == 16
    # global: 4 cached pages leave the LRU, 5 new (positions 16..32); sliding: 2 cached pages
    # plus the 5 new (positions 9..32 span 7 pages in one append); one position an append:
    # at most 3 live pages, the two hit pages among them (pages 2 and 3, then page 4 for
    # position 16; page 2 dies as page 5 is taken)
    assert a.pages_for_prompt(33, m) == {"global": 4 + 5, "sliding": 2 + 5}
    assert a.pages_for_prompt(33, m, chunk=1) == {"global": 9, "sliding": 3}
    assert a.pages_for_prompt(33) == {"global": 9, "sliding": 9}


def test_prefix_match_after_free_skips_prefill():
    a = alloc(8)
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages
    a.add("a")
    grow(a, "a", prompt)
    a.free("a")
    a.check()
    assert a.read_stats().groups[0].num_cached == 2
    m = a.match(prompt)
    assert (m.num_tokens, m.pages["global"]) == (8, (0, 1))
    assert a.add("b", m) == 8
    a.check()
    assert table(a, "b") == (0, 1) and a.sequence("b").length == 8
    grow(a, "b", prompt[8:])
    assert table(a, "b") == (0, 1, 2)
    st = a.read_stats()
    assert st.prefix_hit_tokens == 8 and st.groups[0].num_cached == 0
    assert a.read_stats().prefix_hit_tokens == 0  # counters restart with each read


def test_full_prompt_hit_keeps_one_token_to_compute():
    a = alloc(8)
    a.add("a")
    grow(a, "a", range(8))
    assert a.match(list(range(8))).num_tokens == 4  # the last token must run for its logits
    assert a.match(list(range(9))).num_tokens == 8
    assert a.match(list(range(3))).num_tokens == 0
    assert a.match([0, 1, 2, 3, 9, 9, 9, 9, 9]).num_tokens == 4  # the chain diverges at page 1


def test_hashes_depend_on_the_cache_key_and_the_prefix():
    lay = layout()
    a = PageAllocator(lay, {"global": 8}, cache_key=cache_key("m", "bf16"))
    b = PageAllocator(lay, {"global": 8}, cache_key=cache_key("m", "f32"))
    for x in (a, b):
        x.add("s")
        grow(x, "s", range(8))
    assert a.sequence("s").hashes != b.sequence("s").hashes
    # the same page content after a different first page hashes differently
    a.add("t")
    grow(a, "t", [9, 9, 9, 9, 4, 5, 6, 7])
    assert a.sequence("t").hashes[1] != a.sequence("s").hashes[1]
    assert a.match([9, 9, 9, 9, 4, 5, 6, 7, 0]).pages["global"] == table(a, "t")


def test_prefix_cache_off():
    a = alloc(4, prefix_cache=False)
    a.add("a")
    grow(a, "a", range(8))
    a.free("a")
    assert a.match(list(range(9))).num_tokens == 0
    assert a.read_stats().groups[0].num_free == 4


def test_lru_evicts_least_recently_freed_deepest_first():
    a = alloc(4)
    a.add("a")
    grow(a, "a", range(8))  # pages 0, 1
    a.add("b")
    grow(a, "b", range(20, 28))  # pages 2, 3
    a.free("a")  # LRU: 1, 0 (deepest first)
    a.free("b")  # LRU: 1, 0, 3, 2
    assert a.pools["global"].cache.evictable() == [1, 0, 3, 2]
    a.add("c")
    grow(a, "c", [5] * 4)
    assert table(a, "c") == (1,)  # a's tail went first
    assert a.match(list(range(9))).num_tokens == 4  # a's first page is still cached
    m = a.match(list(range(20, 29)))
    assert m.num_tokens == 8
    a.add("d", m)  # a hit takes b's pages out of the LRU
    assert a.pools["global"].cache.evictable() == [0]
    grow(a, "c", [5] * 4)
    assert table(a, "c") == (1, 0)
    assert a.read_stats().groups[0].num_evicted == 2
    a.check()


def test_stale_match_is_refused():
    a = alloc(2)
    a.add("a")
    grow(a, "a", range(8))
    a.free("a")
    m = a.match(list(range(9)))
    a.add("x")
    a.append("x", 5)  # evicts both cached pages
    with pytest.raises(WorkbenchError, match="prefix match is stale"):
        a.add("b", m)
    assert "b" not in a
    a.check()


def test_commit_of_other_tokens_into_a_cached_page_is_refused():
    a = alloc(8)
    a.add("a")
    grow(a, "a", range(4))
    a.append("a", 4)
    a.fork("a", "b", 8)  # b shares page 1 before a committed it
    a.commit("a", [1] * 4)
    with pytest.raises(WorkbenchError, match="differ from its cached content"):
        a.commit("b", [4, 5, 6, 7])


def test_quarantined_pages_are_never_handed_out():
    a = alloc(3)
    a.add("a")
    a.append("a", 8)  # pages 0, 1; a run-ahead step 7 may still write them
    a.free("a", fence=7)
    a.check()
    s = a.read_stats().groups[0]
    assert (s.num_quarantined, s.num_free, s.num_freed) == (2, 1, 2)
    a.add("b")
    assert not a.can_append("b", 5)
    a.append("b", 4)
    assert table(a, "b") == (2,)
    a.retire(6)  # an older step: still held
    assert a.read_stats().groups[0].num_quarantined == 2
    a.retire(7)
    a.check()
    assert a.read_stats().groups[0].num_quarantined == 0
    a.append("b", 8)
    assert table(a, "b") == (2, 0, 1)
    # a fence that is already retired releases at once
    a.truncate("b", 4, fence=7)
    assert a.read_stats().groups[0].num_free == 2
    with pytest.raises(WorkbenchError, match="step 3 is older"):
        a.retire(3)


def test_quarantined_cached_pages_cannot_be_matched_until_retired():
    a = alloc(8)
    a.add("a")
    grow(a, "a", range(8))
    a.free("a", fence=1)
    assert a.match(list(range(9))).num_tokens == 0
    a.retire(1)
    assert a.match(list(range(9))).num_tokens == 8


def test_sliding_window_frees_pages_across_the_512_boundary():
    # Gemma 3's shape: 256-position pages, a 512-token window; 3 sliding pages serve any length
    lay = StateLayout((KVGroup("global", (5,)), KVGroup("sliding", (0, 1), 512)), page_size=256)
    a = PageAllocator(lay, {"global": 8, "sliding": 3})
    a.add("a")
    a.append("a", 512)  # prefill 0..511 in one chunk
    while a.sequence("a").length < 2048:  # decode one position a step
        L = a.sequence("a").length
        a.append("a", 1)
        sl = table(a, "a", "sliding")
        for i, page in enumerate(sl):  # the query at L sees keys L - 511..L
            assert (page is None) == ((i + 1) * 256 - 1 < L - 511), (L, i)
        if L in (1022, 1023):
            assert (sl[1] is None) == (L == 1023)  # position 511, page 1's last, leaves at 1023
    a.check()
    assert table(a, "a", "global") == tuple(range(8))
    assert table(a, "a", "sliding")[:5] == (None,) * 5 and len(table(a, "a", "sliding")) == 8
    assert not a.can_append("a", 1)  # the global group is full; the sliding one is not the limit
    # the query at 2048 sees 1537..2048: sliding pages 6, 7 and a new one
    assert a.pages_needed("a", 1) == {"global": 1, "sliding": 1}
    assert (a.pools["global"].num_available, a.pools["sliding"].num_available) == (0, 1)


def test_sliding_window_drops_at_the_exact_position():
    lay = StateLayout((KVGroup("sliding", (0,), 512),), page_size=256)
    a = PageAllocator(lay, {"sliding": 8})
    a.add("a")
    a.append("a", 767)  # positions 0..766; floor 0
    a.append("a", 1)  # the query at 767 sees 256..767: page 0 (0..255) is dead
    assert table(a, "a", "sliding") == (None, 1, 2)
    a.append("a", 255)  # queries 768..1022: page 1 (256..511) is still seen at 1022
    assert table(a, "a", "sliding")[1] == 1
    a.append("a", 1)
    assert table(a, "a", "sliding")[:2] == (None, None)
    a.check()


def small_sliding() -> PageAllocator:
    lay = StateLayout((KVGroup("global", (5,)), KVGroup("sliding", (0,), 8)), page_size=4, key_blocks=(4,))
    return PageAllocator(lay, {"global": 8, "sliding": 8})


def test_sliding_prefix_hit_needs_only_the_window():
    a = small_sliding()
    prompt = list(range(17))
    a.add("a")
    for t in prompt:
        grow(a, "a", [t])
    assert table(a, "a", "sliding")[:2] == (None, None)  # the query at 16 sees 9..16
    a.free("a")
    m = a.match(prompt)  # the hit at 16 needs sliding pages 2, 3 only: 0, 1 went back earlier
    assert m.num_tokens == 16 and m.pages["sliding"][:2] == (None, None)
    assert m.pages["global"] == (0, 1, 2, 3)
    a.add("b", m)
    a.check()
    assert a.block_table("b", "sliding").entries == m.pages["sliding"]
    assert a.sequence("b").floor == 16 and a.min_length("b") == 15


def test_sliding_prefix_hit_shortens_when_the_window_was_evicted():
    a = small_sliding()
    prompt = list(range(17))
    a.add("a")
    grow(a, "a", prompt)  # pages 0..4 in both groups, 0..3 hashed
    a.free("a")
    m12 = a.match(prompt[:13])
    assert m12.num_tokens == 12 and m12.pages["sliding"] == (None, 1, 2)  # 12 sees 5..12
    a.add("b", m12)  # holds sliding pages 1, 2
    sliding, h3 = a.pools["sliding"], chain_hashes(prompt, 4, a.root)[3]
    taken = []
    while sliding.cache.lookup(h3) is not None:  # allocate until sliding page 3 is evicted
        taken.append(sliding.allocate())
    for p in taken:
        sliding.decref(p)
    a.free("b")
    a.check()
    assert a.pools["global"].cache.lookup(h3) == 3  # the global group alone would serve 16
    m = a.match(prompt)
    assert m.num_tokens == 12 and m.pages["sliding"] == (None, 1, 2) and m.pages["global"] == (0, 1, 2)


def test_state_slots_versions_and_fork():
    lay = layout(seq_state=(SeqStateSpec("recurrent", (2, 4, 4)),))
    a = PageAllocator(lay, {"global": 8}, num_state_slots=2, state_versions=3)
    a.add("a")
    assert a.state_slots("a") == (0, 1, 2)
    assert a.state.accept("a", 2) == 2 and a.state_slots("a") == (2, 0, 1)
    a.append("a", 6)
    copies = a.fork("a", "b", 6)
    assert copies == [PageCopy("global", 1, 5, 2), SlotCopy(2, 3)]
    assert not a.can_add()
    with pytest.raises(WorkbenchError, match="no free state slot"):
        a.add("c")
    a.free("a", fence=4)
    assert not a.can_add() and a.read_stats().num_state_quarantined == 1
    a.retire(4)
    a.add("c")
    assert a.state_slots("c") == (0, 1, 2)
    a.check()
    with pytest.raises(WorkbenchError, match=r"num_accepted=3 is out of range: allowed 0\.\.2"):
        a.state.accept("c", 3)


def test_telemetry_record():
    a = alloc(8, window=8)
    a.add("a")
    grow(a, "a", range(9))
    rec = a.read_stats().record()
    assert rec["pages_used_global"] == 3 and rec["pages_allocated_sliding"] == 3
    assert rec["pages_free_global"] == 5 and rec["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("bad, msg", [
    (dict(num_pages={"other": 4}), "allowed exactly"),
    (dict(num_pages={"global": 0}), "num_pages=0"),
    (dict(max_rollback=-1), "max_rollback=-1"),
])
def test_bad_allocator_config(bad, msg):
    kw = dict(num_pages={"global": 4})
    kw.update(bad)
    with pytest.raises(WorkbenchError, match=msg):
        PageAllocator(layout(), **kw)


def test_bad_calls():
    a = alloc()
    a.add("a")
    with pytest.raises(WorkbenchError, match="already exists"):
        a.add("a")
    with pytest.raises(WorkbenchError, match="n=0 positions is out of range"):
        a.append("a", 0)
    with pytest.raises(WorkbenchError, match="unknown sequence 'z'"):
        a.append("z", 1)
    with pytest.raises(WorkbenchError, match="fence=-1 is not a step id"):
        a.retire(-1)
