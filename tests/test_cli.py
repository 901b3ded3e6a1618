"""The CLI: bad input ends with one line naming the problem, exit code 2, no traceback; every
option's help says what it does and its default; prompts from an argument, a file or stdin."""

import argparse
import io
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from workbench.cli import _default_text, _Parser, build_parser, format_duration, main

# Every subcommand, including those other modules register: each is walked by the help test.
COMMANDS = ("generate", "info", "bench", "runs", "dashboard", "ablate", "run-all", "lab")


def num_tokens(model_path, text: str) -> int:
    from workbench.model import load_model

    return len(load_model(model_path).tokenize(text))


def run(*args, input=None):
    import os

    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, input=input)


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


def test_prompt_longer_than_context(tiny_gguf, tmp_path):
    """Refused in one line naming the prompt's length and the model's context, from an argument
    or from a 200 KB file (more than Linux takes as one argument: 'Argument list too long')."""
    path = tiny_gguf("llama", "Q8_0", context_length=64)
    n = num_tokens(path, "the " * 100)
    one_line_error(run("generate", "the " * 100, "--model", str(path)),
                   f"the prompt is {n} tokens, which does not fit the model's context of 64 tokens")
    big = tmp_path / "big.txt"
    big.write_text("the " * 50_000, encoding="utf-8")
    assert big.stat().st_size == 200_000
    one_line_error(run("generate", "--prompt-file", str(big), "--model", str(path)),
                   f"the prompt is {num_tokens(path, 'the ' * 50_000):,} tokens", "the model's context of 64 tokens")


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


def test_bench_triton_options_need_the_triton_backend(tiny_gguf, tmp_path):
    """--triton-options are the triton backend's: with the torch backend one line naming the
    options, exit 2, no run written."""
    one_line_error(run("bench", "--model", str(tiny_gguf("gemma3")), "--triton-options", "pdl=false,fuse_glu=off",
                       "--concurrency", "1", "--prompt-len", "4", "--gen", "2", "--data-dir", str(tmp_path)),
                   "triton options (pdl, fuse_glu) are the triton backend's: allowed with backend='triton' only")
    assert not list(tmp_path.rglob("*.parquet"))


@pytest.mark.parametrize("text,needle", [
    ("pdl=maybe", "pdl='maybe' is not allowed: allowed True, False"),
    ("attn_segment=48", "attn_segment=48 is not allowed: allowed 32, 64, 128, 256"),
    ("bogus=1", "unknown triton option 'bogus'; valid options: graphs, head_matmul,"),
    ("layer_forms=Q8_0:fast", "layer_forms['Q8_0']='fast' is not allowed: allowed mma, gemv"),
    ("pdl", "triton option 'pdl' is not name=value"),
])
def test_bench_bad_triton_options(text, needle, tmp_path, capsys):
    """A bad name or value in --triton-options: one line naming the field and what is allowed,
    exit 2, before any model is read (the model path does not exist)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--backend", "triton", "--triton-options", text, "--model", str(tmp_path / "absent.gguf")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("workbench bench: error: argument --triton-options: "), err
    assert needle in err, err


# ---- help, --version ------------------------------------------------------------------------


def _subparsers(parser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_is_walked():
    assert sorted(_subparsers(build_parser())) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_says_what_it_does_and_its_default(command):
    """Each option of each command has help text; an option with a default (not None, not a flag)
    shows it in the rendered help. (Where the default is None the help must say in words what
    happens without it; only a reader can check that.)"""
    sub = _subparsers(build_parser())
    assert command in sub, f"no '{command}' command registered"
    parser = sub[command]
    rendered = "".join(parser.format_help().split())  # (wrapping moves only whitespace)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip() and action.help is not argparse.SUPPRESS, f"{command} {name}: no help"
        shown = formatter._expand_help(action)
        assert "".join(shown.split()) in rendered, f"{command} {name}"
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            continue
        if "default" in action.help.lower():
            continue  # the author wrote it in words
        assert f"(default: {_default_text(action.default)})" in shown, f"{command} {name}: {shown!r}"


def test_help_appends_defaults_by_the_convention():
    p = _Parser(prog="t")
    p.add_argument("--n", type=int, default=5, help="how many")
    p.add_argument("--cs", default=[1, 2, 4], help="a list")
    p.add_argument("--pct", default="50%", help="a share")
    p.add_argument("--chunk", default=None, help="rows per step (default: auto)")
    p.add_argument("--mode", default="x", help="the mode; Default is x, as it says")
    p.add_argument("--flag", action="store_true", help="a switch")
    p.add_argument("--top", default=None, help="the limit")
    text = " ".join(p.format_help().split())
    assert "how many (default: 5)" in text
    assert "a list (default: 1,2,4)" in text
    assert "a share (default: 50%)" in text
    assert "rows per step (default: auto)" in text and "(default: None)" not in text
    assert "Default is x, as it says" in text and "(default: x)" not in text
    assert "a switch (default" not in text and "(default: False)" not in text
    assert "the limit (default" not in text


def test_version():
    from importlib.metadata import version

    p = run("--version")
    assert p.returncode == 0, p.stderr
    assert re.fullmatch(rf"workbench {re.escape(version('slotlab'))}( \(git [0-9a-z.-]+\))?\n", p.stdout), p.stdout


def test_format_duration():
    assert [format_duration(s) for s in (0.4213, 12.34, 245, 3725)] == ["0.42 s", "12.3 s", "4 min 05 s", "1 h 02 min"]


# ---- generate: where the prompt comes from ------------------------------------------------------


def _generate(capsys, monkeypatch, *args, stdin: bytes | None = None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    rc = main(["generate", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prompt_from_argument_file_and_stdin_agree(tiny_gguf, tmp_path, capsys, monkeypatch):
    model = ["--model", str(tiny_gguf("llama")), "--max-tokens", "4"]
    f = tmp_path / "p.txt"
    f.write_bytes("the slot batch\n".encode())  # one trailing newline is dropped
    outs = [
        _generate(capsys, monkeypatch, "the slot batch", *model),
        _generate(capsys, monkeypatch, "--prompt-file", str(f), *model),
        _generate(capsys, monkeypatch, "-", *model, stdin=b"the slot batch\n"),
        _generate(capsys, monkeypatch, "--prompt-file", "-", *model, stdin=b"the slot batch"),
    ]
    assert [rc for rc, _, _ in outs] == [0, 0, 0, 0], outs
    texts = [out.splitlines()[0] for _, out, _ in outs]
    assert texts == texts[:1] * 4
    n = num_tokens(model[1], "the slot batch")
    assert all(f"[prompt {n} tokens |" in out for _, out, _ in outs), outs


def test_generate_walks_the_model_header_once(tiny_gguf, capsys, monkeypatch):
    """The file is opened (its header checked) before torch is imported, and load_model takes
    the open file: one header walk per `workbench generate`, not a check and then a load."""
    from workbench import gguf_file

    walks = []
    read_layout = gguf_file.read_layout
    monkeypatch.setattr(gguf_file, "read_layout", lambda path: walks.append(path) or read_layout(path))
    rc, out, err = _generate(capsys, monkeypatch, "the slot", "--model", str(tiny_gguf("llama")), "--max-tokens", "2")
    assert rc == 0, err
    assert len(walks) == 1, walks


def test_long_prompt_file_that_fits(tiny_gguf, tmp_path, capsys, monkeypatch):
    """A prompt near the context (2048 tokens for this model) runs."""
    f = tmp_path / "long.txt"
    text = "the cache " * 255
    f.write_text(text, encoding="utf-8")
    n = num_tokens(tiny_gguf("llama"), text)
    assert 2000 < n < 2048
    rc, out, err = _generate(capsys, monkeypatch, "--prompt-file", str(f), "--model", str(tiny_gguf("llama")),
                             "--max-tokens", "2")
    assert rc == 0, err
    assert f"[prompt {n} tokens |" in out


def test_stdin_through_a_pipe(tiny_gguf):
    p = run("generate", "-", "--model", str(tiny_gguf("llama")), "--max-tokens", "3", input="the model")
    assert p.returncode == 0, p.stderr
    assert f"[prompt {num_tokens(tiny_gguf('llama'), 'the model')} tokens |" in p.stdout


@pytest.mark.parametrize(
    "args,stdin,needle",
    [
        ([], None, "give the prompt exactly once (as an argument, as --prompt-file PATH, or '-' for stdin); got none"),
        (["hi", "--prompt-file", "x.txt"], None, "got both an argument and --prompt-file"),
        (["--prompt-file", "missing.txt"], None, "prompt file not found: missing.txt"),
        (["--prompt-file", "."], None, "cannot read prompt file .:"),
        (["-"], b"caf\xe9 au lait", "stdin is not UTF-8 text (byte 0xe9 at offset 3)"),
        ([""], None, "the prompt is empty"),
        ([" \n\t "], None, "the prompt is empty"),
        (["-"], b"\n", "the prompt is empty"),
    ],
)
def test_bad_prompt_sources(args, stdin, needle, capsys, monkeypatch, tmp_path):
    """One line before any model loads (the model named does not exist)."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = _generate(capsys, monkeypatch, *args, "--model", str(tmp_path / "absent.gguf"), stdin=stdin)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_bad_utf8_file(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("naïve".encode("latin-1"))
    one_line_error(run("generate", "--prompt-file", str(f)), f"prompt file {f} is not UTF-8 text (byte 0xef at offset 2)")


@pytest.mark.real_model
def test_empty_prompt_is_refused_with_the_real_model():
    """Today's bug: `generate ""` continued a lone <bos> and printed '<h1><i>P'."""
    p = run("generate", "")
    one_line_error(p, "the prompt is empty: give some text to continue")
    assert p.stdout == ""


def test_special_tokens_left_out_unless_asked(tiny_gguf, capsys, monkeypatch):
    """The streamed text leaves special tokens (<s>, </s>, <unk>, ...) out; --show-special shows
    them. The model's tokens are stood in for by a fixed list (a random model emits none reliably)."""
    from workbench.engine import RequestHandle
    from workbench.model import load_model

    path = str(tiny_gguf("llama"))
    tok = load_model(path).tokenizer
    ids = [tok.token_id(t) for t in ("<s>", "\u2581the", "<unk>", "\u2581slot", "<pad>", "</s>")]
    assert all(i is not None for i in ids)
    monkeypatch.setattr(RequestHandle, "tokens", lambda self: iter(ids))
    rc, out, _ = _generate(capsys, monkeypatch, "the", "--model", path, "--max-tokens", "2")
    # (this vocabulary's decoder drops the text's first leading space)
    assert rc == 0 and out.splitlines()[0] == "the slot"
    rc, out, _ = _generate(capsys, monkeypatch, "the", "--model", path, "--max-tokens", "2", "--show-special")
    assert rc == 0 and out.splitlines()[0] == "<s> the<unk> slot<pad></s>"


# ---- progress: bench and run-all ------------------------------------------------------------------


def test_bench_progress_on_stderr_unless_turned_off(tiny_gguf, tmp_path, capsys):
    args = ["bench", "--model", str(tiny_gguf("gemma3")), "--concurrency", "1,2", "--prompt-len", "8", "--gen", "2",
            "--data-dir", str(tmp_path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0].startswith("bench: 2 measurements (concurrency 1,2 x 1 repeat), prompt 8 tokens, gen 2 tokens")
    steps = [line for line in lines if line.startswith("[")]
    assert [line.split(":")[0] for line in steps] == ["[1/2] concurrency 1, prompt 8, repeat 1/1",
                                                       "[2/2] concurrency 2, prompt 8, repeat 1/1"]
    assert "exact vs solo" in steps[1] and "tok/s aggregate" in steps[1]
    assert re.fullmatch(r"bench: 2 measurements in \d+\.\d+ s", lines[-1]), lines[-1]
    assert "| 2 |" in out and "results:" in out and "[1/2]" not in out  # the table, not the progress
    assert main([*args, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "| 2 |" in out


def test_run_specs_reports_each_run_as_it_ends(monkeypatch, capsys):
    from workbench import ablate, ablations

    specs = [SimpleNamespace(label="a", notebook="a.ipynb"), SimpleNamespace(label="b", notebook="b.ipynb")]
    printed_before = []

    def fake_execute(spec, **kw):
        printed_before.append(capsys.readouterr().out)  # what was printed before this run started
        return SimpleNamespace(spec=spec, status="complete", wall_s=1.0, run_id=f"r-{spec.label}", error=None)

    monkeypatch.setattr(ablations, "execute_run", fake_execute)
    monkeypatch.setattr(ablate, "report_line", lambda r: f"{r.spec.label}: {r.status}")
    results = ablate.run_specs(specs, progress_bar=False)
    assert [r.run_id for r in results] == ["r-a", "r-b"]
    assert printed_before[1] == "[1/2] a: complete\n"  # run a reported before run b started
    assert capsys.readouterr().out == "[2/2] b: complete\n"


def test_run_all_says_what_it_does(monkeypatch, tmp_path, capsys):
    from workbench import ablations, dashboard, mainjob

    specs = [SimpleNamespace(label="chunk-sizing"), SimpleNamespace(label="decode-batching concurrency=4")]
    results = [SimpleNamespace(spec=specs[0], status="complete", wall_s=12.5, run_id="r1", error=None),
               SimpleNamespace(spec=specs[1], status="failed", wall_s=75, run_id="r2", error="ValueError: x")]
    monkeypatch.setattr(ablations, "registry", lambda: {"chunk-sizing": SimpleNamespace(params=())})
    monkeypatch.setattr(ablations, "plan_sweep", lambda *a, **k: specs)
    monkeypatch.setattr(mainjob, "run_specs", lambda got, progress_bar: results if got == specs else None)
    monkeypatch.setattr(dashboard, "build_dashboards", lambda data, out: [tmp_path / "overview.html"])
    rc = mainjob.cmd_run_all(SimpleNamespace(quick=True, data_dir=tmp_path / "data", out=tmp_path / "dash",
                                             no_progress=True))
    assert rc == 1
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == f"run-all: 2 runs (quick settings) into {tmp_path / 'data'}: chunk-sizing, decode-batching concurrency=4"
    # each run's start and end come from run_specs as they happen (mocked here)
    assert lines[1] == f"run-all: building the dashboards into {tmp_path / 'dash'} ..."
    assert re.fullmatch(r"run-all: 1 dashboard page in \d+\.\d+ s", lines[2]), lines[2]
    assert re.fullmatch(r"run-all: 1 of 2 run\(s\) complete; total \d+\.\d+ s", lines[3]), lines[3]
    assert "decode-batching concurrency=4 (r2): ValueError: x" in lines[4]
    assert f"wrote {tmp_path / 'overview.html'}" in out
