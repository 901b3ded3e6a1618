"""Small random-weight GGUF models, written with the `gguf` package's writer.

Tests, notebooks and benchmarks use these where a real model is not the point: they load
through exactly the same path as a downloaded GGUF (metadata, tokenizer, quantized tensors).
The tokenizer is a tiny SentencePiece-style vocabulary (byte fallback plus a few words), in the
same "llama" tokenizer model Gemma uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or his which "
    "slot batch token cache decode prefill exact model page draft tree verify chunk memory"
).split()


@dataclass(frozen=True)
class SyntheticSpec:
    arch: str = "llama"  # "llama" | "gemma3"
    n_layers: int = 2
    n_embd: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    n_ff: int = 256
    context_length: int = 2048
    sliding_window: int = 64  # gemma3 only
    weight_type: str = "Q8_0"  # "F32" | "F16" | "Q8_0" | "Q5_0" | "Q4_0"
    seed: int = 0
    # per-tensor overrides of weight_type, as (name suffix, type) pairs: (("attn_v.weight", "Q8_0"),)
    # makes every V projection Q8_0 (as quantizers mix formats, Gemma 3 270M's q4_k_m file among them)
    tensor_types: tuple[tuple[str, str], ...] = ()


# Gemma 3 270M's layer shapes (18 layers, 5 sliding to 1 global, 4 query heads on 1 KV head of 256,
# a 512-key window, 32K context) with random Q8_0 weights and the tiny vocabulary: for timing the
# attention and indexer work of long-context decode where the real file is not on the machine (its
# vocabulary's LM head, 262,144 rows, is the one part of a step it leaves out).
GEMMA3_270M_SHAPES = SyntheticSpec(arch="gemma3", n_layers=18, n_embd=640, n_heads=4, n_kv_heads=1, head_dim=256,
                                   n_ff=2048, context_length=32768, sliding_window=512, weight_type="Q8_0")


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<pad>", "</s>", "<s>", "<unk>"]
    types = [3, 3, 3, 2]  # control, control, control, unknown
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # byte
    pieces = []
    for w in WORDS:
        pieces += ["\u2581" + w, w]
    pieces += ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz.,!?") + ["\u2581"]
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(1)
    scores = [0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)]
    return tokens, scores, types


def write_random_gguf(path: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    import gguf

    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, scores, types = _vocab()
    vocab = len(tokens)
    arch = spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_sliding_window(spec.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)

    qtype0 = gguf.GGMLQuantizationType[spec.weight_type]

    def add(name: str, shape: tuple[int, ...], scale: float, quantize: bool = True, offset: float = 0.0):
        data = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        qtype = next((gguf.GGMLQuantizationType[t] for sfx, t in spec.tensor_types if name.endswith(sfx)), qtype0)
        if not quantize or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    e, d = spec.n_embd, spec.head_dim
    norm_offset = 1.0  # GGUF norm weights are around 1 (gemma folds its +1 in at conversion)
    add("token_embd.weight", (vocab, e), 1.0 if arch == "llama" else 0.05)
    add("output_norm.weight", (e,), 0.1, quantize=False, offset=norm_offset)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (e,), 0.1, quantize=False, offset=norm_offset)
        add(p + "attn_q.weight", (spec.n_heads * d, e), e**-0.5)
        add(p + "attn_k.weight", (spec.n_kv_heads * d, e), e**-0.5)
        add(p + "attn_v.weight", (spec.n_kv_heads * d, e), e**-0.5)
        add(p + "attn_output.weight", (e, spec.n_heads * d), (spec.n_heads * d) ** -0.5)
        add(p + "ffn_norm.weight", (e,), 0.1, quantize=False, offset=norm_offset)
        add(p + "ffn_gate.weight", (spec.n_ff, e), e**-0.5)
        add(p + "ffn_up.weight", (spec.n_ff, e), e**-0.5)
        add(p + "ffn_down.weight", (e, spec.n_ff), spec.n_ff**-0.5)
        if arch == "gemma3":
            add(p + "attn_q_norm.weight", (d,), 0.1, quantize=False, offset=norm_offset)
            add(p + "attn_k_norm.weight", (d,), 0.1, quantize=False, offset=norm_offset)
            add(p + "post_attention_norm.weight", (e,), 0.1, quantize=False, offset=norm_offset)
            add(p + "post_ffw_norm.weight", (e,), 0.1, quantize=False, offset=norm_offset)
    path.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
