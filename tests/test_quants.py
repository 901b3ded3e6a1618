"""workbench.quants: bit-exact with gguf.quants.dequantize, row gathers, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
import gguf

from workbench import quants
from workbench.errors import WorkbenchError
from workbench.quants import SUPPORTED, bytes_per_row, dequantize, dequantize_rows

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_K, T.Q6_K]

# Byte offsets of each block's fp16 fields, overwritten with finite values in random blocks.
FP16_FIELDS = {
    T.Q8_0: [quants.Q8_0_D],
    T.Q4_0: [quants.Q4_0_D],
    T.Q5_0: [quants.Q5_0_D],
    T.Q4_K: [quants.Q4_K_D, quants.Q4_K_DMIN],
    T.Q6_K: [quants.Q6_K_D],
}


def finite_half_bits(rng: np.random.Generator, n: int, *, exp_mask: int) -> np.ndarray:
    """Random 16-bit patterns (incl. subnormals and -0) whose exponent field is not all ones."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    inf_nan = (bits & exp_mask) == exp_mask
    bits[inf_nan] &= 0xBFFF  # clear the exponent's top bit
    return bits


def random_raw(qtype: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random stored bytes for a tensor of `shape`, as uint8 [rows..., bytes_per_row]."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if qtype == T.F32:
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
        x[:: max(1, n // 5)] = -0.0
        raw = x.view(np.uint8)
    elif qtype == T.F16:
        raw = finite_half_bits(rng, n, exp_mask=0x7C00).view(np.uint8)
    elif qtype == T.BF16:
        raw = finite_half_bits(rng, n, exp_mask=0x7F80).view(np.uint8)
    else:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_blocks = n // block
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for off in FP16_FIELDS[qtype]:
            raw[:, off : off + 2] = (
                finite_half_bits(rng, n_blocks, exp_mask=0x7C00).view(np.uint8).reshape(-1, 2)
            )
    assert raw.any()
    return raw.reshape(*shape[:-1], bytes_per_row(qtype, shape[-1]))


def reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and want.dtype == torch.float32
    assert got.shape == want.shape, (got.shape, want.shape)
    # Compare bit patterns: stricter than torch.equal (tells -0.0 from +0.0).
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got, want)


def shapes_for(qtype: T) -> list[tuple[int, ...]]:
    block = GGML_QUANT_SIZES[qtype][0]
    cols = max(block, 32)
    return [(1, cols), (3, 2 * cols), (7, cols), (2, 3, cols), (cols,)]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bit_exact_random_bytes(qtype):
    for i, shape in enumerate(shapes_for(qtype)):
        raw = random_raw(qtype, shape, seed=1000 * int(qtype) + i)
        want = reference(raw, qtype).reshape(shape)
        assert_bitwise_equal(dequantize(raw, qtype, shape), want)
        # torch input, and a flat buffer, give the same
        assert_bitwise_equal(dequantize(torch.from_numpy(raw.copy()), qtype, shape), want)
        assert_bitwise_equal(dequantize(raw.reshape(-1), qtype, list(shape)), want)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_0, T.BF16], ids=lambda t: t.name)
def test_bit_exact_quantized_floats(qtype):
    rng = np.random.default_rng(int(qtype))
    for rows in (1, 5, 9):
        x = (rng.standard_normal((rows, 96)) * rng.uniform(0.01, 100)).astype(np.float32)
        raw = gguf.quants.quantize(x, qtype)
        want = reference(raw, qtype)
        got = dequantize(raw, qtype, (rows, 96))
        assert_bitwise_equal(got, want)
        assert torch.allclose(got, torch.from_numpy(x), rtol=0.2, atol=0.2 * np.abs(x).max())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_matches_full(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    rows, cols = 11, 2 * max(block, 32)
    raw = random_raw(qtype, (rows, cols), seed=7 + int(qtype))
    full = dequantize(raw, qtype, (rows, cols))
    for ids in ([0], [10, 3, 3, 0, 7], torch.tensor([[1, 2], [9, 4]]), np.array([5]), []):
        idx = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        got = dequantize_rows(raw, qtype, ids, cols)
        assert got.shape == (idx.numel(), cols)
        assert_bitwise_equal(got, full[idx])
    assert_bitwise_equal(dequantize_rows(raw, qtype, slice(2, 9, 3), cols), full[2:9:3])
    assert_bitwise_equal(dequantize_rows(torch.from_numpy(raw), qtype, [4], cols), full[4:5])
    assert_bitwise_equal(dequantize_rows(raw, qtype, 6, cols), full[6:7])


def test_reads_gguf_file_in_torch_order(tmp_path):
    """GGUFReader's tensor.data with ne reversed is the torch shape; memmaps are read-only."""
    rows, cols = 5, 512
    specs = {"q8": T.Q8_0, "q4k": T.Q4_K, "q6k": T.Q6_K, "q5": T.Q5_0}
    raws = {name: random_raw(qt, (rows, cols), seed=i) for i, (name, qt) in enumerate(specs.items())}
    f16 = np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float16)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    for name, qt in specs.items():
        w.add_tensor(name, raws[name], raw_dtype=qt)
    w.add_tensor("f16", f16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        assert [int(s) for s in t.shape] == [cols, rows]  # GGUF ne order
        shape = tuple(int(s) for s in reversed(t.shape))
        got = dequantize(t.data, t.tensor_type, shape)
        assert_bitwise_equal(got, reference(np.asarray(t.data), t.tensor_type).reshape(shape))
        if t.name == "f16":
            assert torch.equal(got, torch.from_numpy(f16.astype(np.float32)))
        table = t.data.view(np.uint8).reshape(rows, -1)
        assert_bitwise_equal(dequantize_rows(table, t.tensor_type, [4, 0], cols), got[[4, 0]])
        got.add_(1.0)  # the result does not alias the read-only memmap


def test_bytes_per_row():
    assert bytes_per_row(T.Q8_0, 640) == 20 * 34
    assert bytes_per_row(T.Q4_K, 512) == 2 * 144
    assert bytes_per_row(T.Q6_K, 256) == 210
    assert bytes_per_row(T.F32, 3) == 12
    assert bytes_per_row(T.BF16, 5) == 10
    with pytest.raises(WorkbenchError, match="multiple of the Q4_K block size 256"):
        bytes_per_row(T.Q4_K, 640)


def test_unsupported_type_names_supported_ones():
    assert SUPPORTED == frozenset(ALL_TYPES)
    for bad in (T.Q2_K, T.IQ2_XXS, T.Q5_K):
        with pytest.raises(WorkbenchError) as exc:
            dequantize(np.zeros(1000, np.uint8), bad, (1, 256))
        msg = str(exc.value)
        assert bad.name in msg and "\n" not in msg
        for t in ALL_TYPES:
            assert t.name in msg
        with pytest.raises(WorkbenchError, match=bad.name):
            dequantize_rows(np.zeros((1, 1000), np.uint8), bad, [0], 256)
        with pytest.raises(WorkbenchError, match=bad.name):
            bytes_per_row(bad, 256)
    with pytest.raises(WorkbenchError, match="Q8_0"):
        dequantize(np.zeros(4, np.uint8), 12345, (1, 1))


def test_wrong_byte_count_raises():
    raw = random_raw(T.Q8_0, (2, 64), seed=0)
    with pytest.raises(WorkbenchError, match="needs 136 bytes, got 102"):
        dequantize(raw.reshape(-1)[:102], T.Q8_0, (2, 64))
    with pytest.raises(WorkbenchError, match="whole number of rows"):
        dequantize_rows(raw.reshape(-1)[:100], T.Q8_0, [0], 64)
