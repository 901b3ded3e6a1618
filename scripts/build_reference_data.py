"""Build data/reference/seeds.parquet: the published numbers of the seeds, as one tidy table.

    python scripts/build_reference_data.py [--out data/reference/seeds.parquet] [--seeds-dir DIR]

One row per number. Columns:

    source         seed file name ("002_e2128ad86e2e4259.txt"), or "issue-N" for figures this
                   project measured itself and recorded in its issues
    system         the server / engine that produced the number
    hardware       the machine, one label per machine across sources (seeds 000 and 002 both ran
                   on gfx1151; details in notes); our own machines by hardware_id ("gpu:NVIDIA-H200")
    model          the model and quantization
    configuration  what was run (flags, arm of an A/B, workload), free text
    concurrency    concurrent sequences / slots / clients; null where the source does not say
    metric         decode_tok_s_aggregate, decode_tok_s_per_stream, prefill_tok_s (aggregate
                   over all concurrent prompts), ttft_s_max, ttft_s, peak_memory_gb,
                   accepted_per_step, page_in, page_out, ... (see the rows)
    stat           "value" for a single number; a range "a-b" is two rows, "min" (a) and "max" (b)
    value          the number, as published (Float64)
    unit           tok/s, s, GB, GiB, pages, tokens, %, x, ...
    notes          how it was measured, caveats

When the seeds folder is found (default: ../shared/seeds beside the repo), every number taken
from a seed is checked to appear in that seed's text, so a transcription slip fails the build.
Seed 001 is a later revision of seed 000's PR with the same table, so it adds no rows. Seed
004's results table for the fused path is not in the seed text; only its prose figures are.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "data" / "reference" / "seeds.parquet"
DEFAULT_SEEDS = REPO.parent / "shared" / "seeds"

SCHEMA = {
    "source": pl.String,
    "system": pl.String,
    "hardware": pl.String,
    "model": pl.String,
    "configuration": pl.String,
    "concurrency": pl.Int64,
    "metric": pl.String,
    "stat": pl.String,
    "value": pl.Float64,
    "unit": pl.String,
    "notes": pl.String,
}

# Which of the project's issues holds which of our own measurements (as relayed by the lead).
ISSUE_CPU_LLAMA_CPP = "issue-2"
ISSUE_H200_LLAMA_CPP = "issue-3"
ISSUE_H200_TORCH = "issue-4"


class Rows:
    """Collects rows that share source, system, hardware and model."""

    def __init__(self, out: list[dict], source: str, system: str, hardware: str, model: str) -> None:
        self.out, self.fixed = out, dict(source=source, system=system, hardware=hardware, model=model)

    def add(self, configuration, concurrency, metric, value, unit, notes="") -> None:
        """`value` is a number or a (min, max) range."""
        pairs = [("min", value[0]), ("max", value[1])] if isinstance(value, tuple) else [("value", value)]
        for stat, v in pairs:
            self.out.append(
                dict(self.fixed, configuration=configuration, concurrency=concurrency, metric=metric,
                     stat=stat, value=float(v), unit=unit, notes=notes)
            )


def seed_000(out: list[dict]) -> None:
    r = Rows(out, "000_f88e6dcca7da7c79.txt", "lucebox-hub luce_server, exact N-slot sequence engine",
             "AMD gfx1151", "Qwen3.8-Flash-Next UD-Q4_K_XL")
    base = "--max-ctx 32768, prefill chunks capped at 4,096 rows"
    note = "throughput table; 4 parallel = aggregate over the slots"
    for prompt, solo, par in (("2.3K", 1025, 1096), ("16K", 1179, 1185)):
        r.add(f"{base}; {prompt}-token prompts, 1 slot", 1, "prefill_tok_s", solo, "tok/s", note)
        r.add(f"{base}; {prompt}-token prompts, 4 parallel", 4, "prefill_tok_s", par, "tok/s", note)
    r.add(f"{base}; decode, 1 slot", 1, "decode_tok_s_aggregate", (24.7, 24.9), "tok/s", note)
    r.add(f"{base}; decode, 1 slot", 1, "decode_tok_s_per_stream", (24.7, 24.9), "tok/s",
          "one stream: per stream = aggregate")
    r.add(f"{base}; decode, 4 parallel", 4, "decode_tok_s_per_stream", (6.3, 6.6), "tok/s", note)
    r.add(f"{base}; decode, 4 parallel", 4, "decode_tok_s_aggregate", 24.8, "tok/s", note)
    r.add(f"{base}; 4 parallel", 4, "peak_memory_gb", 89.1, "GB", "peak GTT (GPU-visible system memory)")
    r.add("chunk auto-sized for all slots, capped (shipped)", 4, "prefill_chunk_rows", 4096, "rows",
          "cap = single-slot target")
    r.add("chunk auto-sized for all slots, uncapped, 4x32K", 4, "prefill_chunk_rows", 12800, "rows",
          "ablation: stalls the other slots' decode")
    r.add("chunk auto-sized for all slots, uncapped, 4x32K", 4, "peak_memory_gb", 93, "GB",
          "ablation: peak GTT with 12,800-row chunks")


def seed_002(out: list[dict]) -> None:
    r = Rows(out, "002_e2128ad86e2e4259.txt", "lucebox-hub dflash_server, concurrent speculative serving",
             "AMD gfx1151", "Qwen3.6-27B + Q8_0 Qwen3.6 drafter")
    # The machine in full: AMD Ryzen AI MAX+ 395 / Radeon 8060S (gfx1151), 128 GiB UMA, ROCm 7.2.4.
    paired = ("Ryzen AI MAX+ 395 / Radeon 8060S, 128 GiB UMA; median of 3 fresh-process repeats; "
              "output-window tok/s; 64 completion tokens/request, temp 0")
    for c, ar, dd, goodput, accepted in (
        (1, 12.57, 11.85, -4.4, 1.00),
        (4, 36.21, 33.61, -4.8, 3.08),
        (8, 65.93, 56.32, -6.7, 2.79),
        (16, 58.79, 54.63, -8.1, 2.00),
    ):
        r.add("paired: AR", c, "decode_tok_s_aggregate", ar, "tok/s", paired)
        r.add("paired: adaptive DDTree (budget 22)", c, "decode_tok_s_aggregate", dd, "tok/s",
              paired + "; weak draft: the yield guard fell back to AR after one tree step")
        r.add("paired: adaptive DDTree (budget 22)", c, "goodput_vs_ar_pct", goodput, "%", paired)
        r.add("paired: adaptive DDTree (budget 22)", c, "accepted_per_step", accepted, "tokens/step", paired)

    shot = "screenshot: DDTree + PFlash auto + KVFlash auto (8,192-token resident pool)"
    shot_note = "Radeon 8060S; one fresh-process repeat; 38K-45K-token prompts, PFlash kept about 4.9%"
    for c, tps, prompt, ttft, page_in, page_out in (
        (1, 12.39, 2021, 19.324, 0, 0),
        (4, 31.61, (1870, 2235), 77.495, 1, 18),
        (8, 52.60, (1869, 2237), 153.782, 245, 792),
        (16, 18.73, (1867, 2238), 307.360, 293, 1880),
    ):
        r.add(shot, c, "decode_tok_s_aggregate", tps, "tok/s", shot_note + "; output-window tok/s")
        r.add(shot, c, "effective_prompt_tokens", prompt, "tokens", shot_note)
        r.add(shot, c, "ttft_s_max", ttft, "s", shot_note)
        r.add(shot, c, "page_in", page_in, "pages", shot_note)
        r.add(shot, c, "page_out", page_out, "pages", shot_note + ("; paging cliff" if c == 16 else ""))

    one = "Radeon 8060S; one-repeat engineering screen"
    r.add("ablation: PFlash only", 4, "decode_tok_s_aggregate", 35.54, "tok/s", one + "; output-window tok/s")
    r.add("ablation: PFlash only", 4, "ttft_s_max", 74.261, "s", one)
    r.add("ablation: PFlash only", 4, "prompt_tokens_raw_total", 166016, "tokens", one)
    r.add("ablation: PFlash only", 4, "prompt_tokens_effective_total", 8179, "tokens", one)
    r.add("ablation: KVFlash only, paging pressure", 4, "decode_tok_s_aggregate", 8.56, "tok/s",
          one + "; output-window tok/s")
    r.add("ablation: KVFlash only, paging pressure", 4, "ttft_s_max", 197.859, "s", one)
    r.add("ablation: KVFlash only, paging pressure", 4, "history_tokens", (13474, 20203), "tokens", one)
    r.add("ablation: KVFlash only, paging pressure", 4, "page_out", 3714, "pages", one)

    iso = "Radeon 8060S; single-request isolation: 466-token prompt, 256-token completion"
    for setup, decode, goodput, ttft in (
        ("dense AR, no paged/concurrency", 12.03, 11.13, 1.79),
        ("paged AR, C1", 12.10, 11.25, 1.68),
        ("dense Q8 DFlash + SWA=2048", 16.22, 14.48, 1.95),
        ("dense forced PFlash", 12.05, 10.45, 3.32),
        ("dense KVFlash, no page pressure", 11.05, 10.28, 1.82),
    ):
        r.add(f"isolation: {setup}", 1, "decode_tok_s_per_stream", decode, "tok/s", iso + "; request decode tok/s")
        r.add(f"isolation: {setup}", 1, "goodput_tok_s", goodput, "tok/s", iso)
        r.add(f"isolation: {setup}", 1, "ttft_s", ttft, "s", iso)
    r.add("isolation: concurrent packed verify/replay DDTree, C1", 1, "decode_tok_s_per_stream", 11.48, "tok/s",
          iso + "; request decode tok/s")


def seed_003(out: list[dict]) -> None:
    r = Rows(out, "003_1ae76f1c3c8f91f0.txt", "Strata server, wide speculation across slots (PR #1209)",
             "NVIDIA RTX 5090 (undervolted), Ryzen 9 9950X3D, 48 GB DDR5-6000", "Swift 1.5 IQ2_XS")
    note = ("median of 3 paired runs; 98,304 ctx/request, int8 KV, temp .85; outputs differ, "
            "so not an equal-work comparison")
    base = "baseline: upstream v0.1.40.1 + shared-MTP-head fix"
    cand = "candidate: wide speculation"
    for workload, decode, whole in (
        ("essay writing", (146.2, 200.1, 1.37), (141.1, 189.2, 1.34)),
        ("tool-driven coding", (167.1, 325.7, 1.95), (137.3, 221.5, 1.61)),
    ):
        for metric, (b, c, ratio), what in (
            ("decode_tok_s_aggregate", decode, "four-stream decode"),
            ("whole_run_tok_s", whole, "whole bounded run"),
        ):
            r.add(f"{workload}; {base}", 4, metric, b, "tok/s", f"{what}; {note}")
            r.add(f"{workload}; {cand}", 4, metric, c, "tok/s", f"{what}; {note}")
            r.add(f"{workload}; {cand}", 4, f"{metric}_speedup", ratio, "x", f"{what}; candidate / baseline")


def seed_004(out: list[dict]) -> None:
    r = Rows(out, "004_e67c450bfe0c360b.txt", "ds4 server --batched-session, single GPU",
             "NVIDIA RTX PRO 6000 (96 GB)", "Flash q2 GGUF")
    note = "aggregate = total tokens / wall; one-token graphs back to back, each re-reads the weights"
    r.add("one-token pipelining (before the fused path)", 1, "decode_tok_s_aggregate", 61, "tok/s", note)
    r.add("one-token pipelining (before the fused path)", 2, "decode_tok_s_aggregate", 62, "tok/s", note)
    r.add("one-token pipelining (before the fused path)", 4, "decode_tok_s_aggregate", 62, "tok/s", note)
    r.add("fused path with batch expert execution (DS4_FUSED_BATCH_MOE=1)", None, "decode_tok_s_aggregate", 54,
          "tok/s", "'slower than pipelining (54 vs 62)'; concurrency 2-4, not stated which")
    mem = "--batched-session 4 --ctx 32768"
    r.add(f"{mem}; engine open before the reserve fix", None, "memory_used_gb", 95.9, "GiB",
          "engine base after the lazy Q8->F16 caches warm up; session creation then fails")
    r.add(f"{mem}; one 32K-token session", 1, "session_memory_gb", 0.6, "GiB", "context buffers per session")
    fixed = f"{mem} --prefill-chunk 1024; with the reserve fix"
    r.add(fixed, 4, "memory_used_gb", 97.2, "GiB", "boots at 97.2 of 97.9 GiB")
    r.add(fixed, 4, "memory_total_gb", 97.9, "GiB", "usable device memory")


def issues(out: list[dict]) -> None:
    """Figures measured by this project (its issues), not by the seeds' authors."""
    default_model = "Gemma 3 270M Q4_K_M GGUF (project default)"
    cpu = Rows(out, ISSUE_CPU_LLAMA_CPP, "llama.cpp (CPU)", "cpu:AMD-EPYC:2c", default_model)
    mine = "measured by this project"
    cpu.add("1 sequence, 2 threads", 1, "decode_tok_s_aggregate", 48, "tok/s", mine)
    cpu.add("batched decode, 2 threads", None, "decode_tok_s_aggregate", 125.8, "tok/s",
            mine + "; batched vs sequential on the same requests; batch size: see the issue")
    cpu.add("sequential decode, 2 threads", None, "decode_tok_s_aggregate", 47.7, "tok/s",
            mine + "; the same requests one after another")

    cuda = Rows(out, ISSUE_H200_LLAMA_CPP, "llama.cpp (CUDA)", "gpu:NVIDIA-H200", default_model)
    short = mine + "; 128-token prompts"
    cuda.add("128-token prompts", 1, "decode_tok_s_aggregate", 976, "tok/s", short)
    cuda.add("128-token prompts", 4, "decode_tok_s_aggregate", 2697, "tok/s", short)
    cuda.add("128-token prompts", 16, "decode_tok_s_aggregate", (4803, 5477), "tok/s", short + "; range over repeats")
    cuda.add("128-token prompts", 32, "decode_tok_s_aggregate", (6621, 8516), "tok/s", short + "; range over repeats")
    cuda.add("2,048-token prompts", 16, "decode_tok_s_aggregate", (3310, 4896), "tok/s",
             mine + "; 2,048-token prompts; range over repeats")

    hf = Rows(out, ISSUE_H200_TORCH, "transformers, static cache + torch.compile", "gpu:NVIDIA-H200", "Gemma 3 270M")
    for c, v in ((1, 330), (4, 1184), (16, 4696)):
        hf.add("static KV cache, torch.compile", c, "decode_tok_s_aggregate", v, "tok/s", mine)
    torch_ = Rows(out, ISSUE_H200_TORCH, "plain torch, CUDA graphs", "gpu:NVIDIA-H200",
                  "Gemma 3 270M shape, random bf16 weights")
    for c, v in ((1, 926), (4, 3684), (16, 13876)):
        torch_.add("bf16, CUDA graphs, random weights", c, "decode_tok_s_aggregate", v, "tok/s",
                   mine + "; an upper bound for this model size: no sampling, no real weights")


def build() -> pl.DataFrame:
    out: list[dict] = []
    for part in (seed_000, seed_002, seed_003, seed_004, issues):
        part(out)
    return pl.DataFrame(out, schema=SCHEMA)


def unverified(frame: pl.DataFrame, seeds_dir: Path) -> list[str]:
    """Seed rows whose number does not appear in the seed's text, in any usual spelling."""
    misses = []
    for row in frame.filter(~pl.col("source").str.starts_with("issue-")).iter_rows(named=True):
        text = (seeds_dir / row["source"]).read_text(encoding="utf-8")
        v = row["value"]
        spellings = {f"{v:g}", f"{v:.1f}", f"{v:.2f}", f"{v:.3f}", f"{v:,.0f}" if v == int(v) else f"{v:g}"}
        spellings |= {s.lstrip("-") for s in spellings}
        if not any(re.search(rf"(?<![\d.,]){re.escape(s)}(?![\d])", text) for s in spellings):
            misses.append(f"{row['source']}: {row['configuration']} / {row['metric']} = {v:g}")
    return misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seeds-dir", type=Path, default=DEFAULT_SEEDS)
    args = parser.parse_args(argv)
    frame = build()
    if args.seeds_dir.is_dir():
        misses = unverified(frame, args.seeds_dir)
        if misses:
            print("numbers not found in their seed:\n  " + "\n  ".join(misses), file=sys.stderr)
            return 1
    else:
        print(f"note: {args.seeds_dir} not found; seed numbers not checked against the seed text")
    sys.path.insert(0, str(REPO))
    from workbench.runstore import atomic_write_parquet

    atomic_write_parquet(args.out, frame)
    print(f"wrote {frame.height} rows from {frame['source'].n_unique()} sources to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
