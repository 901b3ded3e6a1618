"""Greedy argmax over a large vocabulary per row; ties and NaN resolved like torch.argmax.

Two stages with a fixed chunk size: stage 1, one program per (row, chunk of ARGMAX_BLOCK_V
logits) writes the chunk's (max, lowest index of the max); stage 2, one program per row,
reduces the chunk results. Ties go to the lowest index; a NaN counts as the maximum (the first
NaN wins), as in torch.argmax. Comparisons are exact, so the answer is independent of order
and of the other rows: batch-invariant. Logits float32 or bfloat16 (compared as float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enter, launch_kw

ARGMAX_BLOCK_V = 4096  # 262144 / 4096 = 64 chunks per row
ARGMAX_NUM_WARPS = 4
ARGMAX_MAX_CHUNKS = 4096  # stage 2 reduces at most this many chunks in one tile
_NO_INDEX = 2**31 - 1


@triton.jit
def best_of(vals, idx, valid):
    """(value, index) of the first NaN if any, else of the max (lowest index among ties), along
    axis 0 (of a 2-D tile: one pair per column)."""
    is_nan = valid & (vals != vals)
    nan_idx = tl.min(tl.where(is_nan, idx, 2147483647), axis=0)
    clean = tl.where(valid & (vals == vals), vals, float("-inf"))
    vmax = tl.max(clean, axis=0)
    vidx = tl.min(tl.where((clean == vmax) & valid, idx, 2147483647), axis=0)
    has_nan = nan_idx < 2147483647
    return tl.where(has_nan, float("nan"), vmax), tl.where(has_nan, nan_idx, vidx)


@triton.jit
def running_best(bv, bi, vals, idx, valid):
    """Elementwise running (value, index) best for entries met in increasing index order per
    lane: a lane's first valid entry, then the first NaN, else a strictly larger value, so each
    lane ends with what ``best_of`` would pick among its entries (ties: the lowest index)."""
    vnan = vals != vals
    bnan = bv != bv
    take = valid & ((bi == 2147483647) | (vnan & ~bnan) | ((vals > bv) & ~bnan))
    return tl.where(take, vals, bv), tl.where(take, idx, bi)


@triton.jit
def _argmax_chunks_kernel(x_ptr, pval_ptr, pidx_ptr, V, stride_x, num_chunks, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    r = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = idx < V
    vals = tl.load(x_ptr + r.to(tl.int64) * stride_x + idx, mask=valid, other=float("-inf")).to(tl.float32)
    v, i = best_of(vals, idx, valid)
    tl.store(pval_ptr + r * num_chunks + c, v)
    tl.store(pidx_ptr + r * num_chunks + c, i)


@triton.jit
def _argmax_rows_kernel(pval_ptr, pidx_ptr, o_ptr, ids_ptr, pos_ptr, hist_ptr, num_chunks,
                        CHUNKS_P: tl.constexpr, FEED: tl.constexpr, HIST: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    r = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P)
    valid = c < num_chunks
    vals = tl.load(pval_ptr + r * num_chunks + c, mask=valid, other=float("-inf"))
    idx = tl.load(pidx_ptr + r * num_chunks + c, mask=valid, other=2147483647)
    _, i = best_of(vals, idx, valid)
    tl.store(o_ptr + r, i.to(tl.int64))
    if FEED:  # the row's next decode input: this token at the next position
        p = tl.load(pos_ptr + r)
        tl.store(ids_ptr + r, i.to(ids_ptr.dtype.element_ty))
        tl.store(pos_ptr + r, p + 1)
        if HIST > 0:  # and the token kept at hist[r, pos % HIST] (a graph loop's history)
            tl.store(hist_ptr + r * HIST + p % HIST, i.to(tl.int64))


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None,
           feed: tuple[torch.Tensor, torch.Tensor] | None = None, hist: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: argmax of each row of logits [R, V] (float32/bfloat16, unit stride on V).
    ``feed`` = (ids, pos), integer [R] each: also ids[r] = the argmax and pos[r] += 1 (a decode
    graph's next inputs, in the same launch rather than two more kernels). ``hist`` (with feed;
    contiguous int64 [R, H]): also hist[r, pos[r] % H] = the argmax (pos before the increment),
    so a loop of graph replays keeps its tokens without a copy between replays. (Writing the
    token into pinned host memory from the kernel, for run-ahead steps, measured within the
    spread on an H200, session 12, run 65: removed in session 13.)"""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(1) != 1:
        raise ValueError(f"logits must be float32/bfloat16 [R, V] with unit stride on V, got {logits.dtype} {tuple(logits.shape)}")
    R, V = logits.shape
    if V == 0 or V >= _NO_INDEX:
        raise ValueError(f"vocab size {V} out of range [1, {_NO_INDEX})")
    num_chunks = triton.cdiv(V, ARGMAX_BLOCK_V)
    if num_chunks > ARGMAX_MAX_CHUNKS:
        raise ValueError(f"vocab size {V} exceeds {ARGMAX_MAX_CHUNKS * ARGMAX_BLOCK_V}")
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    elif out.shape != (R,) or out.dtype != torch.int64 or out.device != logits.device:
        raise ValueError(f"out must be int64 [{R}] on {logits.device}")
    _check_feed(feed, R, logits.device)
    if R == 0:
        return out
    pval = torch.empty((R, num_chunks), dtype=torch.float32, device=logits.device)
    pidx = torch.empty((R, num_chunks), dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(R, num_chunks)](
        logits, pval, pidx, V, logits.stride(0), num_chunks, BLOCK_V=ARGMAX_BLOCK_V, num_warps=ARGMAX_NUM_WARPS, **launch_kw(logits),
    )
    return argmax_from_partials(pval, pidx, out, feed, hist)


def argmax_from_partials(pval: torch.Tensor, pidx: torch.Tensor, out: torch.Tensor,
                         feed: tuple[torch.Tensor, torch.Tensor] | None = None,
                         hist: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax``'s second launch on partials made elsewhere (the head's streaming programs,
    ``dense_mma(..., best=)``): float32 values and int32 indices [R, P], index 2^31 - 1 where a
    partial saw no entry; the same tie and NaN rules."""
    R, P = pval.shape
    if pidx.shape != (R, P) or pval.dtype != torch.float32 or pidx.dtype != torch.int32 or not (
            pval.is_contiguous() and pidx.is_contiguous()):
        raise ValueError(f"partials must be contiguous float32 and int32 [R, P], got {tuple(pval.shape)} {tuple(pidx.shape)}")
    if out.shape != (R,) or out.dtype != torch.int64 or out.device != pval.device:
        raise ValueError(f"out must be int64 [{R}] on {pval.device}")
    _check_feed(feed, R, pval.device)
    if hist is not None and (feed is None or hist.dim() != 2 or hist.shape[0] != R or hist.dtype != torch.int64
                             or not hist.is_contiguous() or hist.device != pval.device):
        raise ValueError(f"hist needs feed= and a contiguous int64 [{R}, H] tensor on {pval.device}")
    if R == 0:
        return out
    ids, pos = feed if feed is not None else (out, out)
    _argmax_rows_kernel[(R,)](pval, pidx, out, ids, pos, out if hist is None else hist,
                              P, CHUNKS_P=triton.next_power_of_2(P), FEED=feed is not None,
                              HIST=0 if hist is None else hist.shape[1], num_warps=ARGMAX_NUM_WARPS, **launch_kw(pval))
    return out


def _check_feed(feed: tuple[torch.Tensor, torch.Tensor] | None, R: int, device: torch.device) -> None:
    if feed is not None and any(t.shape != (R,) or t.dtype not in (torch.int32, torch.int64) or t.device != device
                                or not t.is_contiguous() for t in feed):
        raise ValueError(f"feed must be two contiguous int32/int64 [{R}] tensors on {device}")


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
