"""Every kernel the Triton runner launches on the real model compiles for an sm_90 GPU.

The CPU interpreter runs the kernels' arithmetic but checks nothing the GPU compiler checks
(tl.dot operand shapes, layouts, what a constexpr may be), so a kernel can pass every test here
and still fail on the device. `scripts/gpu_compile_check.py` drives runner forwards with Triton's
JIT in compile-only mode for an sm_90 target (ptxas included); it runs in a subprocess because
it swaps Triton's active driver. (Before a device session, run it with the device image's
triton, as its docstring says.)"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_runner_kernels_compile_for_sm90():
    variants = "default,qkrope,m32,gemv,noglu,unfused_combine"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_compile_check.py"), "--variants", variants],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for v in variants.split(","):
        assert f"{v}: " in r.stdout and f"{v}: FAILED" not in r.stdout
    assert "_qmma_heads_kernel" in r.stdout  # the qkrope variant's fold really launched
