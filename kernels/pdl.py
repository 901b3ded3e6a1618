"""Programmatic dependent launch (PDL, Hopper and later) for the step's kernels.

A decode step of a small model is a chain of ~180 short dependent kernels; between two of them
the GPU normally drains the first grid, flushes its writes, then dispatches the second. With
PDL a kernel is launched with ``launch_pdl=True`` and starts with ``enter(PDL)``:

* ``gdc_wait``: block until the kernels before it in the stream have completed and their
  writes are visible (so nothing a kernel reads or writes is touched before its producers are
  done: the same ordering as without PDL, hence the same bits);
* ``gdc_launch_dependents``: let the NEXT kernel's programs be dispatched now, so its launch
  and ramp-up overlap this kernel's work instead of following it.

Every kernel of the chain calls ``enter`` before its first global load or store, so ordering is
transitive: a kernel waits for its predecessor, which could not finish before waiting for its
own. Kernels not launched with PDL (torch ops, cuBLAS) wait for their predecessors as usual, and
kernels after them wait for them fully.

On the CPU interpreter and on GPUs before sm_90 ``PDL`` is 0: the branch is compiled out and
launches carry no ``launch_pdl``. ``PDL`` is 0 (off), 1 (wait, then release) or 2 (release,
then wait: ``EARLY``). ``ENABLED`` switches it off everywhere (for A/B runs; the
runner's ``pdl=`` sets it around its launches with ``enabled``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

ENABLED = True
# Release the next kernel before waiting (``enter``): its programs are dispatched as soon as every
# program of this one has started, so several kernels ahead can fetch their weights during this
# one (each still waits for its predecessor before touching anything a step writes, so every bit
# is unchanged). False: wait, then release (the next kernel is dispatched once this one's
# producer is done). Off: slower on an H200 (session 7, run 32: +15 to +55 us per decode step;
# the early programs sit in their wait holding slots the working grid needs).
EARLY = False


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        has_opt = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:  # another backend, or a triton without it
        return False
    gdc = getattr(getattr(tl, "extra", None), "cuda", None)
    return has_opt and hasattr(gdc, "gdc_wait") and torch.cuda.get_device_capability(index)[0] >= 9


def active(t: torch.Tensor) -> bool:
    """Whether launches on ``t``'s device use PDL now."""
    return ENABLED and t.is_cuda and _supported(t.device.index if t.device.index is not None
                                                 else torch.cuda.current_device())


def launch_kw(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on ``t``'s device: the kernel's ``PDL`` constexpr
    and, where active, the launch option."""
    on = active(t)
    return {"PDL": 2 if EARLY else 1, "launch_pdl": True} if on else {"PDL": 0}


@contextlib.contextmanager
def enabled(on: bool):
    """ENABLED = on inside the block (restored after)."""
    global ENABLED
    saved, ENABLED = ENABLED, bool(on)
    try:
        yield
    finally:
        ENABLED = saved


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a step kernel: wait for the producers, release the next kernel (PDL
    1), or release it first (PDL 2, ``EARLY``); PDL 0: nothing."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# -- ordering inside one launch (kernels/persistent.py) -------------------------------------------
# A persistent step kernel runs the step's work items in one launch; an item waits for its
# producers on a counter instead of a kernel boundary. WAIT: 0 none (a kernel of the chain),
# 1 an acquire atomic (any target, the CPU interpreter included), 2 an acquire load (GPU).


@triton.jit
def _acquire_load(ptr):
    # every thread reads and acquires for itself: its later loads see what the producer released
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def wait_count(ctr_ptr, need, WAIT: tl.constexpr):
    """Spin until the int32 counter at ``ctr_ptr`` reaches ``need`` (acquire); need 0: no wait."""
    if need > 0:
        if WAIT == 2:
            c = _acquire_load(ctr_ptr)
            while c < need:
                c = _acquire_load(ctr_ptr)
        elif WAIT == 1:
            c = tl.atomic_add(ctr_ptr, 0, sem="acquire")
            while c < need:
                c = tl.atomic_add(ctr_ptr, 0, sem="acquire")


@triton.jit
def enter_or_wait(PDL: tl.constexpr, WAIT: tl.constexpr, ctr_ptr, need):
    """``enter`` for a kernel of the chain (WAIT 0), ``wait_count`` for a persistent item."""
    enter(PDL)
    if WAIT > 0:
        wait_count(ctr_ptr, need, WAIT)


@triton.jit
def release_count(ctr_ptr):
    """After an item's stores: +1 on its stage's counter (every thread's stores first)."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release")
