"""Open a GGUF file: metadata, tensor index and a memory map of the tensor bytes.

Parsing is done by the `gguf` package's `GGUFReader`. That reader builds Python objects for
every metadata entry, which costs ~8 s for Gemma 3's 262k-entry vocabulary. The parsed result
(metadata as plain Python values, the tensor index, the file's sha256) is therefore pickled
into a start-up cache keyed by the file's path, size and mtime; a second start reads the cache
and memory-maps the tensor bytes with numpy, which takes a fraction of a second.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import WorkbenchError

GGUF_MAGIC = b"GGUF"
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Where start-up caches live: $SLOTLAB_CACHE, else ~/.cache/slotlab."""
    root = os.environ.get("SLOTLAB_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "slotlab"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order: GGUF ne reversed, rows first
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def qtype_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name


@dataclass(frozen=True)
class GGUFIndex:
    """What the cache holds: everything about the file except the tensor bytes."""

    path: str
    size: int
    sha256: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _field_value(field) -> Any:
    """A ReaderField as a plain Python value; big numeric arrays become numpy arrays."""
    import gguf

    types = field.types
    if types and types[0] == gguf.GGUFValueType.ARRAY and len(types) > 1:
        if types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([np.asarray(field.parts[i]) for i in field.data]) if field.data else np.zeros(0)
    return field.contents()


def _check_header(path: Path) -> int:
    if not path.exists():
        raise WorkbenchError(f"model file not found: {path} (pass --model PATH to a .gguf file)")
    if not path.is_file():
        raise WorkbenchError(f"model path is not a file: {path} (pass --model PATH to a .gguf file)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise WorkbenchError(
            f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF')"
        )
    return size


def _parse(path: Path, size: int) -> GGUFIndex:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises bare ValueError/IndexError on damage
        raise WorkbenchError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = _field_value(field)
    tensors = {}
    for t in reader.tensors:
        info = TensorInfo(
            name=t.name,
            qtype=int(t.tensor_type),
            shape=tuple(int(x) for x in reversed(t.shape.tolist())),
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )
        if info.offset + info.nbytes > size:
            raise WorkbenchError(
                f"{path} is truncated: tensor {t.name} needs bytes up to {info.offset + info.nbytes:,} "
                f"but the file has {size:,}"
            )
        tensors[t.name] = info
    del reader
    return GGUFIndex(str(path), size, sha256_file(path), metadata, tensors)


class GGUFFile:
    """A GGUF file: `metadata`, `tensors` (name -> TensorInfo) and `raw(name)` byte views."""

    def __init__(self, index: GGUFIndex):
        self.index = index
        self.path = Path(index.path)
        self.metadata = index.metadata
        self.tensors = index.tensors
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")

    @classmethod
    def open(cls, path: str | os.PathLike, use_cache: bool = True) -> "GGUFFile":
        path = Path(path).expanduser().resolve()
        size = _check_header(path)
        st = path.stat()
        key = hashlib.sha1(f"{CACHE_FORMAT}|{path}|{size}|{st.st_mtime_ns}".encode()).hexdigest()
        cfile = cache_dir() / "gguf" / f"{key}.pkl"
        if use_cache and cfile.exists():
            try:
                with open(cfile, "rb") as f:
                    return cls(pickle.load(f))
            except Exception:
                pass  # a stale or damaged cache is rebuilt below
        index = _parse(path, size)
        if use_cache:
            from .atomic import atomic_write_bytes

            atomic_write_bytes(cfile, pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
        return cls(index)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes exactly as stored, as a read-only uint8 view."""
        t = self.tensors[name]
        return self._mm[t.offset : t.offset + t.nbytes]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)
