"""Shared fixtures: small random-weight GGUF models, the real default model, an isolated cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET when a kernel module is first imported: without a GPU, the
# kernels run under the interpreter, whichever test imports them first.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# Every test session gets its own start-up cache, so tests never depend on a user's cache.
# Under pytest-xdist each worker gets its own (a worker inherits the controller's environment),
# so no two processes race on one cache, and each worker runs torch on one thread: the workers
# already fill the cores, and two-thread pools on a two-core machine would contend.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    os.environ["SLOTLAB_CACHE"] = tempfile.mkdtemp(prefix=f"slotlab-test-cache-{_worker}-")
    try:
        torch.set_num_threads(1)
    except NameError:
        pass
else:
    os.environ.setdefault("SLOTLAB_CACHE", tempfile.mkdtemp(prefix="slotlab-test-cache-"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir):
    """Factory: tiny_gguf(arch="llama", weight_type="Q8_0", **spec) -> path (cached per spec)."""
    from workbench.synthetic import SyntheticSpec, write_random_gguf

    made: dict = {}

    def make(arch: str = "llama", weight_type: str = "Q8_0", **kw) -> Path:
        key = (arch, weight_type, tuple(sorted(kw.items())))
        if key not in made:
            name = f"{arch}-{weight_type}-{len(made)}.gguf"
            made[key] = write_random_gguf(tiny_dir / name, SyntheticSpec(arch=arch, weight_type=weight_type, **kw))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf):
    """Factory: tiny_model(arch, dtype, weight_type) -> loaded Model (cached)."""
    from workbench.model import load_model

    cache: dict = {}

    def get(arch: str = "gemma3", dtype: str = "float32", weight_type: str = "Q8_0", **kw):
        key = (arch, dtype, weight_type, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = load_model(tiny_gguf(arch, weight_type, **kw), dtype=dtype)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def real_model_bf16():
    from workbench.model import load_model

    return load_model(dtype="bfloat16")


@pytest.fixture(scope="session")
def real_model_f32():
    from workbench.model import load_model

    return load_model(dtype="float32")


@pytest.fixture(scope="session")
def q2k_gguf(tiny_dir):
    """A tiny llama whose blk.0.ffn_down is declared Q2_K (a type the engine does not support)."""
    import gguf
    import numpy as np

    from workbench.synthetic import SyntheticSpec, write_random_gguf

    src = write_random_gguf(tiny_dir / "f32-src.gguf", SyntheticSpec(weight_type="F32"))
    r = gguf.GGUFReader(str(src))
    out = tiny_dir / "q2k.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name == "blk.0.ffn_down.weight":  # [128 rows, 256 cols]: one Q2_K block (84 bytes) per row
            rows, cols = int(t.shape[1]), int(t.shape[0])
            raw = np.random.default_rng(0).integers(0, 255, (rows, cols // 256 * 84), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape([int(s) for s in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
