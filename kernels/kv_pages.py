"""How the attention kernels address a KV cache: always through a block table.

A cache tensor is ``[pages, PAGE, Hkv, D]``: position j of a sequence whose block-table row is
``t`` lives at ``cache[t[j // PAGE], j % PAGE]``. The runners' paged pools pass their pages and a
block table per forward (one row per sequence of the forward, the engine's page ids; entries a
row never reads may be anything, e.g. -1 for a sliding window's dropped pages). A contiguous
cache ``[S, L, Hkv, D]`` (one region per sequence, the kernels' tests and references) is the
same thing with one page of L positions per sequence and the identity table, so there is one
addressing path, and a row's keys are visited in the same blocks, in the same order, however
its pages are laid out: a page holds whole key blocks (the kernels check that PAGE is a
multiple of the segment, itself a multiple of the key block, or that the cache is contiguous).
"""

from __future__ import annotations

import torch


def block_table_args(cache: torch.Tensor, block_table: torch.Tensor | None, segment: int | None = None
                     ) -> tuple[torch.Tensor, int, int, int]:
    """(table int32 [rows, W] on the cache's device, PAGE, rows, positions a row can address)
    for ``cache`` [pages, PAGE, Hkv, D] read through ``block_table`` (None: the cache is
    contiguous, [S, L, Hkv, D], and the table is the identity with one page of L per sequence).
    ``segment``: the attention segment, which a page of a paged cache must hold whole."""
    if block_table is None:
        S, L = cache.shape[0], cache.shape[1]
        return torch.arange(S, dtype=torch.int32, device=cache.device)[:, None], L, S, L
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.device != cache.device \
            or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be int32 [rows, pages] with unit stride on {cache.device}, got "
                         f"{block_table.dtype} {tuple(block_table.shape)} on {block_table.device}")
    page = cache.shape[1]
    if segment is not None and page % segment:
        raise ValueError(f"a page of {page} positions must hold whole attention segments of {segment}: "
                         f"allowed pages that are multiples of the segment")
    return block_table, page, block_table.shape[0], block_table.shape[1] * page
