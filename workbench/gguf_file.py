"""Open a GGUF file: metadata, tensor index and a memory map of the tensor bytes.

Parsing is done by the `gguf` package's `GGUFReader`. That reader builds Python objects for
every metadata entry, which costs ~8 s for Gemma 3's 262k-entry vocabulary. The parsed result
(metadata as plain Python values, the tensor index, the file's sha256) is therefore pickled
into a start-up cache keyed by the file's path, size and mtime; a second start reads the cache
and memory-maps the tensor bytes with numpy, which takes a fraction of a second.

Before either, `check_extents` walks the header alone (~40 ms for Gemma 3) and compares the end
of the tensor data it declares with the file's size, so a truncated or damaged file is named in
one line at once rather than after the reader's full parse. It runs on a cache hit too: the
cache key (path, size, mtime) already changes when the file does, and the check costs little.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import struct
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


# ---- header-only layout: a damaged file is named in well under a second ---------------------
#
# Why a hand parse: the `gguf` package (0.19) has no header-only mode. `GGUFReader.__init__`
# builds a ReaderField (numpy views, Python lists) for every metadata entry and every element of
# the vocabulary arrays before it reaches the tensor infos, ~8 s for Gemma 3's 262k tokens, and
# on a truncated file it fails only after that, with a bare ValueError about a reshape. The walk
# below only steps over the metadata (a string is skipped by its length, a numeric array by its
# count times the element size from the library's own scalar table) and reads just the tensor
# infos, whose byte sizes come from `gguf.GGML_QUANT_SIZES`.

MAX_DIMS = 4  # GGML_MAX_DIMS: a tensor info claiming more is damage, not a bigger tensor


@dataclass(frozen=True)
class GGUFLayout:
    """Where a GGUF file's parts lie, read from its header alone."""

    version: int
    num_tensors: int
    num_kv: int
    alignment: int
    header_end: int  # end of the last tensor info
    data_offset: int  # first byte of the tensor data (header_end rounded up to the alignment)
    data_end: int  # end of the tensor data that ends last: the least size the file can have
    last_tensor: str  # the tensor whose data ends at data_end ("" when there are none)


class _HeaderCut(Exception):
    """The file ended inside its header."""


class _HeaderDamage(Exception):
    """A header field holds a value no GGUF writer produces."""


class _Cursor:
    """Reads little- or big-endian fields from a byte buffer; running off its end is _HeaderCut."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos, self.end = buf, order, 0, len(buf)
        self._u64 = struct.Struct(order + "Q").unpack_from

    def take(self, fmt: str) -> tuple:
        s = struct.Struct(self.order + fmt)
        if self.pos + s.size > self.end:
            raise _HeaderCut
        out = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return out

    def skip(self, n: int) -> None:
        if n > self.end - self.pos:
            raise _HeaderCut
        self.pos += n

    def string(self) -> bytes:
        (n,) = self.take("Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos])

    def skip_strings(self, count: int) -> None:
        # each string is at least its 8-byte length: a count that cannot fit is damage, and
        # refusing it here keeps a garbage count from running this loop for long
        if count > (self.end - self.pos) // 8:
            raise _HeaderCut
        pos, end, u64 = self.pos, self.end, self._u64
        for _ in range(count):
            if pos + 8 > end:
                raise _HeaderCut
            pos += 8 + u64(self.buf, pos)[0]
        if pos > end:
            raise _HeaderCut
        self.pos = pos


def _skip_value(cur: _Cursor, vtype: int, key: str) -> None:
    import gguf

    VT = gguf.GGUFValueType
    scalar = gguf.GGUFReader.gguf_scalar_to_np
    if vtype == VT.STRING:
        cur.skip_strings(1)
    elif vtype == VT.ARRAY:
        sub, count = cur.take("IQ")
        if sub == VT.STRING:
            cur.skip_strings(count)
        elif sub == VT.ARRAY:
            if count > (cur.end - cur.pos) // 12:  # each inner array is at least its type and count
                raise _HeaderCut
            for _ in range(count):
                _skip_value(cur, VT.ARRAY, key)
        elif sub in scalar.keys():
            cur.skip(count * np.dtype(scalar[VT(sub)]).itemsize)
        else:
            raise _HeaderDamage(f"metadata {key!r} is an array of unknown value type {sub}")
    elif vtype in scalar.keys():
        cur.skip(np.dtype(scalar[VT(vtype)]).itemsize)
    else:
        raise _HeaderDamage(f"metadata {key!r} has unknown value type {vtype}")


def read_layout(path: Path) -> GGUFLayout:
    """The file's layout from its header; WorkbenchError (one line) if the header is cut or bad.

    Reads only the header's bytes (through a memory map), never the tensor data."""
    import mmap

    import gguf
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    size = path.stat().st_size
    if size < 4:
        raise WorkbenchError(f"{path} is not a GGUF file (it has {size} bytes; a GGUF file starts with b'GGUF')")
    where = "the version and counts"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise WorkbenchError(
                f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, a GGUF file starts with b'GGUF')"
            )
        try:
            cur = _Cursor(buf, "<")
            cur.skip(4)
            (version,) = cur.take("I")
            if version & 0xFFFF == 0:  # written on a big-endian host (the reader's test, too)
                cur = _Cursor(buf, ">")
                cur.skip(4)
                (version,) = cur.take("I")
            if version not in READER_SUPPORTED_VERSIONS:
                allowed = ", ".join(map(str, READER_SUPPORTED_VERSIONS))
                raise WorkbenchError(f"{path} is GGUF version {version}, which is not supported; supported: {allowed}")
            num_tensors, num_kv = cur.take("QQ")
            alignment = gguf.GGUF_DEFAULT_ALIGNMENT
            for i in range(num_kv):
                where = f"metadata entry {i + 1} of {num_kv}"
                key = cur.string().decode("utf-8", errors="replace")
                where += f" ({key})"
                (vtype,) = cur.take("I")
                if key == gguf.Keys.General.ALIGNMENT:
                    if vtype != gguf.GGUFValueType.UINT32:
                        raise _HeaderDamage(f"{key} has value type {vtype}, must be UINT32")
                    (alignment,) = cur.take("I")
                    if alignment == 0 or alignment & (alignment - 1):
                        raise _HeaderDamage(f"{key} is {alignment}, must be a power of two")
                else:
                    _skip_value(cur, vtype, key)
            extents = []  # (name, offset relative to the data, bytes)
            for i in range(num_tensors):
                where = f"tensor info {i + 1} of {num_tensors}"
                name = cur.string().decode("utf-8", errors="replace")
                where += f" ({name})"
                (n_dims,) = cur.take("I")
                if n_dims > MAX_DIMS:
                    raise _HeaderDamage(f"tensor {name} claims {n_dims} dimensions, at most {MAX_DIMS}")
                dims = cur.take("Q" * n_dims)
                qtype, offset = cur.take("IQ")
                if qtype not in gguf.GGML_QUANT_SIZES.keys():
                    raise _HeaderDamage(f"tensor {name} has unknown tensor type {qtype}")
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
                if dims and dims[0] % block:
                    raise _HeaderDamage(f"tensor {name}'s rows of {dims[0]} are not whole {block}-element blocks")
                extents.append((name, offset, math.prod(dims) // block * type_size))
        except _HeaderCut:
            raise WorkbenchError(
                f"{path} is truncated or damaged: its GGUF header runs past the end of the file's {size:,} bytes "
                f"(in {where})"
            ) from None
        except _HeaderDamage as e:
            raise WorkbenchError(f"{path} is damaged: {e} (in {where}, byte {cur.pos:,})") from None
    data_offset = -(-cur.pos // alignment) * alignment
    last, data_end = "", data_offset
    for name, offset, nbytes in extents:
        if data_offset + offset + nbytes > data_end:
            last, data_end = name, data_offset + offset + nbytes
    return GGUFLayout(version, num_tensors, num_kv, alignment, cur.pos, data_offset, data_end, last)


def check_extents(path: Path) -> GGUFLayout:
    """`read_layout`, then WorkbenchError (one line) if the file is missing, not a file, or
    shorter than its tensor data."""
    if not path.exists():
        raise WorkbenchError(f"model file not found: {path} (pass --model PATH to a .gguf file)")
    if not path.is_file():
        raise WorkbenchError(f"model path is not a file: {path} (pass --model PATH to a .gguf file)")
    layout = read_layout(path)
    size = path.stat().st_size
    if size < layout.data_end:
        raise WorkbenchError(
            f"{path} is truncated: it has {size:,} bytes, but its header places tensor data up to byte "
            f"{layout.data_end:,} ({layout.data_end - size:,} bytes missing; tensor {layout.last_tensor} ends there)"
        )
    return layout


def _check_header(path: Path) -> tuple[int, int]:
    """(size, mtime_ns), once the file is known to be a GGUF file that holds all its tensor data."""
    check_extents(path)
    st = path.stat()
    return st.st_size, st.st_mtime_ns


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
    def open(cls, path: "str | os.PathLike | GGUFFile", use_cache: bool = True) -> "GGUFFile":
        """The file at `path`, its header checked first (`check_extents`). An open GGUFFile is
        returned as it is, so a caller that opened the file early (the CLI, to name a damaged
        file before torch is imported) hands it to `load_model` without a second header walk."""
        if isinstance(path, GGUFFile):
            return path
        path = Path(path).expanduser().resolve()
        size, mtime_ns = _check_header(path)
        key = hashlib.sha1(f"{CACHE_FORMAT}|{path}|{size}|{mtime_ns}".encode()).hexdigest()
        cfile = cache_dir() / "gguf" / f"{key}.pkl"
        # A changed file has a new size or mtime, hence a new key: a stale index is never read.
        # What a cache file holds is checked against the file as well, and rebuilt if it differs.
        if use_cache and cfile.exists():
            try:
                with open(cfile, "rb") as f:
                    index = pickle.load(f)
                if isinstance(index, GGUFIndex) and index.path == str(path) and index.size == size:
                    return cls(index)
            except Exception:
                pass  # a damaged cache file is rebuilt below
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
