"""The `workbench` command: a thin front end over the package.

Defaults come from the config dataclasses (one source of truth). Bad input of any kind ends
with one line on stderr naming what is wrong and what is allowed, and exit code 2.

Help convention: every option has a help string saying what it does; the shared parser class
appends " (default: X)" to it unless the text already says "default" (write it in words where
the raw value would be unclear, and always where the default is None: say what happens when
the option is left out). Flags (store_true, --help, --version) get no default appended.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Callable

from .errors import WorkbenchError

EXIT_USAGE = 2
STDIN = "-"  # the prompt argument or --prompt-file PATH that reads standard input


def _default_text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, with the exceptions of the help convention above;
    and text written with line breaks (an epilog of examples) is kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or action.nargs == 0  # flags: store_true/store_false/store_const, --help, --version
            or default is None
            or default is argparse.SUPPRESS
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return text
        # (the help text is %-formatted by argparse next, so a '%' in the value is escaped)
        return f"{text} (default: {_default_text(default).replace('%', '%%')})"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """Every workbench parser (subcommands too, through `parser_class`): one-line errors and the
    help convention."""

    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def version_text() -> str:
    """'workbench 0.1.0', plus the git commit when the package runs from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("slotlab")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from . import __version__ as v
    commit = _git_commit(Path(__file__).resolve().parent.parent)
    return f"workbench {v}" + (f" (git {commit})" if commit else "")


def _git_commit(root: Path) -> str | None:
    if not (root / ".git").exists():
        return None
    try:
        p = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return p.stdout.strip() or None


class _VersionAction(argparse.Action):
    """argparse's "version" action wants the string when the parser is built; this one asks git
    only when --version is given."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())  # (on stdout, as argparse's own version action)
        parser.exit(0)


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


def format_duration(seconds: float) -> str:
    """A wall time for progress lines: '0.42 s', '12.3 s', '4 min 05 s', '1 h 02 min'."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH",
                   help="path to a GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="precision the weights are dequantized to and computed in")


def read_prompt(text: str | None, path: str | None) -> str:
    """The prompt from exactly one source: the argument, a UTF-8 file, or stdin ('-' as either).
    From a file or stdin one trailing newline is dropped (the one `echo` and editors add).
    Empty or whitespace-only prompts are refused."""
    how = f"as an argument, as --prompt-file PATH, or '{STDIN}' for stdin"
    if (text is None) == (path is None):
        given = "both an argument and --prompt-file" if text is not None else "none"
        raise WorkbenchError(f"give the prompt exactly once ({how}); got {given}")
    if text is not None and text != STDIN:
        prompt = text
    else:
        source = path if path is not None else STDIN
        if source == STDIN:
            where = "stdin"
            if sys.stdin is None:
                raise WorkbenchError("no stdin to read the prompt from; pass it as an argument or --prompt-file PATH")
            if sys.stdin.isatty():
                print("workbench: reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr, flush=True)
            data = sys.stdin.buffer.read()
        else:
            where = f"prompt file {source}"
            try:
                data = Path(source).read_bytes()
            except FileNotFoundError:
                raise WorkbenchError(f"prompt file not found: {source}") from None
            except OSError as e:
                raise WorkbenchError(f"cannot read prompt file {source}: {e.strerror or e}") from None
        try:
            prompt = data.decode("utf-8-sig")  # (a byte-order mark, as some editors write, is no text)
        except UnicodeDecodeError as e:
            raise WorkbenchError(
                f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
            ) from None
        prompt = prompt.removesuffix("\n").removesuffix("\r")
    if not prompt.strip():
        raise WorkbenchError(f"the prompt is empty: give some text to continue ({how})")
    return prompt


# ---- subcommands ----------------------------------------------------------------------------


def cmd_generate(args) -> int:
    prompt = read_prompt(args.prompt, args.prompt_file)  # before the model loads: bad input fails fast
    # The file is opened (its header walked once, `check_extents`) before torch is imported, so
    # a missing, truncated or damaged model is named in one line at once; load_model takes the
    # open file and does not read the header again.
    from .gguf_file import GGUFFile

    if args.model is None:
        from .default_model import default_model_path

        source = GGUFFile.open(default_model_path())
    else:
        source = GGUFFile.open(args.model)
    from .engine import Engine, EngineConfig
    from .model import load_model

    model = load_model(source, dtype=args.dtype)
    ids = model.tokenize(prompt)
    context = model.config.context_length
    if len(ids) + 1 > context:  # (the scheduler refuses it too, in words that name no model)
        raise WorkbenchError(
            f"the prompt is {len(ids):,} tokens, which does not fit the model's context of {context:,} tokens "
            f"(the prompt and at least one new token); shorten the prompt"
        )
    engine = Engine(model, EngineConfig(max_concurrency=1, backend=args.backend))
    handle = engine.submit(
        ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    out = sys.stdout
    # (the handle's text_stream() always leaves special tokens out; --show-special needs our own decoder)
    text = model.tokenizer.stream(skip_special=not args.show_special)
    for tok in handle.tokens():
        piece = text.push(tok)
        if piece:
            out.write(piece)
            out.flush()
    out.write(text.flush())
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
    p = _Parser(prog="workbench", description="Slotlab workbench: exact concurrent LLM serving, measured.",
                epilog="Each command has its own --help, e.g. workbench generate --help.")
    p.add_argument("--version", action=_VersionAction, help="print the version (and the git commit in a checkout) and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND",
                           title="commands")

    g = sub.add_parser(
        "generate", help="generate text from a prompt, streaming",
        description="Continue a prompt with the model, printing the text as it is generated, then a line of "
        "statistics. Greedy (the most likely token each step) unless --temperature is above 0.",
        epilog="examples:\n"
        '  workbench generate "The capital of France is" --max-tokens 8\n'
        "  workbench generate --prompt-file long_prompt.txt\n"
        '  echo "Once upon a time" | workbench generate - --temperature 0.8 --seed 1\n',
    )
    g.add_argument("prompt", nargs="?", default=None,
                   help=f"the text to continue; '{STDIN}' reads it from stdin (default: none, then --prompt-file "
                        "gives it)")
    g.add_argument("--prompt-file", metavar="PATH", default=None,
                   help=f"read the prompt from this UTF-8 file ('{STDIN}': stdin), one trailing newline dropped; for "
                        "long prompts, which the OS may refuse as an argument (default: none, the argument gives it)")
    g.add_argument("--max-tokens", type=int_range(1, 1_000_000), default=64, metavar="N",
                   help="most tokens to generate; generation stops earlier at an end-of-text or end-of-turn "
                        "token, or when the model's context is full")
    g.add_argument("--temperature", type=float_range(0.0, 100.0), default=0.0, metavar="T",
                   help="sampling temperature 0..100; 0 always picks the most likely token (greedy)")
    g.add_argument("--top-k", type=int_range(1), default=None, metavar="K",
                   help="sample only among the K most likely tokens (default: no limit)")
    g.add_argument("--top-p", type=float_range(1e-9, 1.0), default=1.0, metavar="P",
                   help="nucleus sampling: only among the most likely tokens whose probabilities add up to P; "
                        "1 keeps all")
    g.add_argument("--seed", type=int_range(0, 2**63 - 1), default=None, metavar="SEED",
                   help="seed of the sampling generator, for repeatable output at temperature > 0 "
                        "(default: a fresh random seed each run)")
    g.add_argument("--backend", default=defaults.backend, choices=["torch", "triton"],
                   help="torch: the CPU reference path; triton: the kernels (a GPU, or the CPU interpreter)")
    g.add_argument("--show-special", action="store_true",
                   help="print special tokens (<bos>, <end_of_turn>, <start_of_image>, ...) as their text; "
                        "without it they are left out of the text")
    g.add_argument("--quiet-stats", action="store_true",
                   help="print the statistics line on stderr instead of stdout")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a GGUF model",
                       description="Describe a GGUF model: file, architecture, sizes, context, quant types.")
    i.add_argument("--model", default=None, metavar="PATH",
                   help="path to a GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    i.set_defaults(func=cmd_info)

    for mod in ("bench", "runstore", "dashboard", "ablate", "mainjob", "lab"):
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
