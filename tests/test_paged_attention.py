"""Attention through block tables (issue 19): a sequence whose KV lies in scattered pages of a
shared pool, next to other sequences, with every page it does not own (and every unwritten
position of its own) poisoned with NaN, gives bitwise the logits of the same sequence in a
private pool read in order (Model.new_state: the identity block table, i.e. the contiguous
cache of before paging; when paging landed, its logits were checked bitwise against the
pre-paging tree)."""

import random

import pytest
import torch

from workbench.attention import KV_BLOCK, attend, attend_ref, to_blocks
from workbench.model import KVState, Segment
from workbench.state import PageAllocator


def _ids(n, seed):
    rnd = random.Random(seed)
    return [2] + [rnd.randrange(4, 390) for _ in range(n - 1)]


def _poison_unheld(pages, alloc):
    """NaN into every page no live sequence holds (free, recycled, dropped by a window)."""
    for g in alloc.layout.group_names:
        held = {p for sid in list(alloc._seqs) for p in alloc.block_table(sid, g).pages()}
        free = [p for p in range(pages.num_pages(g)) if p not in held]
        if free:
            pages.poison(g, free)


def _run(m, pages, alloc, seq, toks, logits="all"):
    start = alloc.sequence(seq).length
    alloc.append(seq, len(toks))
    tables = {g: torch.tensor(alloc.block_table(seq, g).ids()) for g in alloc.layout.group_names}
    out = m.forward([Segment(KVState(pages, tables, start), toks, logits)])[0]
    alloc.commit(seq, toks)
    return out


@pytest.mark.parametrize("arch,dtype", [("gemma3", "float32"), ("gemma3", "bfloat16"), ("llama", "bfloat16")])
def test_scattered_poisoned_pages_equal_the_contiguous_cache(tiny_model, arch, dtype):
    m = tiny_model(arch, dtype)
    ids = _ids(700, seed=3)
    chunks = [ids[:130], ids[130:300], ids[300:301], ids[301:650], ids[650:]]
    decode = [7, 11, 13, 17, 19]

    ref_state = m.new_state(len(ids) + len(decode))
    ref = [m.forward([Segment(ref_state, c, "all")])[0] for c in chunks]
    ref += [m.forward([Segment(ref_state, [t], "last")])[0] for t in decode]

    layout = m.state_layout
    n_pages = 12
    alloc = PageAllocator(layout, {g: n_pages for g in layout.group_names}, prefix_cache=False)
    pages = m.new_pages({g: n_pages for g in layout.group_names})
    for g in layout.group_names:
        pages.poison(g, range(n_pages))
    alloc.add("x")
    alloc.add("other")
    alloc.append("x", 2 * KV_BLOCK)  # takes the low page ids, so the watched sequence's are not 0, 1, ...
    alloc.add("a")
    got = []
    other = _ids(900, seed=9)
    for i, c in enumerate(chunks):
        got.append(_run(m, pages, alloc, "a", c))
        _run(m, pages, alloc, "other", other[i * 180 : (i + 1) * 180], "none")  # interleaved pages
        if i == 1:
            alloc.free("x")  # its pages are recycled by the next appends
        _poison_unheld(pages, alloc)
    alloc.free("other")
    _poison_unheld(pages, alloc)
    for t in decode:
        got.append(_run(m, pages, alloc, "a", [t], "last"))
        _poison_unheld(pages, alloc)

    tables = {g: alloc.block_table("a", g).ids() for g in layout.group_names}
    assert any(t != list(range(len(t))) for t in tables.values())  # really scattered
    if any(g.sliding for g in layout.groups):  # the window's dropped pages are holes
        assert any(-1 in tables[g.name] for g in layout.groups if g.sliding)
    alloc.check()
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("window", [0, 40, 300])
def test_attend_through_a_table_equals_the_contiguous_blocks(window):
    g = torch.Generator().manual_seed(window)
    length, hkv, h, d = 3 * KV_BLOCK + 50, 2, 4, 16
    k = torch.randn(4 * KV_BLOCK, hkv, d, generator=g)
    v = torch.randn(4 * KV_BLOCK, hkv, d, generator=g)
    q = torch.randn(length, h, d, generator=g)
    pos = torch.arange(length)
    kb, vb = to_blocks(k, v)
    kb[-1, ..., 50:] = float("nan")  # the last block's unwritten tail
    vb[-1, :, 50:] = float("nan")
    want = attend(q, kb, vb, pos, window, 0.3)
    # the same blocks in a pool of 9 pages, out of order, every other page NaN
    order = torch.tensor([6, 2, 8, 0])
    kp = torch.full((9, *kb.shape[1:]), float("nan"))
    vp = torch.full((9, *vb.shape[1:]), float("nan"))
    kp[order], vp[order] = kb, vb
    got = attend(q, kp, vp, pos, window, 0.3, table=order)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.allclose(got, attend_ref(q, k, v, pos, window, 0.3), atol=1e-5, rtol=1e-5)
    if window and window < KV_BLOCK:  # a late pass never reads a dropped page (a hole: -1)
        late = torch.arange(2 * KV_BLOCK + window, length)
        holed = order.clone()
        holed[0] = -1
        kp[6] = float("nan")
        vp[6] = float("nan")
        assert torch.equal(attend(q[late], kp, vp, late, window, 0.3, table=holed), want[late])
