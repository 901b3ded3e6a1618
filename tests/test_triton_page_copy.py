"""Copy-on-write on the Triton runner: a sequence forked from another shares its full pages by
refcount and gets a private copy of the partial last page (`PageAllocator.fork` returns the
`PageCopy`; a segment carries it and `TritonRunner.run` runs it before the forward). The child's
next step is bitwise the parent's at the same position with the same token, on the eager and the
graph path; the pool is poisoned with NaN first, so a copy that did not run shows."""

from dataclasses import replace

import pytest
import torch

from workbench.runners.direct_pages import DirectPages
from workbench.runners.triton_options import TritonOptions
from workbench.runners.triton_runner import TritonRunner

CUDA = torch.cuda.is_available()
LLAMA = {} if CUDA else dict(n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, n_ff=128)


@pytest.mark.parametrize("graphs", [False, True if CUDA else "emulate"])
def test_a_forked_sequence_copies_its_partial_page_and_continues_bitwise(tiny_model, graphs):
    m = tiny_model("llama", "bfloat16" if CUDA else "float32", **LLAMA)
    r = TritonRunner(m, 256, TritonOptions(page_size=64, graphs=graphs))
    pages = DirectPages(r, 512)
    r.kv.poison()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(4, m.config.vocab_size, (70,), generator=gen).tolist()  # a full page and 6 positions
    first = r.run([pages.segment(0, "a", prompt, 0)], {0: 256})[0]
    tok = int(first.argmax())
    parent = r.run([pages.segment(0, "a", (tok,), 70)], {0: 256})[0]  # the parent's position 70
    alloc = pages.allocator
    copies = pages.fork("a", "b", 70)  # the child: positions 0..69
    assert [(c.num_positions, c.src) for c in copies] == [(6, alloc.block_table("a", "global").ids()[1])]
    shared = alloc.block_table("a", "global").ids()[0]
    assert alloc.block_table("b", "global").ids()[0] == shared and alloc.pools["global"].refcount[shared] == 2
    seg = replace(pages.segment(1, "b", (tok,), 70), copies=copies)
    child = r.run([seg], {1: 256})[1]
    assert torch.isfinite(child).all()
    assert torch.equal(child.cpu(), parent.cpu())
    pages.free("a")
    pages.free("b")
    alloc.check()
    assert all(pool.num_used == 0 for pool in alloc.pools.values())
