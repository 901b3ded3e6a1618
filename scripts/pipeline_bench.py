"""The pipeline's mechanism on the device, without the real model (SpecConfig.pipeline): C slots
of random prompts, drafts scripted from a plain run's own tokens with one draft token wrong at a
set place (so acceptance is under control and the model's text does not matter: random weights
in Gemma 3 270M's layer shapes do), the guard off. Three engines on the Triton runner, timed in
turn after a warm-up pass each: AR (plain decoding, run ahead), speculation in whole steps, and
the pipeline (the slots' halves verifying in turn). Per pass: decode goodput, steps, verify
steps, half steps, the median wall ms of whole and half verify steps; every pass's tokens must
be AR's (exit 1 otherwise). Reads the engines' step records as dicts (no polars: the device
image lacks it); writes one JSON of every pass under --out.

    python3 scripts/pipeline_bench.py --shapes gemma3-270m --slots 16 --k 8 --kept 7 --out /tmp/out
    python3 scripts/pipeline_bench.py --model model.gguf ...   (any GGUF; the drafts stay scripted)
    python3 scripts/pipeline_bench.py --dry-run   (a tiny random model under the interpreter)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Scripted:
    """A proposer (workbench.spec.Proposer's interface) that drafts the recorded plain run's next
    tokens, the one at draft index `kept` made wrong: each full draft keeps `kept` tokens."""

    name = "scripted"

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], kept: int, vocab: int):
        self.outputs, self.kept, self.vocab = outputs, kept, vocab
        self.prompts: dict = {}

    def start(self, rid, prompt_ids):
        self.prompts[rid] = tuple(prompt_ids)

    def propose(self, rid, context, k):
        p = self.prompts[rid]
        done = len(context) - len(p)
        d = list(self.outputs[p][done : done + k])
        if self.kept < len(d):
            d[self.kept] = (d[self.kept] + 1) % self.vocab
        return tuple(d)

    def finish(self, rid, context, num_prompt):
        self.prompts.pop(rid, None)


def _pass(engine, prompts, gen: int, tag: str) -> dict:
    first = len(engine.telemetry.step_records)
    t0 = time.perf_counter()
    hs = [engine.submit(p, max_tokens=gen, request_id=f"{tag}-{i}", index=i, ignore_eos=True)
          for i, p in enumerate(prompts)]
    engine.run_until_done()
    wall = time.perf_counter() - t0
    steps = engine.telemetry.step_records[first:]
    decode = [s for s in steps if s["phase"] == "decode"]
    # decode goodput: the tokens decode steps emitted over the time from the first one's start
    start = decode[0]["start_s"] if decode else 0.0
    end = max(s["start_s"] + s["wall_ms"] / 1e3 for s in steps) if steps else 0.0
    out = sum(s["tokens_out"] for s in decode)
    verify = [s for s in decode if s.get("draft_tokens")]

    def median_ms(rows):
        return statistics.median(s["wall_ms"] for s in rows) if rows else None

    return {
        "tokens": [h.result().token_ids for h in hs],
        "wall_s": wall,
        "decode_tok_s": out / (end - start) if end > start else None,
        "steps": len(steps),
        "verify_steps": len(verify),
        "half_steps": sum(1 for s in steps if s.get("pipelined")),
        "whole_verify_ms": median_ms([s for s in verify if not s.get("pipelined")]),
        "half_verify_ms": median_ms([s for s in verify if s.get("pipelined")]),
        "verify_tokens": statistics.mean(s["tokens_out"] for s in verify) if verify else None,
        "ran_ahead": sum(1 for s in steps if s.get("ran_ahead")),
        "captures": sum(s.get("graph_captures") or 0 for s in steps),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--shapes", choices=["gemma3-270m"], default=None,
                    help="instead of --model: random weights in the real model's layer shapes (Q5_0, Q8_0 V; a tiny "
                         "vocabulary, so no real head)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens a slot")
    ap.add_argument("--gen", type=int, default=256, help="tokens a request generates")
    ap.add_argument("--k", type=int, default=8, help="draft tokens a slot verifies a step")
    ap.add_argument("--kept", type=int, default=7, help="draft tokens kept of a full draft (the next is wrong)")
    ap.add_argument("--pipeline", type=int, default=8, help="SpecConfig.pipeline of the third engine")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per engine, after one untimed")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import workbench
    from workbench.engine_config import EngineConfig
    from workbench.errors import WorkbenchError
    from workbench.runners.triton_options import TritonOptions
    from workbench.spec import SpecConfig

    try:
        if min(a.slots, a.prompt, a.gen, a.passes) < 1 or not 0 <= a.kept <= a.k:
            raise WorkbenchError(f"--slots {a.slots}, --prompt {a.prompt}, --gen {a.gen}, --passes {a.passes} and "
                                 f"--kept {a.kept}: allowed positive integers, --kept 0..--k")
        spec = SpecConfig(k=a.k, guard=False, pipeline=0)  # (whole steps: "auto" would pipeline them)
        piped = replace(spec, pipeline=a.pipeline)  # (a bad --k or --pipeline: one line here)
        scratch = Path(tempfile.mkdtemp(prefix="pipeline_bench_"))  # (random models stay out of --out)
        options = TritonOptions()
        if a.dry_run:
            from workbench.synthetic import SyntheticSpec, write_random_gguf

            a.model = str(write_random_gguf(scratch / "tiny.gguf", SyntheticSpec(
                n_layers=1, n_embd=64, n_heads=2, n_kv_heads=1, head_dim=32, n_ff=128, weight_type="Q5_0")))
            a.slots, a.prompt, a.gen, a.passes = min(a.slots, 4), min(a.prompt, 12), min(a.gen, 16), 1
            a.k, a.kept = min(a.k, 3), min(a.kept, 2)
            spec, piped = replace(spec, k=a.k), replace(piped, k=a.k, pipeline=2)
            options = TritonOptions(graphs="emulate", page_size=64, attn_segment=32)
        elif a.shapes:
            from workbench.synthetic import GEMMA3_270M_SHAPES, write_random_gguf

            shapes = replace(GEMMA3_270M_SHAPES, weight_type="Q5_0", tensor_types=(("attn_v.weight", "Q8_0"),))
            a.model = str(write_random_gguf(scratch / "shapes.gguf", shapes))
        m = workbench.load_model(a.model, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    except WorkbenchError as e:
        print(f"pipeline_bench: error: {e}", file=sys.stderr)
        return 2
    V = m.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, V, (a.prompt,), generator=gen).tolist() for _ in range(a.slots)]
    base = dict(backend="triton", dtype=m.dtype_name, max_concurrency=a.slots, prefix_cache=False,
                max_context=a.prompt + a.gen + a.k + 8, triton=options)
    engines = {"ar": workbench.Engine(m, EngineConfig(**base))}
    ref = _pass(engines["ar"], prompts, a.gen, "warm")["tokens"]
    outputs = {tuple(p): r for p, r in zip(prompts, ref)}
    for tag, sc in (("spec", spec), ("pipeline", piped)):
        engines[tag] = workbench.Engine(m, EngineConfig(**base, speculation=sc),
                                        proposer=Scripted(outputs, a.kept, V))
        _pass(engines[tag], prompts, a.gen, "warm")
    rows, bad = [], []
    for r in range(a.passes):
        for tag, e in engines.items():
            got = _pass(e, prompts, a.gen, f"{tag}-{r}")
            same = got.pop("tokens") == ref
            bad += [] if same else [f"{tag} pass {r}"]
            rows.append({"engine": tag, "pass": r, "slots": a.slots, "k": a.k, "kept": a.kept,
                         "pipeline": e.config.speculation.pipeline if e.config.speculation else 0, "tokens_same": same, **got})
            ms = lambda v: "-" if v is None else f"{v:.3f}"
            print(f"{tag:>9} pass {r}: {got['decode_tok_s'] or 0:9.1f} tok/s decode, {got['steps']} steps, "
                  f"{got['verify_steps']} verify ({ms(got['whole_verify_ms'])} ms whole, {ms(got['half_verify_ms'])} "
                  f"ms half, {got['verify_tokens'] or 0:.1f} tokens), {got['half_steps']} half, "
                  f"{got['ran_ahead']} ran ahead, {got['captures']} captures, tokens {'same' if same else 'DIFFER'}",
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from workbench.atomic import atomic_write_text

    atomic_write_text(out / "pipeline_bench.json", json.dumps(rows, indent=1))
    for tag in ("spec", "pipeline"):
        ratio = statistics.median(x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(
            [x for x in rows if x["engine"] == tag], [y for y in rows if y["engine"] == "ar"]))
        print(f"{tag}: {ratio:.3f}x AR (median over passes)")
    if bad:
        print(f"pipeline_bench: tokens differ from AR in {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
