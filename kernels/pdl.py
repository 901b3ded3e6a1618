"""Programmatic dependent launch (PDL, Hopper and later) for the step's kernels.

A decode step of a small model is a chain of ~130 short dependent kernels; between two of them
the GPU normally drains the first grid, flushes its writes, then dispatches the second. With
PDL a kernel is launched with ``launch_pdl=True`` and starts with ``enter(PDL)``:

* ``gdc_wait``: block until the kernels before it in the stream have completed and their
  writes are visible (so nothing a kernel reads or writes is touched before its producers are
  done: the same ordering as without PDL, hence the same bits);
* ``gdc_launch_dependents``: let the NEXT kernel's programs be dispatched now, so its launch
  and ramp-up overlap this kernel's work instead of following it.

Every kernel of the chain calls ``enter`` before its first read of anything a step writes, so
ordering is transitive: a kernel waits for its predecessor, which could not finish before
waiting for its own. Kernels not launched with PDL (torch ops, cuBLAS) wait for their
predecessors as usual, and kernels after them wait for them fully.

On the CPU interpreter and on GPUs before sm_90 ``PDL`` is 0: the branch is compiled out and
launches carry no ``launch_pdl``. ``enabled(False)`` switches it off for the launches inside
one block (the runner's ``TritonOptions.pdl``, for A/B runs). (Releasing the next kernel before
the wait was measured slower on an H200, session 7, run 32: +15 to +55 us per decode step, and
removed in session 13.)
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

# Whether launches take PDL where the device has it: True outside any ``enabled`` block; set
# only by ``enabled`` (one block at a time), never by assignment from outside.
_ENABLED = True
_INSIDE = False


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        has_opt = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:  # another backend, or a triton without it
        return False
    gdc = getattr(getattr(tl, "extra", None), "cuda", None)
    return has_opt and hasattr(gdc, "gdc_wait") and torch.cuda.get_device_capability(index)[0] >= 9


def is_enabled() -> bool:
    """Whether PDL is on now (outside any ``enabled`` block: yes), whatever the device."""
    return _ENABLED


def active(t: torch.Tensor) -> bool:
    """Whether launches on ``t``'s device use PDL now."""
    return _ENABLED and t.is_cuda and _supported(t.device.index if t.device.index is not None
                                                  else torch.cuda.current_device())


def launch_kw(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on ``t``'s device: the kernel's ``PDL`` constexpr
    and, where active, the launch option."""
    return {"PDL": 1, "launch_pdl": True} if active(t) else {"PDL": 0}


@contextlib.contextmanager
def enabled(on: bool):
    """PDL on (where the device has it) or off for the launches inside the block; restored
    after. Refuses nesting: one owner (a runner's forward) decides for its launches."""
    global _ENABLED, _INSIDE
    if _INSIDE:
        raise RuntimeError("pdl.enabled() is already active: it does not nest")
    saved, _ENABLED, _INSIDE = _ENABLED, bool(on), True
    try:
        yield
    finally:
        _ENABLED, _INSIDE = saved, False


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a step kernel (after what it may read before its producers are done):
    wait for the producers, then release the next kernel (PDL 1); PDL 0: nothing."""
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
