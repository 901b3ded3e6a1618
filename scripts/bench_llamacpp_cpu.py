"""llama.cpp's decode speed on this CPU, one sequence and batched: the reference our CPU path is measured against.

Runs in the separate llama.cpp venv (see scripts/goldens_llamacpp.py for how it is built), which
also needs polars:

    /opt/llamaenv/bin/pip install polars
    /opt/llamaenv/bin/python scripts/bench_llamacpp_cpu.py [--repeats 2] [--gen 128] [--threads 2]
        [--concurrency 1 2 4 8] [--batch-prompt 512] [--batch-steps 128]

Do not run it under `nice` or beside other heavy work: it measures the machine. Its figures alone
do not compare with this project's from another run (the machine drifts); scripts/compare_cpu.py
runs both engines alternately, reusing `run_once` and `Batched` from here, and reports the ratios.

mode "single" (through llama_cpp.Llama): one sequence, a ~32-token prompt is prefilled in one
batch, then --gen tokens are generated greedily (argmax of the last logits), one `llama_decode` per
token: the first token comes from the prefill, the other gen-1 from decode steps. Prefill and
decode are timed separately; each repeat starts from an empty KV cache.

mode "batched" (through the low-level API, like `llama-batched-bench`): one context with
n_seq_max = max(--concurrency), a unified KV cache (`kv_unified=True`) and
n_ctx = max(--concurrency) * (--batch-prompt + --batch-steps). For each concurrency c, c sequences
(seq_id 0..c-1) each get their own --batch-prompt-token prompt: BOS + a window of BATCH_TEXT's
tokens, the windows starting at distinct offsets spread over the text, so the prompts differ (they
overlap, but there is no shared prefix). All c prompts are prefilled in llama_decode calls of up to
n_batch tokens (logits only for each sequence's last token), then --batch-steps decode steps
follow, each one `llama_decode` of a batch holding one token for every sequence, the next token of
each being the argmax of that sequence's logits row. Only the decode steps are timed for the
decode rates (argmax included, batch filling included); the prefill has its own rate. Each run
starts from a cleared KV cache. Repeats go round all concurrencies in turn.

Weight repacking is off in both modes (`use_extra_bufts=False`), because the sdist build crashes on
this CPU for multi-token batches with it on; the column `use_extra_bufts` records that. Flash
attention is off in both (the `Llama()` default; --flash-attn changes the batched mode's).

Writes data/reference/llamacpp_cpu.parquet atomically, one row per (mode, concurrency, repeat):
engine, mode, concurrency, threads, repeat, prompt_tokens (per sequence), gen_tokens (tokens
generated per sequence, the first from the prefill), decode_steps (= gen_tokens - 1),
decode_tok_s (single mode only; null for batched rows), decode_tok_s_aggregate (all sequences'
tokens per second of decode steps), decode_tok_s_per_stream (= aggregate / concurrency),
prefill_tok_s (all sequences' prompt tokens per second of prefill), seq0_matches_single (batched:
whether sequence 0's greedy ids equal those of sequence 0 at concurrency 1 in the same repeat;
null for single rows), seq0_token_sha256 and seq_token_sha256 (sha256 of each sequence's greedy
token ids written as comma-separated decimals), seq0_token_ids, n_ctx, n_batch, n_ubatch,
n_seq_max, kv_unified, flash_attn, loadavg_1m (at the end of the run), model_sha256, cpu_model,
llama_cpp_python_version, use_extra_bufts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goldens_llamacpp import model_path, sha256_file  # noqa: E402
from llamacpp_common import open_llama  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "reference" / "llamacpp_cpu.parquet"
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "The story should be warm, a little mysterious, and end"
)

# The fixed text the batched mode's prompts are cut from (about 1,000 tokens).
BATCH_TEXT = " ".join(
    (
        "The harbour town of Keelby stands where a slow river meets a cold and restless sea. For"
        " three hundred years its people have lived by the tides, and the rhythm of the water is"
        " written into everything they do: the hours the market opens, the days the school closes,"
        " even the way the old men at the inn pause in the middle of a sentence to listen for the"
        " turn of the ebb. Visitors find this strange at first, and then, after a week or two,"
        " they begin to do it themselves without noticing.",
        "The oldest building in Keelby is not the church, as most people assume, but the tide"
        " house, a squat stone tower at the end of the north quay. Inside it, behind a door that"
        " is never locked, hangs a brass gauge as tall as a man, and beside the gauge a ledger in"
        " which the keeper writes the height of the water every hour of every day. The first"
        " entries are in a hand so cramped and faded that only the numbers can still be read. The"
        " most recent are in blue ballpoint, neat and round, and belong to a woman named Ada"
        " Marsh, who took the post when her father's eyes began to fail.",
        "Ada does not think of herself as a scientist. She left school at sixteen, worked in the"
        " fish market and then in the post office, and came to the tide house only because"
        " somebody had to. But over the years she has learned to read the ledger the way other"
        " people read a novel. She can tell from the numbers alone when a storm passed far out in"
        " the ocean, when the wind held the water back for a day, when the moon and the sun pulled"
        " together and the spring tides flooded the lower streets. Once, leafing through the"
        " entries for a winter two centuries ago, she found a week in which every reading had"
        " been crossed out and written again, and in the margin a single word: ice.",
        "Scientists from the university in the city come to see her every few years. They bring"
        " laptops and sensors and a polite impatience, and they ask whether the ledger has ever"
        " been copied. It has, Ada tells them, many times, by hand and by machine, and every copy"
        " has mistakes in it. The original has mistakes too, she says, but at least they are the"
        " honest mistakes of people who were standing in the rain at three in the morning,"
        " squinting at a wet brass scale by the light of a lamp. The scientists laugh, and write"
        " that down, and then spend the afternoon photographing the pages one by one.",
        "What the numbers show, when the scientists put them on a graph, is that the sea at Keelby"
        " is rising. Not quickly, and not evenly, but steadily, a few millimetres a year for the"
        " first two centuries and rather more than that in the last few decades. The lower"
        " streets flood more often now. The market has moved twice. The inn has a line painted on"
        " its wall, and beside the line a date, and every few winters there is a new line and a"
        " new date a little higher than the last. The old men still pause in the middle of their"
        " sentences, but now, Ada notices, they are not only listening for the turn of the tide.",
        "Ada has no plans to retire. She has trained a boy from the school, a quiet and serious"
        " child who likes numbers more than people, to take the readings when she is ill, and she"
        " has told the town council that when she is gone he is to have the key to the tide house,"
        " even though there is no lock. Every evening, after the last reading of the day, she"
        " closes the ledger, sets her pen on top of it at a careful angle, and walks home along the"
        " quay with the water on her left hand, dark and patient and always a little higher than"
        " it was. She does not find this frightening. She finds it, she says, a kind of company.",
        "In the spring the river brings down the snow from the hills, and for a few weeks the"
        " water in the harbour turns the colour of weak tea. The gulls become bold, the ferry runs"
        " late, and the children of Keelby are allowed to stay out until the lamps are lit. On the"
        " first warm evening of the year the whole town walks out along the sea wall to watch the"
        " sun go down behind the islands, and someone always asks Ada what the tide will do"
        " tonight. She always knows, and she always tells them, and they always act surprised when"
        " it does exactly that.",
    )
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


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def loadavg_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def load(path: str, threads: int):
    return open_llama(path, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads)


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


# ---------------------------------------------------------------------------------------------
# Batched mode: the low-level API, several sequences in one context.

FLASH_ATTN = {"off": "LLAMA_FLASH_ATTN_TYPE_DISABLED", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED", "auto": "LLAMA_FLASH_ATTN_TYPE_AUTO"}


class Batched:
    """A model and one context with n_seq_max sequences over a unified KV cache."""

    def __init__(self, path: str, threads: int, n_seq_max: int, n_ctx: int, n_batch: int, n_ubatch: int, flash_attn: str):
        import llama_cpp

        self.lc = llama_cpp
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch
        cp.n_seq_max = n_seq_max
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.flash_attn_type = getattr(llama_cpp, FLASH_ATTN[flash_attn])
        fields = {f[0] for f in llama_cpp.llama_context_params._fields_}
        self.kv_unified = "kv_unified" in fields
        if self.kv_unified:
            cp.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError("llama_init_from_model failed")
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.n_ubatch = llama_cpp.llama_n_ubatch(self.ctx)
        self.n_seq_max = llama_cpp.llama_n_seq_max(self.ctx)
        assert self.n_ctx >= n_ctx and self.n_seq_max >= n_seq_max, (self.n_ctx, self.n_seq_max)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"no logits for output {i}")
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def _batch(self, entries: list[tuple[int, int, int, bool]]):
        """A llama_batch of (token, pos, seq_id, wants_logits) entries."""
        b = self.lc.llama_batch_init(len(entries), 0, 1)
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(entries)
        return b

    def _decode(self, b) -> None:
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def run(self, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
        """Prefill every prompt (one sequence each), then `steps` batched decode steps.

        Returns (prefill seconds, decode seconds, each sequence's greedy ids: 1 + steps)."""
        lc = self.lc
        c = len(prompts)
        assert c <= self.n_seq_max
        assert sum(len(p) + steps for p in prompts) <= self.n_ctx
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

        flat = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        chunks = []  # (batch, [(seq, output index in that batch)]), built before the clock starts
        for start in range(0, len(flat), self.n_batch):
            part = flat[start : start + self.n_batch]
            chunks.append((self._batch(part), [(e[2], i) for i, e in enumerate(part) if e[3]]))
        step = self._batch([(0, 0, s, True) for s in range(c)])
        ids: list[list[int]] = [[] for _ in range(c)]
        try:
            t0 = time.perf_counter()
            for b, outs in chunks:
                self._decode(b)
                for s, i in outs:
                    ids[s].append(self._argmax(i))
            t1 = time.perf_counter()
            for k in range(steps):
                for s in range(c):
                    step.token[s] = ids[s][-1]
                    step.pos[s] = len(prompts[s]) + k
                self._decode(step)
                for s in range(c):
                    ids[s].append(self._argmax(s))
            t2 = time.perf_counter()
        finally:
            for b, _ in chunks:
                lc.llama_batch_free(b)
            lc.llama_batch_free(step)
        assert all(len(x) == 1 + steps for x in ids)
        return t1 - t0, t2 - t1, ids


def batch_prompts(text_ids: list[int], bos: int, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: BOS + windows of text_ids starting at distinct offsets."""
    body = length - 1
    spare = len(text_ids) - body
    if spare < n - 1:
        raise SystemExit(f"BATCH_TEXT has {len(text_ids)} tokens, too few for {n} distinct {length}-token prompts")
    stride = spare // (n - 1) if n > 1 else 0
    prompts = [[bos] + text_ids[k * stride : k * stride + body] for k in range(n)]
    assert len({tuple(p) for p in prompts}) == n
    return prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gen", type=int, default=128, help="single mode: tokens generated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 4, 8], help="batched mode; none: skip it")
    ap.add_argument("--batch-prompt", type=int, default=512, help="batched mode: prompt tokens per sequence")
    ap.add_argument("--batch-steps", type=int, default=128, help="batched mode: decode steps")
    ap.add_argument("--n-batch", type=int, default=2048, help="batched mode: n_batch (n_ubatch 512)")
    ap.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="off", help="batched mode")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    concs = sorted(set(args.concurrency))

    import llama_cpp
    import polars as pl

    path = model_path()
    sha = sha256_file(path)
    common = {
        "engine": "llama.cpp",
        "threads": args.threads,
        "model_sha256": sha,
        "cpu_model": cpu_model(),
        "llama_cpp_python_version": llama_cpp.__version__,
        "use_extra_bufts": False,
    }
    print(f"load average at start: {os.getloadavg()}")

    # --- single -------------------------------------------------------------------------------
    llm = load(path, args.threads)
    prompt_ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    text_ids = llm.tokenize(BATCH_TEXT.encode(), add_bos=False, special=False)
    bos = llm.token_bos()
    single_cfg = {
        "n_ctx": llm.context_params.n_ctx,
        "n_batch": llm.context_params.n_batch,
        "n_ubatch": llm.context_params.n_ubatch,
        "n_seq_max": llm.context_params.n_seq_max,
        "kv_unified": bool(llm.context_params.kv_unified),
        "flash_attn": "off",
    }
    run_once(llm, prompt_ids, 8)  # warm-up: page in the weights, size the buffers

    rows, first = [], None
    for r in range(args.repeats):
        prefill, decode, out = run_once(llm, prompt_ids, args.gen)
        first = first or out
        assert out == first, "greedy decoding differed between repeats"
        h = ids_sha256(out)
        rows.append(
            {
                **common,
                "mode": "single",
                "concurrency": 1,
                "repeat": r,
                "prompt_tokens": len(prompt_ids),
                "gen_tokens": args.gen,
                "decode_steps": args.gen - 1,
                "decode_tok_s": decode,
                "decode_tok_s_aggregate": decode,
                "decode_tok_s_per_stream": decode,
                "prefill_tok_s": prefill,
                "seq0_matches_single": None,
                "seq0_token_sha256": h,
                "seq_token_sha256": [h],
                "seq0_token_ids": out,
                **single_cfg,
                "loadavg_1m": loadavg_1m(),
            }
        )
        print(f"single repeat {r}: prefill {prefill:7.1f} tok/s  decode {decode:6.2f} tok/s")
    print("single greedy continuation:", repr(llm.detokenize(first).decode("utf-8", "replace")[:120]))

    # --- batched ------------------------------------------------------------------------------
    seqs: dict[tuple[int, int], list[list[int]]] = {}  # (repeat, concurrency) -> greedy ids
    if concs:
        cmax = max(concs)
        prompts = batch_prompts(text_ids, bos, cmax, args.batch_prompt)
        eng = Batched(
            path,
            args.threads,
            n_seq_max=cmax,
            n_ctx=cmax * (args.batch_prompt + args.batch_steps),
            n_batch=args.n_batch,
            n_ubatch=512,
            flash_attn=args.flash_attn,
        )
        print(
            f"batched context: n_ctx {eng.n_ctx}, n_batch {eng.n_batch}, n_ubatch {eng.n_ubatch}, "
            f"n_seq_max {eng.n_seq_max}, kv_unified {eng.kv_unified}, flash_attn {args.flash_attn}; "
            f"text {len(text_ids)} tokens"
        )
        batched_cfg = {
            "n_ctx": eng.n_ctx,
            "n_batch": eng.n_batch,
            "n_ubatch": eng.n_ubatch,
            "n_seq_max": eng.n_seq_max,
            "kv_unified": eng.kv_unified,
            "flash_attn": args.flash_attn,
        }
        try:
            eng.run([p[: min(32, len(p))] for p in prompts], 4)  # warm-up
            for r in range(args.repeats):
                for c in concs:
                    t_pre, t_dec, ids = eng.run(prompts[:c], args.batch_steps)
                    seqs[(r, c)] = ids
                    hashes = [ids_sha256(x) for x in ids]
                    ref = seqs.get((r, 1))
                    rows.append(
                        {
                            **common,
                            "mode": "batched",
                            "concurrency": c,
                            "repeat": r,
                            "prompt_tokens": args.batch_prompt,
                            "gen_tokens": args.batch_steps + 1,
                            "decode_steps": args.batch_steps,
                            "decode_tok_s": None,
                            "decode_tok_s_aggregate": c * args.batch_steps / t_dec,
                            "decode_tok_s_per_stream": args.batch_steps / t_dec,
                            "prefill_tok_s": c * args.batch_prompt / t_pre,
                            "seq0_matches_single": None if ref is None else ids[0] == ref[0],
                            "seq0_token_sha256": hashes[0],
                            "seq_token_sha256": hashes,
                            "seq0_token_ids": ids[0],
                            **batched_cfg,
                            "loadavg_1m": loadavg_1m(),
                        }
                    )
                    x = rows[-1]
                    print(
                        f"batched repeat {r} c={c}: prefill {x['prefill_tok_s']:7.1f} tok/s  decode "
                        f"{x['decode_tok_s_aggregate']:7.2f} tok/s aggregate, {x['decode_tok_s_per_stream']:6.2f} "
                        f"per stream  seq0_matches_single {x['seq0_matches_single']}  load {x['loadavg_1m']:.2f}"
                    )
        finally:
            eng.close()

    if seqs:
        last = seqs[max(seqs)]
        print(f"batched seq 0 greedy continuation (c={len(last)}):", repr(llm.detokenize(last[0]).decode("utf-8", "replace")[:120]))
    llm.close()

    # --- report ---------------------------------------------------------------------------------
    df = pl.DataFrame(rows, infer_schema_length=None)
    lead = ["engine", "mode", "concurrency", "threads", "repeat"]
    df = df.select(lead + [c for c in df.columns if c not in lead])
    table = (
        df.group_by("mode", "concurrency", maintain_order=True)
        .agg(
            pl.len().alias("repeats"),
            pl.col("decode_tok_s_aggregate").median().round(2).alias("decode_agg_tok_s"),
            pl.col("decode_tok_s_per_stream").median().round(2).alias("decode_per_stream_tok_s"),
            pl.col("prefill_tok_s").median().round(1).alias("prefill_tok_s"),
            pl.when(pl.col("seq0_matches_single").is_null().all())
            .then(None)
            .otherwise(pl.col("seq0_matches_single").all())
            .alias("seq0_matches_single"),
        )
    )
    print("\nmedians over repeats (threads=%d):" % args.threads)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table)
    if seqs:
        # Greedy outputs of a sequence across concurrencies and repeats.
        for s in range(max(concs)):
            hs = {(r, c): ids_sha256(ids[s]) for (r, c), ids in seqs.items() if s < c}
            if len(set(hs.values())) > 1:
                print(f"note: seq {s} greedy ids differ across runs: " + ", ".join(f"r{r} c{c} {h[:10]}" for (r, c), h in sorted(hs.items())))
            else:
                print(f"seq {s}: greedy ids identical in all {len(hs)} runs that hold it")

    out_path: Path = args.out
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        df.write_parquet(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
