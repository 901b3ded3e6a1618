"""Damaged GGUF files are named at once, in one line, from a header-only walk (gguf_file.check_extents)."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.gguf_file import GGUFFile, check_extents, read_layout

# The header check's own time must be far under the 2 s the issue asks for; the bound is loose
# so that a loaded CI machine does not flake (measured: ~40 ms for the real model).
CHECK_LIMIT_S = 5.0


def _reader_extents(path: Path) -> tuple[int, int]:
    """(data offset, end of the last tensor's data) as the gguf package's full reader sees them."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return int(r.data_offset), max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)


def _cut(src: Path, dst: Path, n: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n))
    return dst


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "arch, weight_type, kw",
    [("llama", "Q8_0", {}), ("gemma3", "Q4_0", {}), ("llama", "F16", {}), ("gemma3", "Q5_0", {"n_layers": 3})],
)
def test_layout_agrees_with_the_full_reader(tiny_gguf, arch, weight_type, kw):
    p = tiny_gguf(arch, weight_type, **kw)
    layout = check_extents(p)
    assert (layout.data_offset, layout.data_end) == _reader_extents(p)
    assert layout.version == 3 and layout.alignment == 32
    assert layout.data_end <= p.stat().st_size


def test_custom_alignment_is_read(tmp_path):
    import gguf
    import numpy as np

    p = tmp_path / "aligned.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_custom_alignment(256)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"] * 50)
    w.add_tensor("a.weight", np.arange(96, dtype=np.float32))
    w.add_tensor("b.weight", np.ones((3, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    layout = read_layout(p)
    assert layout.alignment == 256 and layout.data_offset % 256 == 0
    assert (layout.data_offset, layout.data_end) == _reader_extents(p)
    assert layout.last_tensor == "b.weight"

    # the same file with general.alignment patched to 48: not a power of two
    raw = bytearray(p.read_bytes())
    key = b"general.alignment"
    at = raw.index(key) + len(key) + 4  # after the key, its u32 value type, then the value
    assert struct.unpack_from("<I", raw, at)[0] == 256
    struct.pack_into("<I", raw, at, 48)
    bad = tmp_path / "align48.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(WorkbenchError) as e:
        GGUFFile.open(bad)
    assert re.fullmatch(rf"{re.escape(str(bad))} is damaged: general\.alignment is 48, must be a power of two \(.*\)", _one_line(e))


@pytest.mark.real_model
def test_real_model_truncated_to_10_mb(tmp_path):
    from workbench.default_model import default_model_path
    from workbench.model import load_model

    real = default_model_path()
    size = real.stat().st_size
    layout = check_extents(real)
    assert layout.data_end == size  # its last tensor ends exactly at the end of the file
    assert layout.num_tensors == 236 and layout.data_offset > 6_000_000  # (the 262k-token vocabulary)

    cut = _cut(real, tmp_path / "truncated.gguf", 10_000_000)
    t0 = time.perf_counter()
    with pytest.raises(WorkbenchError) as e:
        GGUFFile.open(cut)
    took = time.perf_counter() - t0
    msg = _one_line(e)
    assert msg == (
        f"{cut} is truncated: it has 10,000,000 bytes, but its header places tensor data up to byte "
        f"{size:,} ({size - 10_000_000:,} bytes missing; tensor {layout.last_tensor} ends there)"
    )
    assert took < CHECK_LIMIT_S, took
    print(f"\nheader check on the 10 MB copy: {took * 1e3:.0f} ms")

    # the load path reports the same, before any tensor is touched
    with pytest.raises(WorkbenchError, match=r"is truncated: it has 10,000,000 bytes"):
        load_model(cut)

    # cut inside the header (in the vocabulary's strings)
    head = _cut(real, tmp_path / "head.gguf", 1_000_000)
    with pytest.raises(WorkbenchError) as e:
        GGUFFile.open(head)
    assert re.fullmatch(
        rf"{re.escape(str(head))} is truncated or damaged: its GGUF header runs past the end of the file's 1,000,000 bytes "
        r"\(in metadata entry \d+ of 33 \(tokenizer\.ggml\.tokens\)\)",
        _one_line(e),
    )


def test_synthetic_cut_at_every_kind_of_place(tiny_gguf, tmp_path):
    src = tiny_gguf("gemma3", "Q8_0")
    size = src.stat().st_size
    layout = check_extents(src)
    data_cuts = {"one byte short": layout.data_end - 1, "half the data": (layout.data_offset + layout.data_end) // 2,
                 "no data at all": layout.data_offset}
    for what, n in data_cuts.items():
        p = _cut(src, tmp_path / f"data-{n}.gguf", n)
        t0 = time.perf_counter()
        with pytest.raises(WorkbenchError) as e:
            GGUFFile.open(p)
        assert time.perf_counter() - t0 < CHECK_LIMIT_S
        assert _one_line(e) == (
            f"{p} is truncated: it has {n:,} bytes, but its header places tensor data up to byte "
            f"{layout.data_end:,} ({layout.data_end - n:,} bytes missing; tensor {layout.last_tensor} ends there)"
        ), what
    # inside the header: the counts, the metadata (a key, a value, the token strings), the tensor infos
    raw = src.read_bytes()
    header_cuts = {
        "counts": (20, r"the version and counts"),
        "tokens": (raw.index(b"<0x41>") + 2, r"metadata entry \d+ of \d+ \(tokenizer\.ggml\.tokens\)"),
        "tensor infos": (raw.index(b"blk.0.attn_q.weight") + 5, r"tensor info \d+ of \d+"),
        "last header byte": (layout.header_end - 1, r"tensor info \d+ of \d+ \(.*\)"),
    }
    for what, (n, where) in header_cuts.items():
        p = _cut(src, tmp_path / f"head-{n}.gguf", n)
        with pytest.raises(WorkbenchError) as e:
            GGUFFile.open(p)
        assert re.fullmatch(
            rf"{re.escape(str(p))} is truncated or damaged: its GGUF header runs past the end of the file's {n:,} bytes \(in ({where})\)",
            _one_line(e),
        ), (what, str(e.value))
    assert size >= layout.data_end
    GGUFFile.open(src)  # the whole file still opens


def test_bad_magic_version_and_counts(tiny_gguf, tmp_path):
    raw = bytearray(tiny_gguf("llama", "Q8_0").read_bytes())

    def damaged(name: str, patch) -> Path:
        b = bytearray(raw)
        patch(b)
        p = tmp_path / name
        p.write_bytes(bytes(b))
        return p

    cases = {
        "magic": (lambda b: b.__setitem__(slice(0, 4), b"GGML"), r"is not a GGUF file \(it starts with b'GGML', a GGUF file starts with b'GGUF'\)"),
        "version": (lambda b: struct.pack_into("<I", b, 4, 99), r"is GGUF version 99, which is not supported; supported: 2, 3"),
        # a garbage metadata count: the walk gives up at the first entry that cannot fit
        "kv count": (lambda b: struct.pack_into("<Q", b, 16, 1 << 62), r"is (truncated or damaged|damaged): .*\(in metadata entry \d+ of 4611686018427387904\b.*"),
        # a garbage string length in the first key
        "key length": (lambda b: struct.pack_into("<Q", b, 24, 1 << 40), r"is truncated or damaged: its GGUF header runs past the end of the file's [\d,]+ bytes \(in metadata entry 1 of \d+\)"),
        "value type": (lambda b: struct.pack_into("<I", b, 32 + struct.unpack_from("<Q", b, 24)[0], 77),
                       r"is damaged: metadata '.*' has unknown value type 77 \(in metadata entry 1 of \d+ \(.*\), byte [\d,]+\)"),
    }
    for name, (patch, pattern) in cases.items():
        p = damaged(f"{name.replace(' ', '-')}.gguf", patch)
        t0 = time.perf_counter()
        with pytest.raises(WorkbenchError) as e:
            GGUFFile.open(p)
        assert time.perf_counter() - t0 < CHECK_LIMIT_S, name
        assert re.fullmatch(re.escape(str(p)) + " " + pattern, _one_line(e)), (name, str(e.value))

    # an unknown tensor type in the first tensor info: name, n_dims, dims, then the type
    name = b"token_embd.weight"
    at = raw.index(name) + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    p = damaged("qtype.gguf", lambda b: struct.pack_into("<I", b, at + 4 + 8 * n_dims, 1234))
    with pytest.raises(WorkbenchError) as e:
        GGUFFile.open(p)
    assert re.fullmatch(rf"{re.escape(str(p))} is damaged: tensor token_embd\.weight has unknown tensor type 1234 \(.*\)", _one_line(e))

    for tiny in (b"", b"GG"):
        p = tmp_path / f"tiny{len(tiny)}.gguf"
        p.write_bytes(tiny)
        with pytest.raises(WorkbenchError, match=rf"is not a GGUF file \(it has {len(tiny)} bytes"):
            GGUFFile.open(p)


def test_start_up_cache_never_serves_a_changed_file(tmp_path):
    from workbench.synthetic import SyntheticSpec, write_random_gguf

    p = write_random_gguf(tmp_path / "m.gguf", SyntheticSpec(seed=1))
    first = GGUFFile.open(p).index.sha256
    assert GGUFFile.open(p).index.sha256 == first  # (served by the cache)

    # the same size, other bytes, a later mtime: a fresh parse
    other = write_random_gguf(tmp_path / "other.gguf", SyntheticSpec(seed=2))
    assert other.stat().st_size == p.stat().st_size
    st = p.stat()
    shutil.copyfile(other, p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert GGUFFile.open(p).index.sha256 not in (first, None)

    # truncated in place, its mtime put back: the size alone changes the key, and the check runs first
    st = p.stat()
    with open(p, "r+b") as f:
        f.truncate(st.st_size - 100)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(WorkbenchError, match="is truncated: it has"):
        GGUFFile.open(p)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", [["info"], ["generate", "x"]])
def test_cli_names_a_truncated_file_in_one_line(tiny_gguf, tmp_path, command):
    src = tiny_gguf("llama", "Q8_0")
    p = _cut(src, tmp_path / "truncated.gguf", src.stat().st_size // 2)
    r = _cli(command[0], "--model", str(p), *command[1:])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"workbench: error: {p} is truncated: it has "), r.stderr


def test_generate_names_a_damaged_or_missing_model_before_loading(tmp_path):
    """`workbench generate --model` checks the file before torch is imported: one line, exit 2."""
    import subprocess
    import sys

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8)
    for path, words in ((cut, "truncated"), (tmp_path / "missing.gguf", "not found"), (tmp_path, "not a file")):
        p = subprocess.run([sys.executable, "-m", "workbench", "generate", "--model", str(path), "hi"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in p.stderr, p.stderr
