"""Compile every kernel the Triton runner launches for an sm_90 GPU, here, without a GPU.

Device time is scarce and a kernel that the CPU interpreter accepts may still fail to compile on
the device (session 4 lost a call to a defaulted constexpr argument that triton 3.6 rejects and
triton 3.9 accepts). This drives `TritonRunner` forwards (prefill, decode at 1 / 16 / 32 rows)
on the real model with Triton's JIT switched to compile-only: a stand-in driver names the target
(cuda, sm_90), `JITFunction.run` compiles (through ptxas) and never launches, and the launch
options are the GPU's (tensor-core `tl.dot`, PDL, the GPU tiles). A variant is a set of
`TritonOptions` fields or a launch-configuration table patch (`VARIANTS`). Outputs are garbage;
only compilation is checked. Run it with the device image's triton (3.6.0 there):

    .venv/bin/pip install --no-deps --target /tmp/t36site triton==3.6.0
    PYTHONPATH=/tmp/t36site .venv/bin/python scripts/gpu_compile_check.py [--variants default,m32,mma]

Exit status 1 and the compiler's message where a variant fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions: set before triton is imported

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

COMPILED: set = set()  # (kernel name, compiled hash) of every launch seen
KERNELS: dict = {}  # (kernel name, hash) -> compiled kernel (for --report)
TILES: dict = {}  # (kernel name, hash) -> the tile constexprs it was launched with (for --report)


class _CompileOnlyDriver:
    """What Triton's JIT asks of the active driver before it compiles."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _install() -> None:
    triton.runtime.driver.set_active(_CompileOnlyDriver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel is not None:
            KERNELS[(self.__name__, kernel.hash)] = kernel
            TILES[(self.__name__, kernel.hash)] = " ".join(
                f"{k}={kwargs[k]}" for k in ("QTYPE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NSPLIT", "RUN") if k in kwargs)
        COMPILED.add((self.__name__, kernel.hash if kernel is not None else None))
        return kernel

    JITFunction.run = compile_only


def _gpu_options() -> None:
    """The launch choices a GPU gets: PDL on (where TritonOptions.pdl leaves it on), GPU tiles
    (no interpreter widening), inline PTX."""
    import workbench.runners.triton_graphs  # noqa: F401 (every kernel module imported now, as real JIT
    import workbench.runners.triton_layers  # noqa: F401  functions: check() sets TRITON_INTERPRET for a moment)
    from workbench.kernels import dense_mma, pdl, qmatmul, qmma

    pdl.active = lambda t: pdl.is_enabled()  # (every kernel module's launch_kw asks pdl.active)
    qmma.QMMA_INTERPRETER_MIN_BLOCK_N = 0
    qmatmul.QGEMV_INTERPRETER_MIN_BLOCK_N = 0
    dense_mma.DENSE_INTERPRETER_MIN_BLOCK_N = 0
    qmma._native = lambda x: True  # inline PTX (the streaming head's register cap) as on the GPU


# Variants: TritonOptions fields (a dict), or the name of a launch-configuration patch below
# (data tables of the kernel files, changed for the variant's forwards and put back after).
VARIANTS = {
    "default": {},
    "nopdl": {"pdl": False},
    "noglu": {"fuse_glu": False},
    "gemv": {"layer_forms": {f: "gemv" for f in ("Q8_0", "Q5_0", "Q4_K", "Q6_K")}},  # every layer on the FMA GEMV
    "mma": {"layer_forms": {}},  # every layer on tensor cores
    "unfused_combine": {"fuse_combine": False},
    "norope": {"rope_in_attention": False},  # QK-norm/rope as its own kernel in decode steps too
    "nopair": {"pair_launch": False},
    "noargmax": {"argmax_in_head": False},
    "dense_head": {"head_matmul": "dense"},  # the head's dequantized bf16 copy (the default until session 12)
    "seg32": {"attn_segment": 32},
    "runs": {"attention_runs": True},  # attention rows of one slot a run at a time (a 64-row chunk too)
    "m32": "m32",  # 32-row tensor-core tiles, layers and head
    "dense_m32": "dense_m32",  # the dense head in 32-row tiles, one program per tile
    "densestream": "densestream",  # the dense head, streaming form at 128 outputs, 2 programs per SM
    "attn_n32": "attn_n32",  # 32-key segments in one 32-key block (D = 256, bf16 K/V)
    "attn_old": "attn_old",  # session 8: 32-key segments in two 16-key blocks
    "q5k256": "q5k256",  # Q5_0 products in one 256-weight K step per program
    "split512": "split512",  # K slices of 512 weights instead of 256
    "split128": "split128",  # K slices of 128 weights (every format's step at 128)
    "slices": "slices",  # per-format K slices: 128 for the Q5_0-led and K-quant products
    "qsa": "qsa",  # QSA sparse attention in the global layers (kernels/qsa.py: summaries, select, attention)
}
TABLE_PATCHES = {  # variant -> [(module, name, value)], set for the variant's forwards
    "attn_n32": [("attention", "ATTENTION_BLOCK_N_16BIT", {256: 32})],
    "attn_old": [("attention", "ATTENTION_BLOCK_N_16BIT", {256: 16})],
    "q5k256": [("qmma", "QMMA_CONFIGS", "q5k256")],
    "split512": [("qmatmul", "QMATMUL_SPLIT_K", 512)],
    "split128": [("qmatmul", "QMATMUL_SPLIT_K", 128), ("qmma", "QMMA_CONFIGS", "k128"),
                 ("qmatmul", "QGEMV_CONFIGS", "gemv_k128")],
    "slices": [("qmatmul", "QMATMUL_FORMAT_SPLIT_K", {"Q5_0": 128, "Q4_K": 128, "Q6_K": 128})],
}
TABLE_OPTIONS = {"attn_n32": {"attn_segment": 32}, "attn_old": {"attn_segment": 32}}  # (options with a patch)
CONFIG_PATCHES = {  # QMMA_CONFIGS / QGEMV_CONFIGS values named in TABLE_PATCHES: format -> fields changed
    "q5k256": {"Q5_0": {"block_k": 256}},
    "k128": {f: {"block_k": 128} for f in ("Q4_K", "Q6_K", "Q8_0")},
    "gemv_k128": {f: {"block_k": 128} for f in ("Q4_K", "Q6_K", "Q8_0")},
}


def check(model, name: str, kw) -> float:
    """Compile the forwards of one variant: a 7-row prefill chunk (eager), then decode steps of
    1, 16 and 32 new rows through the decode graph's body (graphs="emulate": the rope prologue,
    the head's argmax, the device-fed inputs), with the GPU's forms."""
    from dataclasses import replace

    from workbench.kernels import attention, dense_mma, qmatmul, qmma
    from workbench.kernels.sampling import argmax
    from workbench.runners.direct_pages import DirectPages
    from workbench.runners.triton_options import TritonOptions
    from workbench.runners.triton_runner import TritonRunner

    mods = {"attention": attention, "qmma": qmma, "qmatmul": qmatmul, "dense_mma": dense_mma}
    patches = list(TABLE_PATCHES.get(kw, [])) if isinstance(kw, str) else []
    if kw == "m32":
        patches = [("qmma", t, {k: replace(c, block_m=32) for k, c in getattr(qmma, t).items()})
                   for t in ("QMMA_CONFIGS", "QMMA_WIDE_CONFIGS")]
    if kw == "dense_m32":
        patches = [("dense_mma", "DENSE_CONFIG", replace(dense_mma.DENSE_CONFIG, block_m=32, programs_per_sm=0))]
    if kw == "densestream":
        patches = [("dense_mma", "DENSE_CONFIG", replace(dense_mma.DENSE_CONFIG, block_n=128, programs_per_sm=2))]
    options = TABLE_OPTIONS.get(kw, {}) if isinstance(kw, str) else kw
    undo = []
    for mod, attr, value in patches:
        old = getattr(mods[mod], attr)
        undo.append((mods[mod], attr, old))
        if isinstance(value, str):  # (a named config table change)
            table = qmatmul.QGEMV_CONFIGS if value.startswith("gemv") else qmma.QMMA_CONFIGS
            value = {**table, **{f: replace(table[f], **kw_) for f, kw_ in CONFIG_PATCHES[value].items()}}
        elif isinstance(value, dict) and isinstance(old, dict):  # (entries changed, the rest kept)
            value = {**old, **value}
        setattr(mods[mod], attr, value)
    t0 = time.perf_counter()
    try:
        os.environ["TRITON_INTERPRET"] = "1"  # (only for the runner's CPU-device check)
        from workbench.qsa import QSAConfig

        r = TritonRunner(model, 1024, TritonOptions(**{**options, "graphs": "emulate"}), device="cpu",
                         qsa=QSAConfig(top_k=4) if kw == "qsa" else None)
        os.environ.pop("TRITON_INTERPRET", None)
        # the GPU's forms: tensor-core tl.dot, and the dense head's input in bfloat16
        r.loop.use_dot = True
        if r.head_matmul == "dense" and model.dtype == torch.bfloat16:
            r.loop.head_x_dtype = torch.bfloat16
        V = model.config.vocab_size
        pages = DirectPages(r, 64 * 256)
        r.run([pages.segment(0, "a", tuple(range(5, 12)), 0)], {0: 256})  # a 7-row prefill chunk
        if options.get("attention_runs"):  # a 64-row chunk: its rows in runs
            r.run([pages.segment(1, "w", tuple(range(5, 69)), 0)], {1: 256})
        for rows in (1, 16, 32):  # decode steps: one token per sequence (new ones), the graph's body
            r.run([pages.segment(s, f"{rows}-{s}", (5,), 0) for s in range(rows)], {s: 256 for s in range(rows)})
        argmax(torch.zeros(16, V), out=torch.empty(16, dtype=torch.int64))
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        for mod, attr, value in undo:
            setattr(mod, attr, value)
    return time.perf_counter() - t0


def report() -> None:
    """Registers, spills and shared memory of each compiled specialization (ptxas -v on its PTX;
    Triton targets sm_90a on Hopper)."""
    import re
    import subprocess
    import tempfile

    try:  # the ptxas Triton itself compiles sm_90 with (triton 3.9 emits PTX 9.x, which the wheel's
        # plain `ptxas`, CUDA 12.9, rejects)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except ImportError:  # (older triton: the wheel's)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    seen = set()
    for (name, h), k in sorted(KERNELS.items()):
        ptx = k.asm.get("ptx")
        if ptx is None or (name, h) in seen:
            continue
        seen.add((name, h))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                 text=True, check=False)
            out = out.stderr + out.stdout
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores", out)
        warps = k.metadata.num_warps
        print(f"  {name} [{h[:8]}] warps {warps}: {regs.group(1) if regs else '?'} registers, "
              f"{spill.group(1) if spill else '?'} B spill stores, {k.metadata.shared} B shared"
              + (f"  ({TILES[(name, h)]})" if TILES.get((name, h)) else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded default model)")
    ap.add_argument("--report", action="store_true", help="registers / spills / shared memory per kernel")
    ap.add_argument("--ptx", default=None, metavar="DIR", help="write each compiled specialization's PTX into DIR")
    ap.add_argument("--variants", default="default,m32,mma,dense_head",
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = ap.parse_args()
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"unknown variant(s) {', '.join(bad)}: allowed {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    _install()
    from workbench.default_model import default_model_path
    from workbench.model import load_model

    _gpu_options()
    model = load_model(args.model or str(default_model_path()), dtype="bfloat16")
    print(f"triton {triton.__version__}, target sm_90")
    failed = 0
    for name in names:
        try:
            COMPILED.clear()
            KERNELS.clear()
            TILES.clear()
            dt = check(model, name, VARIANTS[name])
            kernels = sorted({k for k, _ in COMPILED})
            print(f"{name}: {len(COMPILED)} specializations of {len(kernels)} kernels compiled in {dt:.0f} s "
                  f"({', '.join(kernels)})")
            if args.report:
                report()
            if args.ptx:
                os.makedirs(args.ptx, exist_ok=True)
                for (kname, h), k in KERNELS.items():
                    with open(os.path.join(args.ptx, f"{name}.{kname}.{h[:8]}.ptx"), "w") as f:
                        f.write(k.asm.get("ptx", ""))
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"{name}: FAILED\n{traceback.format_exc()[-3000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
