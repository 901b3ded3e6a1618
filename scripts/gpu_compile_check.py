"""Compile every kernel the Triton runner launches for an sm_90 GPU, here, without a GPU.

Device time is scarce and a kernel that the CPU interpreter accepts may still fail to compile on
the device (session 4 lost a call to a defaulted constexpr argument that triton 3.6 rejects and
triton 3.9 accepts). This drives `TritonRunner` forwards (prefill, decode at 1 / 16 / 32 rows)
on the real model with Triton's JIT switched to compile-only: a stand-in driver names the target
(cuda, sm_90), `JITFunction.run` compiles (through ptxas) and never launches, and the launch
options are the GPU's (tensor-core `tl.dot`, PDL, the GPU tiles). Outputs are garbage; only
compilation is checked. Run it with the device image's triton (3.6.0 there):

    .venv/bin/pip install --no-deps --target /tmp/t36site triton==3.6.0
    PYTHONPATH=/tmp/t36site .venv/bin/python scripts/gpu_compile_check.py [--variants default,qkrope,m32]

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
                f"{k}={kwargs[k]}" for k in ("QTYPE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NSPLIT") if k in kwargs)
        COMPILED.add((self.__name__, kernel.hash if kernel is not None else None))
        return kernel

    JITFunction.run = compile_only


def _gpu_options(modules) -> None:
    """The launch choices a GPU gets: PDL on, GPU tiles (no interpreter widening)."""
    from workbench.kernels import dense_mma, pdl, persistent, qmatmul, qmma

    def launch_kw(t):
        return {"PDL": 2 if pdl.EARLY else 1, "launch_pdl": True} if pdl.ENABLED else {"PDL": 0}

    for mod in modules:
        if hasattr(mod, "launch_kw"):
            mod.launch_kw = launch_kw
    qmma.QMMA_INTERPRETER_MIN_BLOCK_N = 0
    qmatmul.QGEMV_INTERPRETER_MIN_BLOCK_N = 0
    dense_mma.DENSE_INTERPRETER_MIN_BLOCK_N = 0
    qmma._native = lambda x: True  # inline PTX (L2 prefetches, acquire-load waits) as on the GPU
    persistent.launch_kw = launch_kw


VARIANTS = {
    "default": {},
    "nopdl": {"pdl": False},
    "noglu": {"fuse_glu": False},
    "qkrope": {"fuse_qk_rope": True},
    "gemv": {"matmul": "gemv", "head_matmul": "mma"},
    "q8gemv": {"layer_forms": {"Q8_0": "gemv"}},
    "unfused_combine": {"fuse_combine": False},
    "m32": "m32",
    "packed_head": {"head_matmul": "mma"},
    "dense_m32": "dense_m32",
    "prefetch": "prefetch",
    "attn_fma": {"attn_dot": False},
    "addnorm": {"fuse_add_norm": True},
    "attn_bf16": {"attn_bf16": True},
    "attn_tf32x3": {"attn_bf16": False},
    "folds": {"fuse_add_norm": True, "fuse_qk_rope": True, "attn_dot": False},
    "persistent": "persistent",
    "persistent_static": "persistent_static",
    "persistent_atomic": "persistent_atomic",
    "early": "early",  # kernels/pdl.py EARLY: release the next kernel before the wait
    "attn_prefetch": "attn_prefetch",  # attention.ATTENTION_PREFETCH: K/V lines to L2 before the wait
    "attn_n32": "attn_n32",  # 32-key segments in one 32-key block (D = 256, bf16 K/V)
    "attn_old": "attn_old",  # session 8: 32-key segments in two 16-key blocks
    "attn_s1": "attn_s1",  # the attention partial kernel at 1 / 2 pipelining stages
    "attn_s2": "attn_s2",
    "q5k256": "q5k256",  # Q5_0 products in one 256-weight K step per program
    "preload": "preload",  # Q5_0 products fetch their second step's bytes before the wait
    "preload_k128": "preload_k128",  # the same, and Q4_K / Q6_K in two 128-weight steps
    "split512": "split512",  # K slices of 512 weights instead of 256
    "split128": "split128",  # K slices of 128 weights (every format's step at 128)
    "slices": "slices",  # per-format K slices: 128 for the Q5_0-led and K-quant products
    "tuned": "tuned",  # the three above together
    "q8head": {"head_matmul": "q8dense"},  # the head's products from its Q8_0 planes
    "q8f16": {"head_matmul": "q8f16"},  # the same with float16 operands
    "glu_down": {"glu_in_down": True},  # the FFN down product forms the GLU from gate|up's partials
    "q8i8": {"head_matmul": "q8i8"},  # the Q8_0 planes against x's Q8_0 blocks, integer MMAs (the default since session 12)
    "dense_head": {"head_matmul": "dense"},  # the head's dequantized bf16 copy (the default until session 12)
    "q8i8b": "q8i8b",  # the same with the serial K step (dense_mma.I8_STEP)
    "q8i8b16": "q8i8b16",  # q8i8b in 16-row tiles, 4 programs per SM
    "attn_preload": "attn_preload",  # attention.ATTENTION_PRELOAD: older K/V rows loaded before the wait
    "pair": {"pair_launch": True},  # the mixed-format q|k|v as one launch
    "rope_attn": {"rope_in_attention": True},  # QK-norm/rope/KV as the attention programs' prologue
    "q8stream": "q8stream",  # the same, streaming form (DenseConfig.programs_per_sm)
    "densestream": "densestream",  # the dequantized head, streaming form
}
STEP_OPTIONS = {  # variant -> [(module, name, value)], set for the variant's forwards
    "early": [("pdl", "EARLY", True)],
    "attn_prefetch": [("attention", "ATTENTION_PREFETCH", True)],
    "attn_n32": [("attention", "ATTENTION_BLOCK_N_16BIT", {256: 32}), ("runner", "ATTN_SEGMENT", 32)],
    "attn_old": [("attention", "ATTENTION_BLOCK_N_16BIT", {256: 16}), ("runner", "ATTN_SEGMENT", 32)],
    "attn_s1": [("attention", "ATTENTION_NUM_STAGES", 1)],
    "attn_s2": [("attention", "ATTENTION_NUM_STAGES", 2)],
    "q8i8b": [("runner", "HEAD_MATMUL", "q8i8"), ("dense_mma", "I8_STEP", "serial")],
    "q8i8b16": [("runner", "HEAD_MATMUL", "q8i8"), ("dense_mma", "I8_STEP", "batched"),
                ("dense_mma", "DENSE_CONFIG", "m16"), ("dense_mma", "Q8_PROGRAMS_PER_SM", 4)],
    "attn_preload": [("attention", "ATTENTION_PRELOAD", True)],
    "q5k256": [("qmma", "QMMA_CONFIGS", "q5k256")],
    "preload": [("qmma", "QMMA_CONFIGS", "preload")],
    "preload_k128": [("qmma", "QMMA_CONFIGS", "preload_k128")],
    "split512": [("qmatmul", "QMATMUL_SPLIT_K", 512)],
    "split128": [("qmatmul", "QMATMUL_SPLIT_K", 128), ("qmma", "QMMA_CONFIGS", "k128"),
                 ("qmatmul", "QGEMV_CONFIGS", "gemv_k128")],
    "slices": [("qmatmul", "QMATMUL_FORMAT_SPLIT_K", {"Q5_0": 128, "Q4_K": 128, "Q6_K": 128})],
}
CONFIG_PATCHES = {  # QMMA_CONFIGS values named in STEP_OPTIONS: format -> fields changed
    "q5k256": {"Q5_0": {"block_k": 256}},
    "preload": {"Q5_0": {"preload": True}},
    "preload_k128": {"Q5_0": {"preload": True}, "Q4_K": {"block_k": 128, "preload": True},
                     "Q6_K": {"block_k": 128, "preload": True}},
    "k128": {f: {"block_k": 128} for f in ("Q4_K", "Q6_K", "Q8_0")},
    "gemv_k128": {f: {"block_k": 128} for f in ("Q4_K", "Q6_K", "Q8_0")},
}
STEP_OPTIONS["tuned"] = [o for k in ("early", "attn_prefetch", "q5k256") for o in STEP_OPTIONS[k]]


def check(model, name: str, kw) -> float:
    from dataclasses import replace

    from workbench.kernels import dense_mma, qmma
    from workbench.kernels.sampling import argmax

    from workbench.scheduler import Segment
    from workbench.triton_runner import TritonRunner

    saved, saved_wide = dict(qmma.QMMA_CONFIGS), dict(qmma.QMMA_WIDE_CONFIGS)
    saved_dense = dense_mma.DENSE_CONFIG
    if kw == "prefetch":  # the head's L2 prefetch (inline PTX: compiled for the GPU only)
        for k, cfg in qmma.QMMA_WIDE_CONFIGS.items():
            qmma.QMMA_WIDE_CONFIGS[k] = replace(cfg, prefetch=264)
        kw = {}
    if kw == "dense_m32":  # the dense head with 32-row tiles
        dense_mma.DENSE_CONFIG = replace(saved_dense, block_m=32)
        kw = {}
    if kw in ("q8stream", "densestream"):
        dense_mma.DENSE_CONFIG = replace(saved_dense, block_n=128, programs_per_sm=2)
        kw = {"head_matmul": "q8dense"} if kw == "q8stream" else {}
    if kw == "m32":
        for table in (qmma.QMMA_CONFIGS, qmma.QMMA_WIDE_CONFIGS):
            for k, cfg in table.items():
                table[k] = replace(cfg, block_m=32)
        kw = {}
    from workbench import triton_runner
    from workbench.kernels import attention, pdl, qmatmul
    from workbench.kernels import persistent as ps

    mods = {"pdl": pdl, "attention": attention, "qmma": qmma, "qmatmul": qmatmul, "runner": triton_runner,
            "dense_mma": dense_mma}
    undo = []
    for mod, attr, value in STEP_OPTIONS.get(kw, []) if isinstance(kw, str) else []:
        undo.append((mods[mod], attr, getattr(mods[mod], attr)))
        if value == "m16":  # (DENSE_CONFIG in 16-row tiles)
            value = replace(dense_mma.DENSE_CONFIG, block_m=16)
        if isinstance(value, str) and value in CONFIG_PATCHES:
            table = qmatmul.QGEMV_CONFIGS if value.startswith("gemv") else qmma.QMMA_CONFIGS
            value = {**table, **{f: replace(table[f], **kw_) for f, kw_ in CONFIG_PATCHES[value].items()}}
        setattr(mods[mod], attr, value)
    if undo:
        kw = {}
    persistent = isinstance(kw, str) and kw.startswith("persistent")
    saved_mode = ps.ASSIGN, ps.POLL
    if persistent:  # the decode forwards as one persistent launch (graphs: the runner's only user)
        ps.ASSIGN = "static" if kw == "persistent_static" else "ticket"
        ps.POLL = "atomic" if kw == "persistent_atomic" else "load"
        kw = {}
    t0 = time.perf_counter()
    try:
        os.environ["TRITON_INTERPRET"] = "1"  # (only for the runner's CPU-device check)
        r = TritonRunner(model, 1024, device="cpu", graphs=False, **kw)
        os.environ.pop("TRITON_INTERPRET", None)
        r.use_dot = True  # the GPU's product and attention forms
        r.attn_dot = kw.get("attn_dot", True)
        if persistent:
            r._persistent_on()
        V = model.config.vocab_size
        r.run([Segment(0, "a", tuple(range(5, 12)), 0, True)], {0: 256})  # a 7-row prefill chunk
        for rows in (1, 16, 32):  # decode-shaped forwards: one token per sequence (new ones)
            r._persist_now = persistent
            r._decode_graph = r.rope_in_attention  # (the form graphed decode steps take)
            r.run([Segment(s, f"{rows}-{s}", (5,), 0, True) for s in range(rows)], {s: 256 for s in range(rows)})
        argmax(torch.zeros(16, V), out=torch.empty(16, dtype=torch.int64))
        fed = torch.zeros(2, 16, dtype=torch.int32)  # (the decode graphs' form: next inputs and the token record)
        argmax(torch.zeros(16, V), out=torch.empty(16, dtype=torch.int64), feed=(fed[0], fed[1]),
               hist=torch.zeros(16, 1024, dtype=torch.int64), host=torch.zeros(16, 2, dtype=torch.int64))
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        qmma.QMMA_CONFIGS.update(saved)
        qmma.QMMA_WIDE_CONFIGS.update(saved_wide)
        dense_mma.DENSE_CONFIG = saved_dense
        ps.ASSIGN, ps.POLL = saved_mode
        for mod, attr, value in undo:
            setattr(mod, attr, value)
    return time.perf_counter() - t0


def report() -> None:
    """Registers, spills and shared memory of each compiled specialization (ptxas -v on its PTX;
    Triton targets sm_90a on Hopper)."""
    import re
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")  # (the wheel's)
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
    ap.add_argument("--variants", default="default,qkrope,m32,q8gemv",
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = ap.parse_args()
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"unknown variant(s) {', '.join(bad)}: allowed {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    _install()
    from workbench.kernels import (
        attention,
        dense_mma,
        embedding,
        norm,
        qmatmul,
        qmma,
        rope,
        sampling,
        step_fused,
    )

    from workbench.default_model import default_model_path
    from workbench.model import load_model

    _gpu_options([attention, dense_mma, embedding, norm, qmatmul, qmma, rope, sampling, step_fused])
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
