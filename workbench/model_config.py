"""ModelConfig: the architecture facts of a model, built from GGUF metadata.

Some Gemma 3 facts are not in the GGUF and come from the architecture itself (llama.cpp's
implementation states them the same way): sliding-window layers use rope base 10,000 and every
sixth layer is global; the query scale is 1/sqrt(head_dim); input embeddings are scaled by
sqrt(n_embd); RMSNorm weights are stored with the +1 already folded in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import WorkbenchError

SUPPORTED_ARCHITECTURES = ("gemma3", "llama")
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_base_local: float
    rope_neox: bool  # gemma: rotate halves (NEOX); llama GGUF: rotate adjacent pairs
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]
    embed_scale: float
    attn_scale: float
    qk_norm: bool
    post_norms: bool
    activation: str  # "gelu_tanh" | "silu"
    tied_output: bool

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise WorkbenchError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if len(self.swa_layers) != self.n_layers:
            raise WorkbenchError("swa_layers must have one entry per layer")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        return self.sliding_window if self.swa_layers[layer] else 0

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_local if self.swa_layers[layer] else self.rope_base

    def kv_bytes_per_token(self, bytes_per_elem: int = 4) -> int:
        return 2 * self.n_layers * self.kv_dim * bytes_per_elem

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = str(md.get("general.architecture", "<missing>"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise WorkbenchError(
                f"architecture '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str):
            full = f"{arch}.{key}"
            if full not in md:
                raise WorkbenchError(f"GGUF metadata lacks '{full}', which a {arch} model requires")
            return md[full]

        n_layers = int(need("block_count"))
        n_embd = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        n_kv = int(md.get(f"{arch}.attention.head_count_kv", n_heads))
        head_dim = int(md.get(f"{arch}.attention.key_length", n_embd // n_heads))
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = int(md.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
        common = dict(
            arch=arch,
            n_layers=n_layers,
            n_embd=n_embd,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            n_ff=int(need("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(need("context_length")),
            rms_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(md.get(f"{arch}.rope.freq_base", 10_000.0)),
            tied_output="output.weight" not in tensor_names,
        )
        if arch == "gemma3":
            window = int(md.get("gemma3.attention.sliding_window", 0))
            swa = tuple(window > 0 and (i % GEMMA3_SWA_PATTERN) < GEMMA3_SWA_PATTERN - 1 for i in range(n_layers))
            return cls(
                **common,
                rope_base_local=GEMMA3_LOCAL_ROPE_BASE,
                rope_neox=True,
                sliding_window=window,
                swa_layers=swa,
                embed_scale=math.sqrt(n_embd),
                attn_scale=1.0 / math.sqrt(head_dim),
                qk_norm=True,
                post_norms=True,
                activation="gelu_tanh",
            )
        return cls(
            **common,
            rope_base_local=common["rope_base"],
            rope_neox=False,
            sliding_window=0,
            swa_layers=(False,) * n_layers,
            embed_scale=1.0,
            attn_scale=1.0 / math.sqrt(head_dim),
            qk_norm=False,
            post_norms=False,
            activation="silu",
        )
