"""The fused per-row kernels between the products of a decode/prefill step.

The quantized products (qmatmul, qmma) write fixed split-K partials ``part[s, m, n]``; each
kernel here starts by adding a row's partials in slice order (``_sum_parts``) and then does the
step's elementwise/per-row work in the same launch:

* ``add_rmsnorm``: x += post_norm(sum) (or the plain sum), then h = rmsnorm(x) * w_next
  (attention output and FFN output into the residual, and the next layer's input norm);
* ``glu_from_parts``: act(gate) * up from the fused [gate | up] product (gelu_tanh or silu);
* ``qk_rope_kv``: from the fused [q | k | v] product: QK-norm (Gemma 3), NEOX rope at the
  row's position, q out, k and v written at the row's position through its block table (kv_pages.py).

The GLU can also ride on the launch of the product that feeds it, done by that product's
last program per column pair over acquire-release counters (``glu_pair_epilogue``, called from
kernels/qmma.py and kernels/qmatmul.py). (The QK-norm/rope and add+norm folds into their
products were measured slower on an H200, sessions 5 and 10, and removed in session 13.)

One program per row (``glu_from_parts``: per row and column block): every result is a function
of its row alone, so batch-invariant by construction. float32 compute; outputs in their
buffers' dtypes. Each has a plain-torch reference (``*_ref``) of the same arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_pages import block_table_args
from .pdl import enter, launch_kw


@triton.jit
def _sum_parts(ptr, offs, mask, stride_s, NSPLIT: tl.constexpr, CACHE: tl.constexpr):
    """((p[0] + p[1]) + ...) at offs: the qmatmul split-K slices added in slice order. (CACHE is
    passed explicitly: a defaulted constexpr fails to compile on a GPU under triton 3.6.)"""
    acc = tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    for sp in tl.static_range(1, NSPLIT):
        acc += tl.load(ptr + sp * stride_s + offs, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    return acc


@triton.jit
def _glu_math(g, u, ACT: tl.constexpr):
    """act(g) * u. ACT 0: gelu_tanh (as kernels/geglu.py: g * sigmoid(2u), overflow-free), 1: silu."""
    if ACT == 0:
        t = 2.0 * 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    else:
        t = g
    z = tl.exp(-tl.abs(t))
    sig = tl.where(t >= 0, 1.0 / (1.0 + z), z / (1.0 + z))
    return (g * sig) * u


@triton.jit
def glu_pair_epilogue(part_ptr, stride_ps, stride_pm, o_ptr, stride_o, count_ptr, count_idx, n, nmask, m, mmask, F,
                      NSPLIT: tl.constexpr, ACT: tl.constexpr):
    """The GLU folded into a fused [gate | up] product (``glu_from_parts`` without its launch).

    Called by every program of the product after it stored its split-K partial of columns ``n``
    ([BN]) x rows ``m`` ([BM]). The 2 * NSPLIT programs that cover gate columns c and up columns
    F + c (c = n mod F) count themselves on ``count_ptr[count_idx]`` (acquire-release); the last
    one adds both partials in slice order (from L2) and stores act(gate) * up into o[m, c], then
    re-arms the counter. The arithmetic is ``_glu_kernel``'s, so the result is bitwise the same."""
    tl.debug_barrier()  # every thread's partial stores before the release below
    done = tl.atomic_add(count_ptr + count_idx, 1, sem="acq_rel")
    if done == 2 * NSPLIT - 1:
        c = n % F
        offs = m[None, :] * stride_pm + c[:, None]
        mask = nmask[:, None] & mmask[None, :]
        g = _sum_parts(part_ptr, offs, mask, stride_ps, NSPLIT, ".cg")  # (.cg: never a stale L1 line)
        u = _sum_parts(part_ptr + F, offs, mask, stride_ps, NSPLIT, ".cg")
        y = _glu_math(g, u, ACT)
        tl.store(o_ptr + m[None, :] * stride_o + c[:, None], y.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(count_ptr + count_idx, 0)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, p_ptr, wpost_ptr, wn_ptr, h_ptr, E, eps,
    stride_x, stride_ps, stride_pm, stride_h,
    NSPLIT: tl.constexpr, HAS_POST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """x += post_norm(sum of partials) (or the plain sum); h = rmsnorm(x) * wn, one program per
    row. The norm weights and x are loaded right after the PDL wait, with the partials: one trip
    to memory instead of three (each where first used: after the first sum's barriers, then the
    second's) or loading the weights before the wait; H200, session 12, run 69, step ms at 1 /
    16 / 32 slots: 0.522 / 0.579 / 0.786 against 0.542 / 0.596 / 0.801 in order and 0.528 /
    0.595 / 0.796 before the wait (slower on runs 68 and 69; the other two forms removed in
    session 13). The same values and arithmetic either way."""
    enter(PDL)
    wpost, wn = _add_rmsnorm_weights(wpost_ptr, wn_ptr, E, BLOCK)
    add_rmsnorm_row(tl.program_id(0), x_ptr, p_ptr, h_ptr, E, eps, stride_x, stride_ps, stride_pm, stride_h,
                    NSPLIT, HAS_POST, BLOCK, wpost, wn)


@triton.jit
def _add_rmsnorm_weights(wpost_ptr, wn_ptr, E, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    return (tl.load(wpost_ptr + cols, mask=cols < E, other=0.0),
            tl.load(wn_ptr + cols, mask=cols < E, other=0.0))


@triton.jit
def add_rmsnorm_row(
    r, x_ptr, p_ptr, h_ptr, E, eps, stride_x, stride_ps, stride_pm, stride_h,
    NSPLIT: tl.constexpr, HAS_POST: tl.constexpr, BLOCK: tl.constexpr, wpost, wn,
):
    """Row r of ``_add_rmsnorm_kernel``, the norm weights wpost, wn given: x loaded with the
    partials."""
    cols = tl.arange(0, BLOCK)
    mask = cols < E
    d = _sum_parts(p_ptr + r * stride_pm, cols, mask, stride_ps, NSPLIT, "")
    x_old = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0)
    if HAS_POST:
        rs = 1.0 / tl.sqrt_rn(tl.sum(d * d, axis=0) / E + eps)
        d = (d * rs) * wpost
    x = x_old + d
    tl.store(x_ptr + r * stride_x + cols, x, mask=mask)
    rs2 = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / E + eps)
    h = (x * rs2) * wn
    tl.store(h_ptr + r * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_kernel(p_ptr, o_ptr, F, stride_ps, stride_pm, stride_o,
                NSPLIT: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = act(gate) * up from the partials of the fused [gate | up] product (``_glu_math``);
    program (r, cb): row r, columns cb * BLOCK ..."""
    enter(PDL)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    base = p_ptr + r * stride_pm
    g = _sum_parts(base, offs, mask, stride_ps, NSPLIT, "")
    u = _sum_parts(base + F, offs, mask, stride_ps, NSPLIT, "")
    y = _glu_math(g, u, ACT)
    tl.store(o_ptr + r * stride_o + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_heads(base, offs, mask, stride_ps, w1, w2, c, s, D, eps,
                     NSPLIT: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    x1 = _sum_parts(base, offs, mask, stride_ps, NSPLIT, "")
    x2 = _sum_parts(base, offs + HALF, mask, stride_ps, NSPLIT, "")
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rs = 1.0 / tl.sqrt_rn(ss / D + eps)
        x1 = (x1 * rs[:, None]) * w1[None, :]
        x2 = (x2 * rs[:, None]) * w2[None, :]
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _qk_rope_kv_kernel(
    p_ptr, q_ptr, k_ptr, v_ptr, seq_ptr, pos_ptr, bt_ptr, stride_bt, qn_ptr, kn_ptr, inv_ptr, eps,
    stride_ps, stride_pm, stride_qr, stride_ks, stride_kl,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HQ_P: tl.constexpr, HKV_P: tl.constexpr, HALF_P: tl.constexpr,
    NSPLIT: tl.constexpr, HAS_NORM: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
):
    """From the qkv partials of one row: q = rope(qnorm(q)) -> q_out; k = rope(knorm(k)) and v
    -> the row's KV position pos of block-table row seq (kernels/kv_pages.py). NEOX rope: pairs
    (i, i + D/2), angle = f32(pos) * inv_freq."""
    qk_rope_kv_row(tl.program_id(0), p_ptr, q_ptr, k_ptr, v_ptr, seq_ptr, pos_ptr, bt_ptr, stride_bt, qn_ptr, kn_ptr,
                   inv_ptr, eps, stride_ps, stride_pm, stride_qr, stride_ks, stride_kl,
                   HQ, HKV, D, HALF, HQ_P, HKV_P, HALF_P, NSPLIT, HAS_NORM, PAGE, PDL)


@triton.jit
def qk_rope_kv_row(
    r, p_ptr, q_ptr, k_ptr, v_ptr, seq_ptr, pos_ptr, bt_ptr, stride_bt, qn_ptr, kn_ptr, inv_ptr, eps,
    stride_ps, stride_pm, stride_qr, stride_ks, stride_kl,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HQ_P: tl.constexpr, HKV_P: tl.constexpr, HALF_P: tl.constexpr,
    NSPLIT: tl.constexpr, HAS_NORM: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
):
    """Row r of ``_qk_rope_kv_kernel`` as a PDL kernel's first work (kernels/attention.py's
    prologue too): the kernel's ``enter(PDL)``, then ``qk_rope_prep`` right after the wait (as the
    add+norm kernel loads its weights: session 12, run 69), then the body."""
    enter(PDL)
    pre = qk_rope_prep(r, seq_ptr, pos_ptr, bt_ptr, stride_bt, qn_ptr, kn_ptr, inv_ptr, HALF, HALF_P, HAS_NORM,
                       PAGE)
    qk_rope_kv_body(r, pre, p_ptr, q_ptr, k_ptr, v_ptr, eps, stride_ps, stride_pm, stride_qr, stride_ks, stride_kl,
                    HQ, HKV, D, HALF, HQ_P, HKV_P, HALF_P, NSPLIT, HAS_NORM)


@triton.jit
def qk_rope_prep(r, seq_ptr, pos_ptr, bt_ptr, stride_bt, qn_ptr, kn_ptr, inv_ptr, HALF: tl.constexpr,
                 HALF_P: tl.constexpr, HAS_NORM: tl.constexpr, PAGE: tl.constexpr):
    """What row r's QK-norm/rope takes that no kernel of the step writes (the row and block
    tables are written before the step's first kernel; the weights never): its position and the
    page that holds it, the rope's cos / sin, the norms' weight halves. A PDL kernel can take
    them before its wait."""
    pos = tl.load(pos_ptr + r)
    page = tl.load(bt_ptr + tl.load(seq_ptr + r).to(tl.int64) * stride_bt + pos // PAGE).to(tl.int64)
    i = tl.arange(0, HALF_P)
    imask = i < HALF
    ang = pos.to(tl.float32) * tl.load(inv_ptr + i, mask=imask, other=0.0)
    if HAS_NORM:
        w = (tl.load(qn_ptr + i, mask=imask, other=0.0), tl.load(qn_ptr + HALF + i, mask=imask, other=0.0),
             tl.load(kn_ptr + i, mask=imask, other=0.0), tl.load(kn_ptr + HALF + i, mask=imask, other=0.0))
    else:
        z = tl.zeros([HALF_P], dtype=tl.float32)
        w = (z, z, z, z)
    return pos % PAGE, page, tl.cos(ang), tl.sin(ang), w[0], w[1], w[2], w[3]


@triton.jit
def qk_rope_kv_body(
    r, pre, p_ptr, q_ptr, k_ptr, v_ptr, eps, stride_ps, stride_pm, stride_qr, stride_ks, stride_kl,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HQ_P: tl.constexpr, HKV_P: tl.constexpr, HALF_P: tl.constexpr,
    NSPLIT: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Row r of the QK-norm/rope/KV write with ``qk_rope_prep``'s values in hand."""
    at, page, cos, sin, qw1, qw2, kw1, kw2 = pre  # (the row's position: offset `at` in page `page`)
    i = tl.arange(0, HALF_P)
    imask = i < HALF
    c = cos[None, :]
    s = sin[None, :]
    base = p_ptr + r * stride_pm
    hq = tl.arange(0, HQ_P)
    qmask = (hq < HQ)[:, None] & imask[None, :]
    qoffs = hq[:, None] * D + i[None, :]
    o1, o2 = _norm_rope_heads(base, qoffs, qmask, stride_ps, qw1, qw2, c, s, D, eps, NSPLIT, HALF, HAS_NORM)
    tl.store(q_ptr + r * stride_qr + qoffs, o1, mask=qmask)
    tl.store(q_ptr + r * stride_qr + qoffs + HALF, o2, mask=qmask)
    hk = tl.arange(0, HKV_P)
    kmask = (hk < HKV)[:, None] & imask[None, :]
    koffs = hk[:, None] * D + i[None, :]
    k1, k2 = _norm_rope_heads(base + HQ * D, koffs, kmask, stride_ps, kw1, kw2, c, s, D, eps, NSPLIT, HALF, HAS_NORM)
    dst = page * stride_ks + at.to(tl.int64) * stride_kl + koffs
    tl.store(k_ptr + dst, k1.to(k_ptr.dtype.element_ty), mask=kmask)
    tl.store(k_ptr + dst + HALF, k2.to(k_ptr.dtype.element_ty), mask=kmask)
    vbase = base + (HQ + HKV) * D
    v1 = _sum_parts(vbase, koffs, kmask, stride_ps, NSPLIT, "")
    v2 = _sum_parts(vbase, koffs + HALF, kmask, stride_ps, NSPLIT, "")
    tl.store(v_ptr + dst, v1.to(v_ptr.dtype.element_ty), mask=kmask)
    tl.store(v_ptr + dst + HALF, v2.to(v_ptr.dtype.element_ty), mask=kmask)


# Warps of the per-row kernels (a row's norms reduce over its E or D values; the reduction order
# follows the warps, so one value per caller; a call's num_warps= overrides). add_rmsnorm: 8
# (H200, session 7, run 36: 0.693 / 0.791 ms -> 0.664 / 0.767 at 1 / 16 slots against 4 warps;
# 1 and 2 warps slower); qk_rope_kv: 8 (session 8, run 38: 0.639 / 0.737 -> 0.630 / 0.732 against 4,
# through the exactness stage; 1, 2: within the spread).
ADD_NORM_WARPS = 8
QK_ROPE_WARPS = 8

def _check_part(part: torch.Tensor, n: int) -> None:
    if part.dim() != 3 or part.dtype not in (torch.float32, torch.bfloat16) or part.shape[2] < n or part.stride(2) != 1:
        raise ValueError(f"part must be float32/bfloat16 [splits, R, >= {n}] with unit stride, got {part.dtype} {tuple(part.shape)}")


def add_rmsnorm(x: torch.Tensor, part: torch.Tensor, w_post: torch.Tensor | None, w_next: torch.Tensor,
                h: torch.Tensor, eps: float, num_warps: int | None = None) -> None:
    """In place: x[r] += rmsnorm(sum_s part[s, r]) * w_post (w_post None: the plain sum), then
    h[r] = rmsnorm(x[r]) * w_next. x float32 [R, E]; h [R, E] float32/bfloat16/float16. ``num_warps``:
    default ADD_NORM_WARPS (one value per caller: the norms' sums follow it)."""
    R, E = x.shape
    _check_part(part, E)
    block = triton.next_power_of_2(E)
    _add_rmsnorm_kernel[(R,)](
        x, part, w_post if w_post is not None else w_next, w_next, h, E, float(eps),
        x.stride(0), part.stride(0), part.stride(1), h.stride(0),
        NSPLIT=part.shape[0], HAS_POST=w_post is not None, BLOCK=block,
        num_warps=num_warps or ADD_NORM_WARPS, **launch_kw(part),
    )


def add_rmsnorm_ref(x, part, w_post, w_next, eps):
    """(new x, h) in float32."""
    d = _sum_in_order(part)[:, : x.shape[1]]
    if w_post is not None:
        d = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps) * w_post
    x = x.float() + d
    return x, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w_next


GLU_BLOCK = 1024


def glu_from_parts(part: torch.Tensor, out: torch.Tensor, act: str = "gelu_tanh") -> None:
    """out[r] = act(gate) * up, gate = part columns [0, F), up = [F, 2F) (summed over splits)."""
    R, F = out.shape
    _check_part(part, 2 * F)
    if act not in ("gelu_tanh", "silu"):
        raise ValueError(f"act={act!r} is not allowed: allowed gelu_tanh, silu")
    block = min(GLU_BLOCK, triton.next_power_of_2(F))
    _glu_kernel[(R, triton.cdiv(F, block))](
        part, out, F, part.stride(0), part.stride(1), out.stride(0),
        NSPLIT=part.shape[0], ACT=0 if act == "gelu_tanh" else 1, BLOCK=block, num_warps=4, **launch_kw(part),
    )


def glu_from_parts_ref(part: torch.Tensor, F: int, act: str = "gelu_tanh") -> torch.Tensor:
    s = _sum_in_order(part)
    g, u = s[:, :F], s[:, F : 2 * F]
    a = torch.nn.functional.gelu(g, approximate="tanh") if act == "gelu_tanh" else torch.nn.functional.silu(g)
    return a * u


def qk_rope_kv(part: torch.Tensor, q_out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               seq: torch.Tensor, pos: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               inv_freq: torch.Tensor, eps: float, num_warps: int | None = None,
               block_table: torch.Tensor | None = None) -> None:
    """From part [splits, R, (Hq + 2 Hkv) D] (q | k | v): q_out [R, Hq, D] = rope(qnorm(q));
    k_pool[seq, pos] = rope(knorm(k)), v_pool[seq, pos] = v. Pools [S, L, Hkv, D]; NEOX rope
    (pairs i, i + D/2) at angle f32(pos) * inv_freq [D/2]; norms None: no QK-norm. With
    ``block_table`` (kernels/kv_pages.py) the pools are pages [P, PAGE, Hkv, D] and position pos
    of table row seq is written at (block_table[seq, pos // PAGE], pos % PAGE)."""
    args, consts = qk_rope_row_args(part, q_out, k_pool, q_norm, k_norm, inv_freq, eps)
    bt, page, _, _ = block_table_args(k_pool, block_table)
    _qk_rope_kv_kernel[(q_out.shape[0],)](
        part, q_out, k_pool, v_pool, seq, pos, bt, bt.stride(0), *args, q_out.stride(0), k_pool.stride(0),
        k_pool.stride(1), **consts, PAGE=page, num_warps=num_warps or QK_ROPE_WARPS, **launch_kw(part),
    )


def qk_rope_row_args(part: torch.Tensor, q_out: torch.Tensor, k_pool: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, inv_freq: torch.Tensor, eps: float) -> tuple[tuple, dict]:
    """``qk_rope_kv_row``'s arguments for a launch, checked: (qn, kn, inv_freq, eps, part's split
    and row strides) and the constexprs (HQ, HKV, D, HALF, their paddings, NSPLIT, HAS_NORM)."""
    _, Hq, D = q_out.shape
    Hkv = k_pool.shape[2]
    _check_part(part, (Hq + 2 * Hkv) * D)
    if D % 2 or (q_norm is None) != (k_norm is None):
        raise ValueError("need an even head dim and both QK-norm weights or neither")
    half = D // 2
    has_norm = q_norm is not None
    args = (q_norm if has_norm else inv_freq, k_norm if has_norm else inv_freq, inv_freq, float(eps),
            part.stride(0), part.stride(1))
    return args, dict(HQ=Hq, HKV=Hkv, D=D, HALF=half, HQ_P=max(2, triton.next_power_of_2(Hq)),
                      HKV_P=max(2, triton.next_power_of_2(Hkv)), HALF_P=max(2, triton.next_power_of_2(half)),
                      NSPLIT=part.shape[0], HAS_NORM=has_norm)


def qk_rope_kv_ref(part, Hq, Hkv, D, pos, q_norm, k_norm, inv_freq, eps):
    """(q [R, Hq, D], k [R, Hkv, D], v [R, Hkv, D]) in float32."""
    s = _sum_in_order(part)
    R = s.shape[0]
    q = s[:, : Hq * D].reshape(R, Hq, D)
    k = s[:, Hq * D : (Hq + Hkv) * D].reshape(R, Hkv, D)
    v = s[:, (Hq + Hkv) * D : (Hq + 2 * Hkv) * D].reshape(R, Hkv, D)
    if q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * q_norm
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm
    ang = pos.float()[:, None] * inv_freq[None, :]
    c, sn = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]

    def rope(t):
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([a * c - b * sn, b * c + a * sn], dim=-1)

    return rope(q), rope(k), v


def _sum_in_order(part: torch.Tensor) -> torch.Tensor:
    acc = part[0].float().clone()
    for i in range(1, part.shape[0]):
        acc += part[i].float()
    return acc
