"""Every kernel the Triton runner launches on the real model compiles for an sm_90 GPU.

The CPU interpreter runs the kernels' arithmetic but checks nothing the GPU compiler checks
(tl.dot operand shapes, layouts, what a constexpr may be), so a kernel can pass every test here
and still fail on the device. `scripts/gpu_compile_check.py` drives runner forwards (a prefill
chunk, then decode steps through the decode graph's body) with Triton's JIT in compile-only
mode for an sm_90 target (ptxas included); it runs in a subprocess because it swaps Triton's
active driver. (Before a device session, run it with the device image's triton, as its
docstring says.)"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_runner_kernels_compile_for_sm90():
    variants = "default,mma,m32,gemv,noglu,unfused_combine,norope,dense_head,qsa,runs"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_compile_check.py"), "--variants", variants],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines() if ": " in line}
    for v in variants.split(","):
        assert v in lines and "FAILED" not in lines[v], r.stdout[-4000:]
    # the default's graphed decode step: QK-norm/rope in attention's prologue, the mixed q|k|v as
    # one launch, the int8 head with its argmax finished by the argmax's last launch
    for kernel in ("_attention_rope_kernel", "_mma_gemv_pair_kernel", "_dense_stream_kernel", "_argmax_rows_kernel"):
        assert kernel in lines["default"], lines["default"]
    assert "_qk_rope_kv_kernel" in lines["norope"] and "_attention_rope_kernel" not in lines["norope"]
    assert "_glu_kernel" in lines["noglu"] and "_attention_combine_kernel" in lines["unfused_combine"]
