"""Atomic file writes: write a temporary file beside the target, fsync, then rename over it.

A reader sees the old file or the whole new one, never a half-written one, and a killed writer
leaves at most a stray temporary. Used for results, manifests, caches and built pages.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call `write(tmp_path)` to produce the file, then move it over `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        # mkstemp makes the file 0600; give it the mode a plain open() would (or the old file's).
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_parquet(path: str | os.PathLike, frame) -> Path:
    """`frame`: a polars DataFrame."""
    return atomic_write(path, frame.write_parquet)
