"""llama.cpp's single-sequence decode speed on this CPU: the reference our CPU path is measured against.

Runs in the separate llama.cpp venv (see scripts/goldens_llamacpp.py for how it is built), which
also needs polars:

    /opt/llamaenv/bin/pip install polars
    /opt/llamaenv/bin/python scripts/bench_llamacpp_cpu.py [--repeats 3] [--gen 128] [--threads 2]

Do not run it under `nice` or beside other heavy work: it measures the machine.

One sequence: a ~32-token prompt is prefilled in one batch, then 128 tokens are generated greedily
(argmax of the last logits), one `llama_decode` per token. Prefill and decode are timed
separately; each repeat starts from an empty KV cache. Weight repacking is off
(`use_extra_bufts=False`), because the sdist build crashes on this CPU for multi-token batches with
it on; the column `use_extra_bufts` records that.

Writes data/reference/llamacpp_cpu.parquet atomically, one row per repeat: engine, model_sha256,
threads, prompt_tokens, gen_tokens, decode_tok_s, prefill_tok_s, cpu_model, repeat,
llama_cpp_python_version, use_extra_bufts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goldens_llamacpp import model_path, sha256_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "reference" / "llamacpp_cpu.parquet"
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "The story should be warm, a little mysterious, and end"
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def load(path: str, threads: int):
    import llama_cpp
    import llama_cpp.llama_cpp as lowlevel

    real_default = lowlevel.llama_model_default_params

    def no_repack():
        p = real_default()
        p.use_extra_bufts = False
        return p

    lowlevel.llama_model_default_params = no_repack
    try:
        llm = llama_cpp.Llama(
            model_path=path, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
        )
    finally:
        lowlevel.llama_model_default_params = real_default
    assert llm.model_params.use_extra_bufts is False
    return llm


def run_once(llm, prompt_ids: list[int], gen: int) -> tuple[float, float, list[int]]:
    import llama_cpp

    n_vocab = llm.n_vocab()
    llm.reset()  # eval() then drops every cached position from 0 on

    def last_logits() -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    t0 = time.perf_counter()
    llm.eval(prompt_ids)
    nxt = int(np.argmax(last_logits()))
    t1 = time.perf_counter()
    out = [nxt]
    for _ in range(gen - 1):
        llm.eval([nxt])
        nxt = int(np.argmax(last_logits()))
        out.append(nxt)
    t2 = time.perf_counter()
    # The first generated token comes from the prefill; the decode steps make the other gen-1.
    return len(prompt_ids) / (t1 - t0), (gen - 1) / (t2 - t1), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import llama_cpp
    import polars as pl

    path = model_path()
    sha = sha256_file(path)
    llm = load(path, args.threads)
    prompt_ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    run_once(llm, prompt_ids, 8)  # warm-up: page in the weights, size the buffers

    rows, first = [], None
    for r in range(args.repeats):
        prefill, decode, out = run_once(llm, prompt_ids, args.gen)
        first = first or out
        assert out == first, "greedy decoding differed between repeats"
        rows.append(
            {
                "engine": "llama.cpp",
                "model_sha256": sha,
                "threads": args.threads,
                "prompt_tokens": len(prompt_ids),
                "gen_tokens": args.gen,
                "decode_tok_s": decode,
                "prefill_tok_s": prefill,
                "cpu_model": cpu_model(),
                "repeat": r,
                "llama_cpp_python_version": llama_cpp.__version__,
                "use_extra_bufts": False,
            }
        )
        print(f"repeat {r}: prefill {prefill:7.1f} tok/s  decode {decode:6.2f} tok/s")
    print(f"median decode {statistics.median(x['decode_tok_s'] for x in rows):.2f} tok/s")
    print("greedy continuation:", repr(llm.detokenize(first).decode("utf-8", "replace")[:120]))

    df = pl.DataFrame(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=OUT.parent, prefix=f".{OUT.name}.", suffix=".tmp")
    os.close(fd)
    try:
        df.write_parquet(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, OUT)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print("wrote", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
