"""Tokenizer built from a GGUF file's metadata.

Why a library: a GGUF carries no `tokenizer.json`, only llama.cpp's description of the vocabulary
(tokens, scores, token types, merges, special ids). Turning that into a tokenizer that gives
llama.cpp's ids is fiddly (Gemma stores multi-space tokens as real spaces, lists no merges, and
its scores do not follow its merge order; control and user-defined tokens must be matched whole).
transformers already does this conversion for `AutoTokenizer.from_pretrained(..., gguf_file=...)`
(`transformers.integrations.gguf.convert_gguf_tokenizer`), producing a Rust `tokenizers`
fast tokenizer. We call that converter once, then keep only the `tokenizers` object: its JSON is
cached, and loading it back needs `tokenizers` alone (no transformers import, no GGUF parse).

What it covers: `tokenizer.ggml.model` "llama" (SentencePiece BPE with byte fallback, incl.
Gemma 1/2/3's quirks) and "gpt2" (byte-level BPE with a known `tokenizer.ggml.pre` split).
Only Gemma 3 ("llama" model) is checked against llama.cpp's ids (tests/goldens; plus 3,500 fuzzed
strings when this was written). Text that spells a control or user-defined token (e.g.
"<start_of_turn>") is encoded as that one token, as llama.cpp's server does (`parse_special=True`);
BOS follows `tokenizer.ggml.add_bos_token`. One correction on top of transformers' converter makes
user-defined tokens (Gemma's runs of spaces) match as llama.cpp matches them; see
`_match_user_tokens_like_llamacpp`. A literal U+2581 in the text is the vocabulary's spelling of a
space, so it decodes as " " (llama.cpp does the same).

Special tokens: ids that stand for no text (the GGUF's CONTROL, UNKNOWN and UNUSED token types,
e.g. <bos>, <end_of_turn>, <unused7>, and user-defined tokens that mark media, e.g.
<start_of_image>) are left out of decoded text unless `skip_special=False` asks for them; the
ids themselves are never changed.

Streaming: `StreamDecoder` turns ids into text increments, holding back bytes of a UTF-8
character split across byte-fallback tokens (<0xE2><0x82><0xAC> -> "€") until it is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import WorkbenchError

JSON_FORMAT = "workbench-tokenizer/2"  # /2: special_ids (a /1 cache is rebuilt)

# `tokenizer.ggml.model` values we build, and for "gpt2" the pre-tokenizers we know how to split.
ALLOWED_MODELS = ("llama", "gpt2")

# Control tokens that end a turn in chat-tuned models: generation stops on them as on EOS
# (llama.cpp's end-of-generation set does the same by token text).
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>")
# GGUF token types (gguf.TokenType): NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_UNUSED = 5
# Types whose tokens are never text (llama.cpp's detokenizer drops CONTROL and UNKNOWN tokens
# too unless asked for them; UNUSED ones should never be produced at all).
_NON_TEXT_TYPES = (_TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNUSED)
# User-defined tokens that mark where media goes, not text. Gemma 3's GGUF types its image
# markers USER_DEFINED (beside its HTML tags and runs of spaces and newlines, which are text), so
# the type alone does not tell them apart; these spellings do.
_MEDIA_MARKER_TEXTS = (
    "[multimodal]", "<start_of_image>", "<end_of_image>", "<image_soft_token>",
    "<start_of_audio>", "<end_of_audio>", "<audio_soft_token>",
    "<|image|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# GGUF key -> key in transformers' tokenizer dict (transformers' GGUF_TOKENIZER_MAPPING, "tokenizer").
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}


def _plain(value: Any) -> Any:
    """numpy arrays / scalars (as gguf_file gives them) -> Python lists / scalars."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _opt_int(md: Mapping[str, Any], key: str) -> int | None:
    v = md.get(key)
    return None if v is None else int(_plain(v))


def _match_user_tokens_like_llamacpp(backend, tokens: list[str], types: list[int]):
    """Make every user-defined token match whole in the raw text and nowhere else, as in llama.cpp.

    llama.cpp cuts the raw text at each user-defined token (GGUF token type 4), longest first,
    before the vocabulary's BPE, and its BPE never forms them (it looks tokens up with spaces
    escaped to U+2581, while the file spells these with real spaces). transformers adds those
    tokens as added tokens too, except Gemma's runs of 2..31 spaces: it respells them
    "\u2581\u2581..." and derives BPE merges for them. A run of more than 31 spaces then splits
    16+16+18 instead of 31+19, and a literal U+2581 next to a space merges with it. We undo the
    respelling: the vocabulary gets the file's spelling back, the merges that build those tokens
    are dropped, and each becomes an added token matched on the raw (unnormalized) text.
    Returns a new `tokenizers.Tokenizer` (or `backend` when nothing was respelled).
    """
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as _Backend

    respelled = {}  # backend spelling -> file spelling
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == _TOKEN_TYPE_USER_DEFINED:
            spelled = backend.id_to_token(i)
            if spelled is not None and spelled != text:
                respelled[spelled] = text
    if not respelled:
        return backend
    j = json.loads(backend.to_str())
    model = j["model"]
    if model.get("type") != "BPE" or any(t in model["vocab"] for t in respelled.values()):
        raise WorkbenchError("unexpected tokenizer layout from the GGUF converter (respelled user tokens); cannot match llama.cpp")
    model["vocab"] = {respelled.get(t, t): i for t, i in model["vocab"].items()}

    def keep(m) -> bool:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        return a not in respelled and b not in respelled and a + b not in respelled

    model["merges"] = [m for m in model["merges"] if keep(m)]
    j["added_tokens"] = [t for t in j["added_tokens"] if t["content"] not in respelled]
    out = _Backend.from_str(json.dumps(j, ensure_ascii=False))
    raw = list(respelled.values())
    out.add_tokens([AddedToken(t, normalized=False, special=False) for t in raw])
    for t in raw:
        i = out.token_to_id(t)
        if i is None or i >= len(tokens) or tokens[i] != t:
            raise WorkbenchError(f"user-defined token {t!r} did not keep its id; the GGUF's tokens and token types disagree")
    return out


def _special_ids(backend, tokens: list[str], types: list[int]) -> set[int]:
    """Ids that stand for no text: the non-text token types, the media markers among user-defined
    tokens, and whatever the converter itself marked special (for a GGUF without token types)."""
    out = {i for i, kind in enumerate(types) if kind in _NON_TEXT_TYPES}
    out |= {i for i, kind in enumerate(types) if kind == _TOKEN_TYPE_USER_DEFINED and tokens[i] in _MEDIA_MARKER_TEXTS}
    out |= {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    return out


class Tokenizer:
    """Encode / decode with the model's own vocabulary. Build with `from_gguf` / `from_metadata`
    (slow, once), cache `to_json()`, load with `from_json` (fast)."""

    def __init__(
        self,
        backend,  # tokenizers.Tokenizer
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        vocab_size: int,
        model: str,
        architecture: str,
        special_ids: Iterable[int] = (),
    ):
        self._tk = backend
        self.bos_id = bos_id
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos)
        self.vocab_size = int(vocab_size)
        self.model = model
        self.architecture = architecture
        self.special_ids = frozenset(int(i) for i in special_ids)  # ids that stand for no text
        if self.add_bos and self.bos_id is None:
            raise WorkbenchError("the GGUF asks for a BOS token (tokenizer.ggml.add_bos_token) but names no bos_token_id")

    # ----------------------------------------------------------------- building
    @classmethod
    def from_gguf(cls, source: Any) -> "Tokenizer":
        """Build from a GGUF: a path, a `workbench.gguf_file.GGUFFile`, a `gguf.GGUFReader`, or a
        metadata dict (see `from_metadata`)."""
        if isinstance(source, Mapping):
            return cls.from_metadata(source)
        if hasattr(source, "metadata") and isinstance(source.metadata, Mapping):  # GGUFFile
            return cls.from_metadata(source.metadata)
        if hasattr(source, "fields"):  # gguf.GGUFReader
            md = {
                k: f.contents()
                for k, f in source.fields.items()
                if k.startswith("tokenizer.") or k == "general.architecture"
            }
            return cls.from_metadata(md)
        if isinstance(source, (str, os.PathLike)):
            from .gguf_file import GGUFFile

            return cls.from_metadata(GGUFFile.open(source).metadata)
        raise TypeError(f"Tokenizer.from_gguf: cannot read a tokenizer from {type(source).__name__}")

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata: GGUF key (e.g. 'tokenizer.ggml.tokens') -> Python value.
        Numeric arrays may be lists or numpy arrays."""
        model = md.get("tokenizer.ggml.model")
        if model not in ALLOWED_MODELS:
            raise WorkbenchError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                f"allowed: {', '.join(ALLOWED_MODELS)}"
            )
        if "tokenizer.ggml.tokens" not in md:
            raise WorkbenchError("the GGUF has no tokenizer.ggml.tokens; a model file with its vocabulary is required")
        architecture = str(md.get("general.architecture", ""))
        td = {name: _plain(md[key]) for key, name in _TOKENIZER_KEYS.items() if key in md}
        tokens = td["tokens"] = list(td["tokens"])
        if model == "gpt2":
            from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

            pre = td.get("pre_tokenizer_type")
            if pre not in GGUF_PRE_TOKENIZER_SPLITS:
                raise WorkbenchError(
                    f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) for a gpt2 tokenizer; "
                    f"allowed: {', '.join(sorted(GGUF_PRE_TOKENIZER_SPLITS))}"
                )
        try:  # transformers >= 5.2x keeps the converter in a package; earlier releases in ggml.py
            from transformers.integrations.gguf import convert_gguf_tokenizer
        except ImportError:
            from transformers.integrations.ggml import convert_gguf_tokenizer

        try:
            try:
                backend, _ = convert_gguf_tokenizer(architecture, td)
            except KeyError:
                # releases before gemma3's entry (5.17) map gemma2 to the same Gemma converter
                if architecture != "gemma3":
                    raise
                backend, _ = convert_gguf_tokenizer("gemma2", td)
        except (ValueError, KeyError) as e:
            raise WorkbenchError(f"cannot build the tokenizer from the GGUF: {e}") from None
        types = list(_plain(md.get("tokenizer.ggml.token_type", [])))
        backend = _match_user_tokens_like_llamacpp(backend, tokens, types)

        bos_id = _opt_int(md, "tokenizer.ggml.bos_token_id")
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default: SentencePiece vocabularies get a BOS
            add_bos = model == "llama"
        eos_ids = set()
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            v = _opt_int(md, key)
            if v is not None:
                eos_ids.add(v)
        for text in _END_OF_TURN_TEXTS:
            try:
                i = tokens.index(text)
            except ValueError:
                continue
            if i < len(types) and types[i] == _TOKEN_TYPE_CONTROL:
                eos_ids.add(i)
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=bool(_plain(add_bos)),
            vocab_size=len(tokens),
            model=model,
            architecture=architecture,
            special_ids=_special_ids(backend, tokens, types),
        )

    # ------------------------------------------------------------------ caching
    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer, as one JSON string (~12 MB for Gemma 3)."""
        return json.dumps(
            {
                "format": JSON_FORMAT,
                "model": self.model,
                "architecture": self.architecture,
                "bos_id": self.bos_id,
                "eos_ids": sorted(self.eos_ids),
                "add_bos": self.add_bos,
                "vocab_size": self.vocab_size,
                "special_ids": sorted(self.special_ids),
                "tokenizers_json": self._tk.to_str(),
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, s: str | bytes) -> "Tokenizer":
        """Load what `to_json` wrote. Needs only the `tokenizers` package."""
        from tokenizers import Tokenizer as _Backend

        try:
            d = json.loads(s)
            fmt = d.get("format")
        except (ValueError, AttributeError):
            raise WorkbenchError("the cached tokenizer is not valid JSON; delete it to rebuild from the GGUF") from None
        if fmt != JSON_FORMAT:
            raise WorkbenchError(f"cached tokenizer has format {fmt!r}, this version reads {JSON_FORMAT!r}; delete it to rebuild")
        return cls(
            _Backend.from_str(d["tokenizers_json"]),
            bos_id=d["bos_id"],
            eos_ids=d["eos_ids"],
            add_bos=d["add_bos"],
            vocab_size=d["vocab_size"],
            model=d["model"],
            architecture=d["architecture"],
            special_ids=d["special_ids"],
        )

    # --------------------------------------------------------------------- use
    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Control-token text ("<start_of_turn>") becomes that token. A BOS is
        prepended when `add_bos` (default: the model's `tokenizer.ggml.add_bos_token`)."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise WorkbenchError("add_bos=True but this model names no BOS token")
            return [self.bos_id, *ids]
        return list(ids)

    def encode_batch(self, texts: list[str], add_bos: bool | None = None) -> list[list[int]]:
        bos = self.add_bos if add_bos is None else add_bos
        encs = self._tk.encode_batch(texts, add_special_tokens=False)
        return [([self.bos_id] if bos else []) + list(e.ids) for e in encs]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`. Special tokens (`special_ids`: <bos>, <end_of_turn>, <start_of_image>,
        ...) are left out unless `skip_special=False`, which spells each as its vocabulary text."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        # (the backend's own skip knows only the tokens transformers marked special, not the media markers)
        return self._tk.decode(ids, skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Whether the id stands for no text (see `special_ids`)."""
        return int(token_id) in self.special_ids

    def piece(self, token_id: int) -> str | None:
        """The vocabulary entry of one id, as the backend spells it (e.g. '▁world', '<0xE2>')."""
        return self._tk.id_to_token(int(token_id))

    def token_id(self, piece: str) -> int | None:
        return self._tk.token_to_id(piece)

    def stream(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, arch={self.architecture!r}, vocab={self.vocab_size}, "
            f"bos={self.bos_id}, eos={sorted(self.eos_ids)}, add_bos={self.add_bos})"
        )


class StreamDecoder:
    """Ids in, text increments out; concatenating every `push` and the final `flush` gives
    `tokenizer.decode(all_ids)`.

    It decodes a short window of ids (from the last point where the text was complete) and emits
    only the new characters, holding back while the window's text ends in U+FFFD, i.e. while a
    multi-byte UTF-8 character is still split across byte-fallback tokens. `flush()` emits what is
    held back (e.g. a truly invalid byte sequence, as U+FFFD) at the end of a stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # window start: text before it has been emitted completely
        self._read = 0  # ids before it have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly '')."""
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return text[len(done) :]
        return ""

    def extend(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Return whatever is held back; the stream may continue afterwards."""
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]
