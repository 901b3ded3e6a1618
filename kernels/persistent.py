"""One persistent kernel for a run of the step's kernels: work items in dependency order.

A decode step of Gemma 3 270M is ~160 dependent kernels of 3-10 us; under programmatic dependent
launch each boundary (the previous grid's completion, its memory flush, the next grid's release)
still costs ~3 us even for a kernel that does almost nothing (docs/GPU_NOTES.md, session 5).
Here the same launches run inside ONE launch:

* ``record()`` intercepts the launches of a block of code (the runner's layer loop): each launch
  of a supported kernel becomes a *stage* of work items, one per program of its grid, in the
  order the hardware would number them; nothing runs. A launch of any other kernel raises
  ``Unsupported`` (the caller runs the chain instead).
* ``Plan`` turns the record into two tables: per item (kind, argument row, program ids, stage,
  the count it waits for) and per launch its runtime arguments (pointers and scalars, int64).
  A *kind* is a kernel with one set of constexprs; the kinds are the persistent kernel's
  constexprs, so each item calls its kernel's body with the same constexprs the chain uses.
* ``_persistent_kernel``: each program walks items in item order: on a GPU program p takes
  items p, p + P, ... (``ASSIGN = "static"``, the grid sized so that every program is resident),
  or tickets from a global counter (``"ticket"``, and always under the CPU interpreter). An
  item of stage s first waits (acquire) until stage s - 1's counter reaches its item count,
  runs the body of its kernel (``qmma_item``, ``qgemv_item``, ``attention_item``,
  ``add_rmsnorm_row``, ``qk_rope_kv_row``, ``glu_item``) and adds one to stage s's counter
  (release). Stages form the chain's order: a stage starts after every item of the stage before
  it ended, as a kernel starts after its predecessor; products fetch their first weights before
  waiting, as they do before their PDL wait. The last program to leave zeroes the counters.

An item only ever waits for lower items. With tickets, those are held by running programs: no
deadlock whatever the grid or residency; under the interpreter programs run one after another,
program 0 takes every ticket in order and never waits, so the same code runs in the tests. With
static assignment every program is resident, and each walks its items in order: no deadlock
either (by induction over the stages).

Measured on an H200 (docs/GPU_NOTES.md, session 6): bitwise the chain, but slower (1.05 vs
0.79 ms per 16-slot step at best), so the runner keeps it off.

Same bodies, same constexprs, same num_warps (the caller makes the chain's kernels agree on one):
every item computes what its program computes in the chain, so the step's results are bitwise
the chain's (tests/kernels/test_persistent.py; on a GPU, scripts/gpu_bench.py's exactness stage).
"""

from __future__ import annotations

import contextlib
import inspect
import struct
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .attention import _attention_partial_kernel, attention_item
from .pdl import enter, launch_kw, release_count, wait_count
from .qmatmul import _qgemv_kernel, qgemv_item
from . import qmma as _qmma
from .qmma import _qmma_kernel, qmma_item
from .step_fused import (
    _add_rmsnorm_kernel,
    _glu_kernel,
    _qk_rope_kv_kernel,
    add_rmsnorm_row,
    glu_item,
    qk_rope_kv_row,
)

# kernel -> kind id of the dispatch in _persistent_kernel (products first: they wait inside)
_KERNELS: dict[str, int] = {
    "_qmma_kernel": 0, "_qgemv_kernel": 1, "_attention_partial_kernel": 2, "_add_rmsnorm_kernel": 3,
    "_qk_rope_kv_kernel": 4, "_glu_kernel": 5,
}
_JIT = {f.__name__: f for f in (_qmma_kernel, _qgemv_kernel, _attention_partial_kernel, _add_rmsnorm_kernel,
                                _qk_rope_kv_kernel, _glu_kernel)}
MAX_ARGS = 32  # runtime arguments per launch (the attention kernel takes 25)
NCONST = 16  # constexprs per kernel (the tensor-core product takes 16)
KIND_WIDTH = 1 + NCONST + MAX_ARGS
# Runtime arguments never hinted 16-divisible: they change with the row bucket (the products' M
# is not specialized in the chain either; the rows' position / sequence vectors are read one
# scalar at a time), and a hint is part of the compiled kernel: one compile serves every bucket.
NO_HINT = frozenset({"M", "num_seg", "seq_ptr", "pos_ptr", "row_seq_ptr", "row_pos_ptr", "row_win_ptr"})
ITEM_COLS = 8  # kind, argument row, pid0, pid1, pid2, stage, wait count, (spare)
# pointer dtypes by code (an argument's type code: 0 int32, 1 int64, 2 float32, 10 + this index)
_PTR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int32, torch.int64,
               torch.int16)


class Unsupported(Exception):
    """A launch the persistent kernel cannot take (the caller runs the chain instead)."""


@dataclass
class _Launch:
    kernel: str
    grid: tuple[int, int, int]
    args: list  # runtime arguments, in signature order (tensors kept alive here)
    consts: tuple  # constexprs in signature order
    num_warps: int
    names: tuple = ()  # the runtime arguments' names


@dataclass
class Record:
    """The launches intercepted by ``record()``, in issue order."""

    launches: list[_Launch] = field(default_factory=list)

    def plan(self, device: torch.device | str) -> Plan:
        return Plan.build(self, device)


def _is_constexpr(p: inspect.Parameter) -> bool:
    return "constexpr" in str(p.annotation)


@contextlib.contextmanager
def record():
    """Intercept the launches of the supported kernels inside the block (nothing runs); yields
    the ``Record``. Any other Triton launch inside raises ``Unsupported`` (before it runs)."""
    rec = Record()

    def interceptor(kernel):
        sig = inspect.signature(kernel.fn)

        def intercept(*args, grid, warmup, **kwargs):
            if warmup:
                raise Unsupported("a warmup inside a recorded block")
            num_warps = int(kwargs.pop("num_warps", 4))
            for opt in ("launch_pdl", "num_stages", "num_ctas", "maxnreg"):
                kwargs.pop(opt, None)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            g = grid(bound.arguments) if callable(grid) else grid
            g = tuple(int(v) for v in g) + (1,) * (3 - len(g))
            runtime, consts, names = [], [], []
            for p in sig.parameters.values():
                if _is_constexpr(p):
                    consts.append(bound.arguments[p.name])
                else:
                    runtime.append(bound.arguments[p.name])
                    names.append(p.name)
            rec.launches.append(_Launch(kernel.__name__, g, runtime, tuple(consts), num_warps, tuple(names)))

        return intercept

    def refuse(self, *args, **kwargs):
        raise Unsupported(f"kernel {getattr(self, '__name__', '?')} has no persistent item")

    classes = {type(k) for k in _JIT.values()} | {JITFunction}
    saved = {c: c.run for c in classes}
    for k in _JIT.values():
        k.run = interceptor(k)  # (an instance attribute: kernel[grid](...) calls self.run)
    for c in classes:
        c.run = refuse
    try:
        yield rec
    finally:
        for c, run in saved.items():
            c.run = run
        for k in _JIT.values():
            del k.run


def _type_code(v) -> int:
    if isinstance(v, torch.Tensor):
        if v.dtype not in _PTR_DTYPES:
            raise Unsupported(f"pointer of dtype {v.dtype}")
        return 10 + _PTR_DTYPES.index(v.dtype)
    if isinstance(v, bool):
        raise Unsupported("a runtime bool argument")
    if isinstance(v, int):
        return 0 if -(2 ** 31) <= v < 2 ** 31 else 1
    if isinstance(v, float):
        return 2
    raise Unsupported(f"argument of type {type(v).__name__}")


def _value(v, code: int) -> int:
    if code >= 10:
        return v.data_ptr()
    if code == 2:
        return struct.unpack("<i", struct.pack("<f", v))[0]
    return int(v)


def _div16(v, code: int) -> bool:
    """Triton's own specialization of a launch argument: 16-divisible pointers and ints."""
    return (v.data_ptr() % 16 == 0) if code >= 10 else (code < 2 and int(v) % 16 == 0)


@dataclass
class Plan:
    """The tables of one recorded run of launches (host copies; ``upload`` fills the device ones)."""

    kinds: tuple  # per kind, KIND_WIDTH ints: kernel id, its constexprs, its arguments' encodings
    prec: tuple[str, str]  # the products' and attention's precision (one each per launch)
    items: torch.Tensor  # int32 [n_items, ITEM_COLS] (host)
    args: torch.Tensor  # int64 [n_launches, MAX_ARGS] (host)
    stages: int
    num_warps: int
    keep: list  # the tensors the launches name (alive as long as the plan)
    items_dev: torch.Tensor
    args_dev: torch.Tensor

    @classmethod
    def build(cls, rec: Record, device) -> Plan:
        if not rec.launches:
            raise Unsupported("no launches recorded")
        warps = {ln.num_warps for ln in rec.launches}
        if len(warps) != 1:
            raise Unsupported(f"the launches take different num_warps {sorted(warps)}; one is needed")
        groups: dict[tuple, list[int]] = {}
        codes_of = []
        for i, ln in enumerate(rec.launches):
            if len(ln.args) > MAX_ARGS:
                raise Unsupported(f"{ln.kernel} takes {len(ln.args)} runtime arguments (max {MAX_ARGS})")
            codes = tuple(_type_code(v) for v in ln.args)
            codes_of.append(codes)
            groups.setdefault((ln.kernel, ln.consts, codes), []).append(i)
        kinds, kind_of = [], {}
        strings: dict[int, set] = {0: set(), 2: set()}  # the precisions (qmma's PREC, attention's)
        for k, (key, members) in enumerate(groups.items()):
            name, consts, codes = key
            kid = _KERNELS[name]
            flat = []
            for c in consts:
                if isinstance(c, str) and kid in strings:
                    strings[kid].add(c)
                    c = 0
                if not isinstance(c, (bool, int)):
                    raise Unsupported(f"{name} constexpr {c!r} (ints and bools only, one precision string)")
                flat.append(c)
            names = rec.launches[members[0]].names
            enc = [2 * codes[j] + (names[j] not in NO_HINT and all(_div16(rec.launches[i].args[j], codes[j])
                                                                    for i in members))
                   for j in range(len(codes))]
            if len(flat) > NCONST:
                raise Unsupported(f"{name} takes {len(flat)} constexprs (max {NCONST})")
            kinds.append((kid, *flat, *[0] * (NCONST - len(flat)), *enc, *[0] * (MAX_ARGS - len(enc))))
            for i in members:
                kind_of[i] = k
        if len(strings[0]) > 1 or len(strings[2]) > 1:
            raise Unsupported(f"one product precision and one attention precision per launch, got {strings}")
        prec = (next(iter(strings[0]), "bf16"), next(iter(strings[2]), "bf16"))
        args = torch.zeros((len(rec.launches), MAX_ARGS), dtype=torch.int64)
        rows = []
        prev = 0  # items of the previous stage
        for s, ln in enumerate(rec.launches):
            args[s, : len(ln.args)] = torch.tensor([_value(v, c) for v, c in zip(ln.args, codes_of[s])],
                                                   dtype=torch.int64)
            g0, g1, g2 = ln.grid
            n = g0 * g1 * g2
            p = torch.arange(n, dtype=torch.int32)
            stage = torch.empty((n, ITEM_COLS), dtype=torch.int32)
            stage[:, 0] = kind_of[s]
            stage[:, 1] = s
            stage[:, 2] = p % g0  # the hardware's numbering: x fastest, then y, then z
            stage[:, 3] = (p // g0) % g1
            stage[:, 4] = p // (g0 * g1)
            stage[:, 5] = s
            stage[:, 6] = prev
            stage[:, 7] = 0
            rows.append(stage)
            prev = n
        items = torch.cat(rows)
        keep = [v for ln in rec.launches for v in ln.args if isinstance(v, torch.Tensor)]
        dev = torch.device(device)
        return cls(tuple(kinds), prec, items, args, len(rec.launches), warps.pop(), keep,
                   torch.empty(items.shape, dtype=torch.int32, device=dev),
                   torch.empty(args.shape, dtype=torch.int64, device=dev))

    @property
    def n_items(self) -> int:
        return self.items.shape[0]

    def upload(self) -> None:
        """Copy the tables to the device (outside a CUDA graph capture: the graph reads them)."""
        self.items_dev.copy_(self.items)
        self.args_dev.copy_(self.args)


def counters(stages: int, device) -> torch.Tensor:
    """The int32 zeros a launch needs (ticket + one per stage); each launch leaves them zero."""
    return torch.zeros(stages + 1, dtype=torch.int32, device=device)


PROGRAMS_PER_SM: int | None = None  # None: as many as fit (registers, shared memory)
# How programs get items on a GPU: "ticket" (a global counter, in item order: any residency) or
# "static" (program p takes items p, p + P, ...: no counter round trip per item; needs every
# program resident, so the grid is what fits). The CPU interpreter always takes tickets.
# Static with one polling thread was the fastest form on an H200 (session 6, runs 28-29).
ASSIGN = "static"
# How a GPU item waits: "load" (every thread polls with an acquire load) or "atomic" (one thread
# per program polls with an acquire atomic, the others wait at a barrier).
POLL = "atomic"
# A register cap for the persistent kernel (ptxas maxnreg; None: what the heaviest item takes,
# ~255, so two programs per multiprocessor): more programs resident, at the price of spills.
MAXNREG: int | None = None
_GRID: dict = {}


def launch(plan: Plan, ctr: torch.Tensor, programs: int | None = None) -> None:
    """Run the plan's items in one launch. ``ctr``: ``counters(plan.stages)`` or more."""
    if ctr.numel() < plan.stages + 1 or ctr.dtype != torch.int32:
        raise ValueError(f"ctr must be int32 zeros, at least {plan.stages + 1} of them")
    if ASSIGN not in ("ticket", "static") or POLL not in ("load", "atomic"):
        raise ValueError(f"ASSIGN={ASSIGN!r} / POLL={POLL!r}: allowed ticket, static / load, atomic")
    native = _qmma._native(plan.items_dev)  # (the waits may use the acquire load: inline PTX)
    static = ASSIGN == "static" and native
    kw = dict(KINDS=plan.kinds, NK=len(plan.kinds), PREC=plan.prec[0], APREC=plan.prec[1], COLS=ITEM_COLS,
              NARGS=MAX_ARGS,
              WAIT=2 if native and POLL == "load" else 1, num_warps=plan.num_warps, **launch_kw(plan.items_dev))
    if MAXNREG and native:
        kw["maxnreg"] = int(MAXNREG)
    if programs is None or static:  # (static: never more programs than can be resident at once)
        fit = _programs(plan, ctr, dict(kw, STATIC=static)) if plan.items_dev.is_cuda else 1
        programs = fit if programs is None else min(programs, fit)
    kw["STATIC"] = static
    _persistent_kernel[(programs,)](plan.items_dev, plan.args_dev, ctr, plan.n_items, plan.stages, **kw)


def fit_per_sm(regs: int, shared: int, num_warps: int, regs_per_sm: int = 65536, shared_per_sm: int = 233472,
               threads_per_sm: int = 2048) -> int:
    """Programs of a kernel that fit on one multiprocessor at once: registers go to warps in
    units of 256, shared memory per program, threads (at least one program)."""
    if regs <= 0 or num_warps <= 0:
        raise ValueError(f"regs={regs} and num_warps={num_warps} must be positive")
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = regs_per_sm // (per_warp * num_warps)
    by_smem = shared_per_sm // shared if shared else by_regs
    return max(1, min(by_regs, by_smem, threads_per_sm // (32 * num_warps)))


def _programs(plan: Plan, ctr: torch.Tensor, kw: dict) -> int:
    """Programs for the grid: as many as can be resident at once (the loaded kernel's registers
    and shared memory say how many fit on a multiprocessor), or PROGRAMS_PER_SM each, never more
    than fit under static assignment (a program that never starts would hold items others wait
    for)."""
    dev = plan.items_dev.device
    key = (plan.kinds, plan.prec, kw["WAIT"], kw["STATIC"], kw.get("maxnreg"), plan.num_warps, dev.index,
           PROGRAMS_PER_SM)
    if key not in _GRID:
        props = torch.cuda.get_device_properties(dev)
        k = _persistent_kernel.warmup(plan.items_dev, plan.args_dev, ctr, plan.n_items, plan.stages,
                                      grid=(1,), **kw)
        k._init_handles()  # (loads the binary: its register count is known from then on)
        regs = int(getattr(k, "n_regs", 0) or 0)
        if regs <= 0:
            raise RuntimeError("the persistent kernel's register count is unknown: cannot size its grid")
        fit = fit_per_sm(regs, int(k.metadata.shared or 0), plan.num_warps,
                         getattr(props, "regs_per_multiprocessor", 65536), props.shared_memory_per_multiprocessor)
        per_sm = fit if PROGRAMS_PER_SM is None else min(PROGRAMS_PER_SM, fit) if kw["STATIC"] else PROGRAMS_PER_SM
        _GRID[key] = per_sm * props.multi_processor_count
    return _GRID[key]


# -- the kernel ----------------------------------------------------------------------------------


@triton.jit
def _ptr(v, CODE: tl.constexpr, DIV: tl.constexpr):
    # (each branch hints its own result: a hint on the value a branch chain returns was lost
    # under triton 3.6, and the tiles' loads were no longer vectorized)
    if CODE == 10:
        p = v.to(tl.pointer_type(tl.float32))
        if DIV:
            p = tl.multiple_of(p, 16)
    elif CODE == 11:
        p = v.to(tl.pointer_type(tl.bfloat16))
        if DIV:
            p = tl.multiple_of(p, 16)
    elif CODE == 12:
        p = v.to(tl.pointer_type(tl.float16))
        if DIV:
            p = tl.multiple_of(p, 16)
    elif CODE == 13:
        p = v.to(tl.pointer_type(tl.uint8))
        if DIV:
            p = tl.multiple_of(p, 16)
    elif CODE == 14:
        p = v.to(tl.pointer_type(tl.int8))
        if DIV:
            p = tl.multiple_of(p, 16)
    elif CODE == 15:
        p = v.to(tl.pointer_type(tl.int32))
        if DIV:
            p = tl.multiple_of(p, 16)
    elif CODE == 16:
        p = v.to(tl.pointer_type(tl.int64))
        if DIV:
            p = tl.multiple_of(p, 16)
    else:
        p = v.to(tl.pointer_type(tl.int16))
        if DIV:
            p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _a(a_ptr, J, E: tl.constexpr):
    """Runtime argument J of a launch, typed as the chain's kernel receives it; E: its encoding
    (type code * 2 + 16-divisible). The hint is what the chain's launch specializes on: without
    it a tile's loads are not vectorized, and a reduction over them takes another layout (so
    other bits). (Straight-line branches: an early return inside a constexpr branch lost the
    hint under triton 3.6.)"""
    v = tl.load(a_ptr + J)
    if E >= 20:  # a pointer
        r = _ptr(v, E // 2, E % 2)
    elif E >= 4:  # float32 (code 2)
        r = v.to(tl.int32).to(tl.float32, bitcast=True)
    elif E >= 2:  # int64 (code 1)
        r = v
        if E % 2:
            r = tl.multiple_of(r, 16)
    else:
        r = v.to(tl.int32)
        if E % 2:
            r = tl.multiple_of(r, 16)
    return r


# Triton 3.6 passes no tuple (and no str or None) from a constexpr tuple to a function: a kind
# reaches _item as KIND_WIDTH scalars (kernel id, NCONST constexprs, MAX_ARGS argument encodings),
# and the two precision strings as the kernel's own constexprs. The long lists below are that.
@triton.jit
def _item(
    a, p0, p1, p2, wait_ptr, need, KID: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
    C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr, C10: tl.constexpr, C11: tl.constexpr,
    C12: tl.constexpr, C13: tl.constexpr, C14: tl.constexpr, C15: tl.constexpr,
    A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr, A4: tl.constexpr, A5: tl.constexpr,
    A6: tl.constexpr, A7: tl.constexpr, A8: tl.constexpr, A9: tl.constexpr, A10: tl.constexpr, A11: tl.constexpr,
    A12: tl.constexpr, A13: tl.constexpr, A14: tl.constexpr, A15: tl.constexpr, A16: tl.constexpr,
    A17: tl.constexpr, A18: tl.constexpr, A19: tl.constexpr, A20: tl.constexpr, A21: tl.constexpr,
    A22: tl.constexpr, A23: tl.constexpr, A24: tl.constexpr, A25: tl.constexpr, A26: tl.constexpr,
    A27: tl.constexpr, A28: tl.constexpr, A29: tl.constexpr, A30: tl.constexpr, A31: tl.constexpr,
    PREC: tl.constexpr, APREC: tl.constexpr, WAIT: tl.constexpr,
):
    if KID == 0:  # _qmma_kernel: QTYPE GW S NPLANE PSTEP BLOCK_M BLOCK_N BLOCK_K NUM_STAGES PREC USE_DOT GLU
        # NSPLIT PDL PREFETCH PRELOAD; products fetch their first weights, then wait (as before a PDL wait)
        qmma_item(
            p0, p1, wait_ptr, need,
            _a(a, 0, A0), _a(a, 1, A1), _a(a, 2, A2), _a(a, 3, A3), _a(a, 4, A4), _a(a, 5, A5), _a(a, 6, A6),
            _a(a, 7, A7), _a(a, 8, A8), _a(a, 9, A9), _a(a, 10, A10), _a(a, 11, A11), _a(a, 12, A12),
            _a(a, 13, A13), _a(a, 14, A14), _a(a, 15, A15), _a(a, 16, A16), _a(a, 17, A17), _a(a, 18, A18),
            _a(a, 19, A19),
            C0, C1, C2, C3, C4, C5, C6, C7, C8, PREC, C10, C11, C12, False, C14, C15,
            WAIT)
    elif KID == 1:  # _qgemv_kernel: QTYPE GW S NPLANE PSTEP M_TILE BLOCK_N BLOCK_K NUM_STAGES LATE_REDUCE GLU NSPLIT PDL
        qgemv_item(
            p0, p1, wait_ptr, need,
            _a(a, 0, A0), _a(a, 1, A1), _a(a, 2, A2), _a(a, 3, A3), _a(a, 4, A4), _a(a, 5, A5), _a(a, 6, A6),
            _a(a, 7, A7), _a(a, 8, A8), _a(a, 9, A9), _a(a, 10, A10), _a(a, 11, A11), _a(a, 12, A12),
            _a(a, 13, A13), _a(a, 14, A14), _a(a, 15, A15), _a(a, 16, A16), _a(a, 17, A17), _a(a, 18, A18),
            _a(a, 19, A19),
            C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, False, WAIT)
    else:
        wait_count(wait_ptr, need, WAIT)
        if KID == 2:  # _attention_partial_kernel: GROUP QROWS D_P BLOCK_N SEG USE_DOT INPUT_PRECISION FUSED PDL
            attention_item(
                p0, p1, p2,
                _a(a, 0, A0), _a(a, 1, A1), _a(a, 2, A2), _a(a, 3, A3), _a(a, 4, A4), _a(a, 5, A5), _a(a, 6, A6),
                _a(a, 7, A7), _a(a, 8, A8), _a(a, 9, A9), _a(a, 10, A10), _a(a, 11, A11), _a(a, 12, A12),
                _a(a, 13, A13), _a(a, 14, A14), _a(a, 15, A15), _a(a, 16, A16), _a(a, 17, A17), _a(a, 18, A18),
                _a(a, 19, A19), _a(a, 20, A20), _a(a, 21, A21), _a(a, 22, A22), _a(a, 23, A23), _a(a, 24, A24),
                C0, C1, C2, C3, C4, C5, APREC, C7)
        elif KID == 3:  # _add_rmsnorm_kernel: NSPLIT HAS_POST BLOCK PDL
            add_rmsnorm_row(
                p0,
                _a(a, 0, A0), _a(a, 1, A1), _a(a, 2, A2), _a(a, 3, A3), _a(a, 4, A4), _a(a, 5, A5), _a(a, 6, A6),
                _a(a, 7, A7), _a(a, 8, A8), _a(a, 9, A9), _a(a, 10, A10),
                C0, C1, C2)
        elif KID == 4:  # _qk_rope_kv_kernel: HQ HKV D HALF HQ_P HKV_P HALF_P NSPLIT HAS_NORM PDL
            qk_rope_kv_row(
                p0,
                _a(a, 0, A0), _a(a, 1, A1), _a(a, 2, A2), _a(a, 3, A3), _a(a, 4, A4), _a(a, 5, A5), _a(a, 6, A6),
                _a(a, 7, A7), _a(a, 8, A8), _a(a, 9, A9), _a(a, 10, A10), _a(a, 11, A11), _a(a, 12, A12),
                _a(a, 13, A13), _a(a, 14, A14),
                C0, C1, C2, C3, C4, C5, C6, C7, C8, 0, 1)  # (no PDL inside the persistent launch)
        else:  # _glu_kernel: NSPLIT ACT BLOCK PDL
            glu_item(
                p0, p1,
                _a(a, 0, A0), _a(a, 1, A1), _a(a, 2, A2), _a(a, 3, A3), _a(a, 4, A4), _a(a, 5, A5),
                C0, C1, C2)


@triton.jit(do_not_specialize=["n_items", "n_stages"])
def _persistent_kernel(items_ptr, args_ptr, ctr_ptr, n_items, n_stages,
                       KINDS: tl.constexpr, NK: tl.constexpr, PREC: tl.constexpr, APREC: tl.constexpr,
                       WAIT: tl.constexpr, STATIC: tl.constexpr, COLS: tl.constexpr, NARGS: tl.constexpr,
                       PDL: tl.constexpr):
    enter(PDL)  # the launch's inputs (embedding, first norm) are done
    P = tl.num_programs(0)
    if STATIC:  # program p takes items p, p + P, ... (every program resident: a GPU grid that fits)
        t = tl.program_id(0)
    else:  # tickets in item order (any residency; the interpreter's programs run one by one)
        t = tl.atomic_add(ctr_ptr, 1)
    seen = -1  # stages this program has seen complete: 0..seen (a later item of them waits for nothing)
    while t < n_items:
        it = items_ptr + t * COLS
        kind = tl.load(it)
        a = args_ptr + tl.load(it + 1).to(tl.int64) * NARGS
        p0 = tl.load(it + 2)
        p1 = tl.load(it + 3)
        p2 = tl.load(it + 4)
        stage = tl.load(it + 5)
        need = tl.where(stage - 1 <= seen, 0, tl.load(it + 6))
        wait_ptr = ctr_ptr + tl.maximum(stage, 1)  # stage s waits on counter s (stage s - 1's)
        for k in tl.static_range(NK):
            if kind == k:
                _item(
                    a, p0, p1, p2, wait_ptr, need,
                    KINDS[k][0], KINDS[k][1], KINDS[k][2], KINDS[k][3], KINDS[k][4], KINDS[k][5], KINDS[k][6],
                    KINDS[k][7], KINDS[k][8], KINDS[k][9], KINDS[k][10], KINDS[k][11], KINDS[k][12], KINDS[k][13],
                    KINDS[k][14], KINDS[k][15], KINDS[k][16], KINDS[k][17], KINDS[k][18], KINDS[k][19], KINDS[k][20],
                    KINDS[k][21], KINDS[k][22], KINDS[k][23], KINDS[k][24], KINDS[k][25], KINDS[k][26], KINDS[k][27],
                    KINDS[k][28], KINDS[k][29], KINDS[k][30], KINDS[k][31], KINDS[k][32], KINDS[k][33], KINDS[k][34],
                    KINDS[k][35], KINDS[k][36], KINDS[k][37], KINDS[k][38], KINDS[k][39], KINDS[k][40], KINDS[k][41],
                    KINDS[k][42], KINDS[k][43], KINDS[k][44], KINDS[k][45], KINDS[k][46], KINDS[k][47], KINDS[k][48],
                    PREC, APREC, WAIT)
        seen = tl.maximum(seen, stage - 1)
        release_count(ctr_ptr + 1 + stage)
        if STATIC:
            t += P
        else:
            t = tl.atomic_add(ctr_ptr, 1)
    if STATIC:
        t = n_items + tl.atomic_add(ctr_ptr, 1)  # (counts the programs out)
    if t == n_items + P - 1:  # the last program out: every item is done
        for i in range(0, n_stages + 1):
            tl.store(ctr_ptr + i, 0)
