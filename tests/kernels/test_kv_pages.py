"""The attention kernels through block tables (kernels/kv_pages.py): a sequence's K/V scattered
over pages in any order, every page it does not own poisoned with NaN, gives bitwise the
contiguous cache's result, for attention (decode, prefill and mixed rows, sliding windows,
one- and multi-block segments, the fused and two-launch combine), the QK-norm/rope/KV write and
the rope prologue inside the attention launch."""

import pytest
import torch

from workbench.kernels import attention as attention_mod
from workbench.kernels.attention import RopePrologue, attention_rows
from workbench.kernels.step_fused import qk_rope_kv

PAGE = 64


def _paged_copy(cache: torch.Tensor, lens: list[int], gen: torch.Generator, extra: int = 3):
    """(pages [P, PAGE, Hkv, D] NaN but for the sequences' positions, block table int32 [S, W]):
    cache [S, L, Hkv, D]'s first lens[s] positions of each sequence on shuffled pages; table
    entries past a sequence's pages -1 (never read)."""
    S, L = cache.shape[:2]
    W = -(-L // PAGE)
    need = [-(-n // PAGE) for n in lens]
    P = sum(need) + extra
    order = torch.randperm(P, generator=gen).tolist()
    pages = torch.full((P, PAGE, *cache.shape[2:]), float("nan"), dtype=cache.dtype, device=cache.device)
    table = torch.full((S, W), -1, dtype=torch.int32)
    for s in range(S):
        for i in range(need[s]):
            p = order.pop()
            table[s, i] = p
            n = min(PAGE, lens[s] - i * PAGE)
            pages[p, :n] = cache[s, i * PAGE : i * PAGE + n]
    return pages, table.to(cache.device)


def _gather(pages, table, s, n):
    return torch.cat([pages[int(p)] for p in table[s, : -(-n // PAGE)]])[:n]


@pytest.mark.parametrize("dtype,segment", [(torch.float32, 64), (torch.bfloat16, 32), (torch.bfloat16, 64)])
@pytest.mark.parametrize("fused", [False, True])
def test_attention_through_block_tables_is_the_contiguous_cache(dtype, segment, fused, device):
    gen = torch.Generator().manual_seed(3)
    S, L, Hq, Hkv, D = 3, 200, 4, 2, 32
    k = torch.randn(S, L, Hkv, D, generator=gen).to(dtype).to(device)
    v = torch.randn(S, L, Hkv, D, generator=gen).to(dtype).to(device)
    lens = [200, 65, 130]
    # decode rows (seq 0 at 199, seq 2 at 129 windowed) and a prefill chunk of seq 1 across a page edge
    seq = torch.tensor([0, 2, 1, 1, 1, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([199, 129, 61, 62, 63, 64], dtype=torch.int32, device=device)
    win = torch.tensor([0, 37, 0, 0, 16, 16], dtype=torch.int32, device=device)
    q = torch.randn(len(seq), Hq, D, generator=gen).to(dtype).to(device)
    kp, table = _paged_copy(k, lens, gen)
    vp = torch.full_like(kp, float("nan"))
    for s in range(S):  # the same pages for V as for K
        for i, p in enumerate(table[s].tolist()):
            if p >= 0:
                n = min(PAGE, lens[s] - i * PAGE)
                vp[p, :n] = v[s, i * PAGE : i * PAGE + n]
    counters = torch.zeros(64, dtype=torch.int32, device=device) if fused else None
    kw = dict(counters=counters, segment=segment, precision="bf16" if dtype == torch.bfloat16 else None)
    want = attention_rows(q, k, v, seq, pos, win, 0.2, **kw)
    got = attention_rows(q, kp, vp, seq, pos, win, 0.2, block_table=table, **kw)
    assert torch.equal(got, want)
    assert not torch.isnan(got).any()
    if counters is not None:
        assert not counters.any()


def test_block_table_checks(device):
    k = torch.zeros(4, PAGE, 1, 16, device=device)
    q = torch.zeros(1, 1, 16, device=device)
    i = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_table must be int32"):
        attention_rows(q, k, k, i, i, i, 1.0, block_table=torch.zeros(1, 2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="whole attention segments"):
        attention_rows(q, k, k, i, i, i, 1.0, block_table=torch.zeros(1, 2, dtype=torch.int32, device=device),
                       segment=128)
    if device.type == "cpu":  # (value checks run where they cost no device sync)
        with pytest.raises(ValueError, match=r"row_pos must lie in \[0, 128\)"):
            attention_rows(q, k, k, i, i + 128, i, 1.0, segment=64,
                           block_table=torch.zeros(1, 2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("segment", [32, 64])
def test_kv_write_and_rope_prologue_through_block_tables(segment, device):
    """qk_rope_kv and the rope prologue write each row's K/V at (table[seq, pos // PAGE],
    pos % PAGE): the pages gathered back are the contiguous pools, q and the output the same
    bits; pages no row owns stay NaN."""
    preload = attention_mod._attention_config(16, 32, 2, segment)[0] == segment
    gen = torch.Generator().manual_seed(5)
    R, Hq, Hkv, D, S, L, splits = 3, 4, 2, 32, 3, 192, 2
    lens = [129, 1, 64]  # rows at positions 128 (a page's first), 0 and 63 (a page's last)
    part = torch.randn(splits, R, (Hq + 2 * Hkv) * D, generator=gen).to(device)
    kc = torch.randn(S, L, Hkv, D, generator=gen).to(torch.bfloat16).to(device)
    vc = torch.randn(S, L, Hkv, D, generator=gen).to(torch.bfloat16).to(device)
    seq = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=device)
    win = torch.tensor([0, 0, 16], dtype=torch.int32, device=device)
    inv = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    qn, kn = torch.randn(D, generator=gen).to(device), torch.randn(D, generator=gen).to(device)
    kp, table = _paged_copy(kc, lens, gen)
    vp = torch.full_like(kp, float("nan"))
    for s in range(S):
        for i, p in enumerate(table[s].tolist()):
            if p >= 0:
                n = min(PAGE, lens[s] - i * PAGE)
                vp[p, :n] = vc[s, i * PAGE : i * PAGE + n]
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    rope = RopePrologue(part, qn, kn, inv, 1e-6)
    for prologue in (False, True):
        out = {}
        for paged in (False, True):
            q = torch.full((R, Hq, D), float("nan"), device=device)
            k, v = (kp.clone(), vp.clone()) if paged else (kc.clone(), vc.clone())
            bt = table if paged else None
            if prologue:
                o = attention_rows(q, k, v, seq, pos, win, 0.2, counters=counters, precision="bf16", rope=rope,
                                   segment=segment, block_table=bt)
            else:
                qk_rope_kv(part, q, k, v, seq, pos, qn, kn, inv, 1e-6, block_table=bt)
                o = attention_rows(q, k, v, seq, pos, win, 0.2, counters=counters, precision="bf16",
                                   segment=segment, block_table=bt)
            if paged:
                k = torch.stack([torch.cat([_gather(k, table, s, lens[s]), kc[s, lens[s]:]]) for s in range(S)])
                v = torch.stack([torch.cat([_gather(v, table, s, lens[s]), vc[s, lens[s]:]]) for s in range(S)])
            out[paged] = (q, k, v, o)
        for a, b in zip(out[True], out[False]):
            assert torch.equal(a, b)
    used = {p for p in table.flatten().tolist() if p >= 0}
    free = [p for p in range(kp.shape[0]) if p not in used]
    assert free and torch.isnan(kp[free]).all()
    assert preload == (segment == 32)
