"""What one kernel boundary of the decode chain costs, by synchronization mode (H200, issue 4).

A graphed chain of short dependent kernels, shaped like the decode step's (products of a few
hundred programs, per-row kernels of 16): each program fetches a slice of read-only "weights",
waits for its predecessor, reads a slice its predecessor wrote, writes its own. Modes:

* ``plain``: launches in a CUDA graph, no PDL (the grid boundary: drain, flush, dispatch);
* ``pdl``: PDL, wait then release (the runner's chain, kernels/pdl.py ``enter``);
* ``pdl_early``: PDL, release then wait (the next grid is dispatched before this one's wait);
* ``counter``: PDL release first, then no grid wait at all: one thread spins (acquire atomic)
  on the predecessor's counter until all its programs have released it, and every program
  releases its own counter after its stores (``_wait_count`` / ``_release_count`` below: the
  removed persistent step kernel's mechanism). Deadlock-free: a grid is dispatched only when
  every program of its predecessor has started.
* ``counter_load``: the same with every thread spinning on an acquire load.

Measured in session 7 (run 31, docs/GPU_NOTES.md "What one boundary costs"); the release-first
and counter forms lost in the step (sessions 6-7) and left the kernels: they live here only.

Every mode's final buffer is checked bitwise against ``plain``'s (a race shows as a mismatch).
Prints a table (us per kernel) and writes JSON to argv[1] when given.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from graph_timing import graph_replay_us  # noqa: E402  (scripts/, the script's own folder)

from kernels.pdl import enter  # noqa: E402

MODES = {"plain": 0, "pdl": 1, "pdl_early": 2, "counter": 3, "counter_load": 4}


@triton.jit
def _acquire_load(ptr):
    # every thread reads and acquires for itself: its later loads see what the producer released
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _wait_count(ctr_ptr, need, WAIT: tl.constexpr):
    """Spin until the int32 counter at ``ctr_ptr`` reaches ``need`` (acquire): WAIT 1 an acquire
    atomic, 2 an acquire load."""
    if need > 0:
        if WAIT == 2:
            c = _acquire_load(ctr_ptr)
            while c < need:
                c = _acquire_load(ctr_ptr)
        else:
            c = tl.atomic_add(ctr_ptr, 0, sem="acquire")
            while c < need:
                c = tl.atomic_add(ctr_ptr, 0, sem="acquire")


@triton.jit
def _release_count(ctr_ptr):
    """After a program's stores: +1 on its counter (every thread's stores first)."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release")


@triton.jit
def _link(src, dst, w, ctr, idx, need, n_src, MODE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    wv = tl.load(w + pid * BLOCK + offs)  # read-only: fetched before the wait, as the products do
    if MODE <= 1:  # the chain's own entry (kernels/pdl.py): none, or wait then release
        enter(MODE)
    elif MODE == 2:  # release, then wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    else:
        tl.extra.cuda.gdc_launch_dependents()
        _wait_count(ctr + idx - 1, need, 1 if MODE == 3 else 2)
    x = tl.load(src + (pid % n_src) * BLOCK + offs)
    tl.store(dst + pid * BLOCK + offs, x * 0.999 + wv)
    if MODE >= 3:
        _release_count(ctr + idx)


def run_chain(grids, mode: str, reps: int = 50):
    dev = "cuda"
    B = 1024
    gmax = max(grids)
    torch.manual_seed(0)
    w = torch.randn(len(grids), gmax * B, device=dev)
    bufs = [torch.randn(gmax * B, device=dev) for _ in range(2)]
    init = bufs[0].clone()
    ctr = torch.zeros(len(grids) + 1, dtype=torch.int32, device=dev)
    m = MODES[mode]

    def step():
        ctr.zero_()
        bufs[0].copy_(init)
        for i, g in enumerate(grids):
            need = grids[i - 1] if i > 0 else 0
            n_src = grids[i - 1] if i > 0 else gmax
            kw = {"launch_pdl": True} if m > 0 else {}
            _link[(g,)](bufs[i % 2], bufs[(i + 1) % 2], w[i], ctr, i + 1, need, n_src,
                        MODE=m, BLOCK=B, num_warps=4, **kw)

    times = graph_replay_us(step, reps, warm=5)
    out = bufs[len(grids) % 2].clone()
    return statistics.median(times), out


def main() -> None:
    chains = {
        "products 264 x 160": [264] * 160,
        "rows 16 x 160": [16] * 160,
        "step-like (264,16,128,16,384,16,256,16) x 20": [264, 16, 128, 16, 384, 16, 256, 16] * 20,
    }
    rows = []
    for name, grids in chains.items():
        ref = None
        for mode in MODES:
            us, out = run_chain(grids, mode)
            if ref is None:
                ref = out
            same = bool(torch.equal(out, ref))
            rows.append({"chain": name, "mode": mode, "kernels": len(grids), "us_step": us,
                         "us_per_kernel": us / len(grids), "bitwise_plain": same})
            print(f"SYNC {name:48s} {mode:13s} {us:8.1f} us  {us / len(grids):6.2f} us/kernel  same={same}",
                  flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
