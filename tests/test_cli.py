"""The CLI: bad input ends with one line naming the problem, exit code 2, no traceback."""

import subprocess
import sys

import pytest


def run(*args, env_cache=None):
    import os

    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_missing_file(tmp_path):
    one_line_error(run("info", "--model", str(tmp_path / "missing.gguf")), "not found")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello")
    one_line_error(run("generate", "hi", "--model", str(p)), "not a GGUF file")


def test_truncated(tiny_gguf, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_gguf("llama").read_bytes()[:5000])
    one_line_error(run("generate", "hi", "--model", str(p)), "truncated")


def test_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    w.add_tensor("x", np.ones(32, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    one_line_error(run("info", "--model", str(tmp_path / "rwkv.gguf")), "'rwkv6' is not supported", "gemma3, llama")


def test_unsupported_quant_type(q2k_gguf):
    one_line_error(run("generate", "hi", "--model", str(q2k_gguf)), "quant type Q2_K, which is not supported", "Q8_0")


def test_prompt_longer_than_context(tiny_gguf):
    path = tiny_gguf("llama", "Q8_0", context_length=64)
    one_line_error(run("generate", "the " * 100, "--model", str(path)), "does not fit the context of 64")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-tokens", "abc"], "'abc' is not a number"),
        (["--max-tokens", "0"], "0 is out of range: allowed an integer 1..1000000"),
        (["--temperature", "-1"], "out of range: allowed 0.0..100.0"),
        (["--top-p", "2"], "out of range"),
        (["--dtype", "fp8"], "invalid choice"),
    ],
)
def test_bad_options(args, needle):
    one_line_error(run("generate", "hi", *args), needle)


def test_generate_streams_and_reports(tiny_gguf):
    p = run("generate", "the slot", "--model", str(tiny_gguf("llama")), "--max-tokens", "5")
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert "prompt" in last and "prefill" in last and "decode" in last and "tok/s" in last


def test_info(tiny_gguf):
    p = run("info", "--model", str(tiny_gguf("gemma3")))
    assert p.returncode == 0, p.stderr
    for needle in ("architecture  gemma3", "sha256", "quant types per tensor group", "Q8_0", "context"):
        assert needle in p.stdout


def test_bench_head_matmul_needs_the_triton_backend(tiny_gguf, tmp_path):
    """--head-matmul is the triton backend's: with the torch backend one line, exit 2, no run
    written."""
    one_line_error(run("bench", "--model", str(tiny_gguf("gemma3")), "--head-matmul", "q8i8", "--concurrency", "1",
                       "--prompt-len", "4", "--gen", "2", "--data-dir", str(tmp_path)),
                   "head_matmul='q8i8' is the triton backend's")
    assert not list(tmp_path.rglob("*.parquet"))
