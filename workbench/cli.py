"""The `workbench` command: a thin front end over the package.

Defaults come from the config dataclasses (one source of truth). Bad input of any kind ends
with one line on stderr naming what is wrong and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .errors import WorkbenchError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    allowed = f"an integer {lo}..{hi}" if hi is not None else f"an integer >= {lo}"

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number: allowed {allowed}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range: allowed {allowed}")
        return v

    return parse


def float_range(lo: float, hi: float) -> Callable[[str], float]:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number: allowed {lo}..{hi}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range: allowed {lo}..{hi}")
        return v

    return parse


def int_list(lo: int, hi: int) -> Callable[[str], list[int]]:
    def parse(s: str) -> list[int]:
        return [int_range(lo, hi)(p) for p in s.split(",") if p.strip()]

    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="path to a GGUF file (default: embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute precision")


# ---- subcommands ----------------------------------------------------------------------------


def cmd_generate(args) -> int:
    from .engine import Engine, EngineConfig
    from .model import load_model

    model = load_model(args.model, dtype=args.dtype)
    engine = Engine(model, EngineConfig(max_concurrency=1, backend=args.backend))
    handle = engine.submit(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    out = sys.stdout
    for piece in handle.text_stream():
        out.write(piece)
        out.flush()
    r = handle.result()
    out.write("\n")
    print(
        f"[prompt {r.num_prompt_tokens} tokens | prefill {r.prefill_tok_s:.1f} tok/s | "
        f"decode {r.decode_tok_s:.1f} tok/s | {r.num_generated_tokens} generated]",
        file=sys.stderr if args.quiet_stats else sys.stdout,
    )
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    import gguf

    from .gguf_file import GGUFFile
    from .model_config import ModelConfig

    if args.model is None:
        from .default_model import default_model_path

        args.model = default_model_path()
    g = GGUFFile.open(args.model)
    cfg = ModelConfig.from_metadata(g.metadata, set(g.tensors))
    groups: dict[str, Counter] = {}
    n_params = 0
    for name, t in g.tensors.items():
        group = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
        groups.setdefault(group, Counter())[gguf.GGMLQuantizationType(t.qtype).name] += 1
        n = 1
        for s in t.shape:
            n *= s
        n_params += n
    print(f"file          {g.path}")
    print(f"sha256        {g.index.sha256}")
    print(f"size          {g.index.size:,} bytes")
    print(f"name          {g.get('general.name', '?')}")
    print(f"architecture  {cfg.arch}")
    print(f"parameters    {n_params:,}")
    print(f"layers        {cfg.n_layers} (sliding-window {sum(cfg.swa_layers)}, global {cfg.n_layers - sum(cfg.swa_layers)})")
    print(f"embedding     {cfg.n_embd}   ffn {cfg.n_ff}   vocab {cfg.vocab_size:,}")
    print(f"heads         {cfg.n_heads} q / {cfg.n_kv_heads} kv, head dim {cfg.head_dim}")
    print(f"context       {cfg.context_length:,} tokens" + (f", sliding window {cfg.sliding_window}" if cfg.sliding_window else ""))
    print(f"rope base     {cfg.rope_base:g}" + (f" (local {cfg.rope_base_local:g})" if cfg.sliding_window else ""))
    print("quant types per tensor group:")
    for group in sorted(groups):
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(groups[group].items()))
        print(f"  {group:22s} {kinds}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .engine_config import EngineConfig

    defaults = EngineConfig()
    p = _Parser(prog="workbench", description="Slotlab workbench: exact concurrent LLM serving, measured.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int_range(1, 1_000_000), default=64)
    g.add_argument("--temperature", type=float_range(0.0, 100.0), default=0.0)
    g.add_argument("--top-k", type=int_range(1), default=None)
    g.add_argument("--top-p", type=float_range(1e-9, 1.0), default=1.0)
    g.add_argument("--seed", type=int_range(0, 2**63 - 1), default=None)
    g.add_argument("--backend", default=defaults.backend, choices=["torch", "triton"])
    g.add_argument("--quiet-stats", action="store_true", help="print the stats line on stderr")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a GGUF model")
    i.add_argument("--model", default=None, help="path to a GGUF file (default: embedded model)")
    i.set_defaults(func=cmd_info)

    for mod in ("bench", "runstore", "dashboard", "ablate", "mainjob"):
        try:
            module = __import__(f"workbench.{mod}", fromlist=["register_cli"])
        except ImportError:
            continue
        if hasattr(module, "register_cli"):
            module.register_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except WorkbenchError as e:
        print(f"workbench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("workbench: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
