"""Model: GGUF weights and the torch reference forward pass (gemma3 and llama families).

The forward pass takes a list of `Segment`s, each a run of new tokens of one sequence on top
of that sequence's own `KVState`: its block tables into a shared `KVPages` pool and its length.
All rows of all segments run through the dense layers together (weights cross memory once per
step for every slot); attention runs per segment, through its block tables. Decode is a
one-token segment, a prefill chunk a C-token segment, and a speculative verification will be a
k-token segment with `logits="all"`.

Every op is row-invariant (see linear.py and attention.py), so a row's result depends only on
its own sequence: batched equals solo, chunked prefill equals whole prefill, and a paged cache
equals a contiguous one, bitwise, wherever its pages lie.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from .attention import KV_BLOCK, attend, locate, plan_tiles, round_up_capacity, write_rows
from .errors import WorkbenchError
from .gguf_file import GGUFFile, cache_dir
from .linear import linear
from .model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class KVPages:
    """The KV pages of every sequence of one model, one pool per KV group of the state layout
    (workbench/state/layout.py): k [num_pages, layers in the group, n_kv_heads, head_dim, P],
    v [num_pages, layers, n_kv_heads, P, head_dim], float32, P = KV_BLOCK (attention.py's block
    layout, one block a page). Page-major, so a page (all its layers) is one contiguous copy.
    Which page a sequence's positions use is the allocator's business (workbench/state); this
    object only holds the tensors. New pages are uninitialised: attention never lets an unwritten
    position into a sum (attention.py), and `poison` lets a test make sure of it."""

    def __init__(self, layout, num_pages: dict[str, int], n_kv_heads: int, head_dim: int, qsa=None):
        """qsa: a `QSAIndex`'s (config, layers) to keep beside the pages (sparse_attention.py),
        or None."""
        if layout.page_size != KV_BLOCK:
            raise WorkbenchError(f"page_size={layout.page_size} is not allowed here: the torch path's pages are "
                                 f"its attention blocks of {KV_BLOCK} positions")
        self.layout = layout
        self.k = {g.name: torch.empty(num_pages[g.name], len(g.layers), n_kv_heads, head_dim, KV_BLOCK)
                  for g in layout.groups}
        self.v = {g.name: torch.empty(num_pages[g.name], len(g.layers), n_kv_heads, KV_BLOCK, head_dim)
                  for g in layout.groups}
        # layer -> (its group, its index within the group's layers)
        self.where = {li: (g.name, j) for g in layout.groups for j, li in enumerate(g.layers)}
        self.index = None  # the QSA indexer's block summaries, page by page (sparse_attention.py)
        # group -> float64 [pages]: the attention mass each page received since it was last read
        # (eviction="scored"; `track_mass`); empty: not measured
        self.mass: dict[str, torch.Tensor] = {}
        if qsa is not None:
            from .sparse_attention import QSAIndex

            self.index = QSAIndex(qsa[0], qsa[1], layout, num_pages, n_kv_heads, head_dim)

    def track_mass(self) -> None:
        """Measure each page's attention mass from now on (dense attention rows; a QSA layer's
        sparse rows add none)."""
        self.mass = {name: torch.zeros(k.shape[0], dtype=torch.float64) for name, k in self.k.items()}

    def take_mass(self, group: str, pages) -> list[float]:
        """The mass `pages` of `group` received since their last read; zeroed by the read."""
        idx = torch.as_tensor(list(pages), dtype=torch.int64)
        got = self.mass[group][idx].tolist()
        self.mass[group][idx] = 0.0
        return got

    @property
    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())
        return own + (self.index.nbytes if self.index is not None else 0)

    def num_pages(self, group: str) -> int:
        return self.k[group].shape[0]

    def copy(self, copies) -> None:
        """Run the allocator's `PageCopy`s (copy-on-write, fork): positions [0, n) of page src
        to page dst in every layer of the group."""
        for c in copies:
            n = c.num_positions
            self.k[c.group][c.dst, ..., :n] = self.k[c.group][c.src, ..., :n]
            self.v[c.group][c.dst, :, :, :n] = self.v[c.group][c.src, :, :, :n]
            if self.index is not None:
                self.index.copy(c.group, c.src, c.dst, n)

    def poison(self, group: str, pages, value: float = float("nan")) -> None:
        """Fill pages with `value` (tests: a stale page must never reach an output)."""
        idx = torch.as_tensor(list(pages), dtype=torch.int64)
        self.k[group][idx] = value
        self.v[group][idx] = value
        if self.index is not None:
            self.index.poison(group, idx, value)


@dataclass
class KVState:
    """One sequence's view of a `KVPages` pool: per KV group its block table (int64 page ids by
    logical page, -1 for a page a sliding window has dropped) and the positions written so far.
    The tables must cover every position a forward writes (the allocator appends first)."""

    pages: KVPages
    tables: dict[str, torch.Tensor]
    length: int = 0

    @property
    def capacity(self) -> int:
        return min(len(t) for t in self.tables.values()) * KV_BLOCK

    def reset(self) -> None:
        # Stale rows are never read into a sum (attention.py), so no clearing is needed.
        self.length = 0


@dataclass
class Segment:
    state: KVState
    tokens: Sequence[int]
    logits: Literal["last", "all", "none"] = "last"


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffw_norm: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(positions: torch.Tensor, base: float, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, 1, D/2] for a position vector; computed once per forward per base."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    ang = positions.float()[:, None] * inv_freq[None, :]  # [R, D/2]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], neox: bool) -> torch.Tensor:
    """Rotary embedding with a position vector: x [R, H, D], tables from rope_tables."""
    d = x.shape[-1]
    cos, sin = tables
    if neox:
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


class Model:
    """A loaded model: config, tokenizer, weights, and `forward` over segments."""

    def __init__(self, config: ModelConfig, tokenizer, layers, embed_raw, embed_qtype, head, output_norm, dtype, source):
        self.config = config
        self.tokenizer = tokenizer
        self.layers: list[Layer] = layers
        self.embed_raw = embed_raw  # uint8 [vocab, bytes_per_row], rows gathered then dequantized
        self.embed_qtype = embed_qtype
        self.head = head  # [vocab, n_embd] in compute dtype
        self.output_norm = output_norm
        self.dtype = dtype
        self.source = source  # GGUFFile

    # ---- public convenience API -------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        return {v: k for k, v in DTYPES.items()}[self.dtype]

    @property
    def path(self) -> Path:
        return self.source.path

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; control and media-marker tokens are left out unless `skip_special=False`."""
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    @property
    def state_layout(self):
        """The KV groups of this model's sequence state (float32 KV, 256-position pages)."""
        from .state import StateLayout

        return StateLayout.from_model_config(self.config, kv_bytes_per_elem=4, page_size=KV_BLOCK)

    def new_pages(self, num_pages: dict[str, int], qsa=None) -> KVPages:
        """Page pools per KV group; qsa: a QSAConfig (workbench/qsa.py) whose indexer the pages
        carry, its layers resolved for this model, or None (dense attention)."""
        c = self.config
        return KVPages(self.state_layout, num_pages, c.n_kv_heads, c.head_dim,
                       None if qsa is None else (qsa, qsa.resolve_layers(c)))

    def new_state(self, capacity: int | None = None, qsa=None) -> KVState:
        """A sequence in a private pool of its own: pages 0..n-1 in order (a contiguous cache
        is the identity block table), for `logits()` and tests; qsa as new_pages."""
        nb = round_up_capacity(capacity or self.config.context_length) // KV_BLOCK
        pages = self.new_pages({name: nb for name in self.state_layout.group_names}, qsa)
        return KVState(pages, {name: torch.arange(nb) for name in pages.k})

    @torch.inference_mode()
    def logits(self, ids: Sequence[int], chunk: int = 512, qsa=None) -> torch.Tensor:
        """Teacher-forced float32 logits [len(ids), vocab]; qsa: a QSAConfig, or None (dense)."""
        ids = list(ids)
        if not ids:
            raise WorkbenchError("logits() needs at least one token id")
        if len(ids) > self.config.context_length:
            raise WorkbenchError(
                f"{len(ids)} tokens do not fit the context of {self.config.context_length} tokens"
            )
        state = self.new_state(len(ids), qsa)
        rows = []
        for s in range(0, len(ids), chunk):
            rows.append(self.forward([Segment(state, ids[s : s + chunk], "all")])[0])
        return torch.cat(rows)

    # ---- the forward pass -------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        from .quants import dequantize_rows

        x = dequantize_rows(self.embed_raw, self.embed_qtype, ids, self.config.n_embd)
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    def layer_qkv(self, li: int, x: torch.Tensor, ropes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer li's queries [R, H, D], keys and values [R, Hkv, D] of the residual rows x, as
        attention sees them (norms and rope applied); ropes: rope_tables by rope base. One
        copy of the ops, shared with the compression scorer (compression.py), so the two stay
        bitwise equal."""
        c, layer = self.config, self.layers[li]
        rows, h_q, h_kv, d = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        h = rms_norm(x, layer.attn_norm, c.rms_eps)
        qkv = linear(h, layer.wqkv)
        q = qkv[:, : c.q_dim].reshape(rows, h_q, d)
        k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(rows, h_kv, d)
        v = qkv[:, c.q_dim + c.kv_dim :].reshape(rows, h_kv, d)
        if c.qk_norm:
            q = rms_norm(q, layer.q_norm, c.rms_eps)
            k = rms_norm(k, layer.k_norm, c.rms_eps)
        tables = ropes[c.layer_rope_base(li)]
        return rope(q, tables, c.rope_neox), rope(k, tables, c.rope_neox), v

    def layer_out(self, li: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual rows after layer li, from its attention output attn [R, H, D]: output
        projection, FFN, their post-norms where the family has them."""
        c, layer = self.config, self.layers[li]
        o = linear(attn.view(x.shape[0], c.n_heads * c.head_dim), layer.wo)
        if c.post_norms:
            o = rms_norm(o, layer.post_attn_norm, c.rms_eps)
        x = x + o
        h = rms_norm(x, layer.ffn_norm, c.rms_eps)
        gu = linear(h, layer.w_gate_up)
        gate, up = gu[:, : c.n_ff], gu[:, c.n_ff :]
        act = F.gelu(gate, approximate="tanh") if c.activation == "gelu_tanh" else F.silu(gate)
        dn = linear(act * up, layer.w_down)
        if c.post_norms:
            dn = rms_norm(dn, layer.post_ffw_norm, c.rms_eps)
        return x + dn

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """Run all segments as one step; returns each segment's requested float32 logits."""
        c = self.config
        spans, pos_parts, ids = [], [], []
        for seg in segments:
            n = len(seg.tokens)
            if n == 0:
                raise WorkbenchError("a segment needs at least one token")
            start = seg.state.length
            if start + n > seg.state.capacity:
                raise WorkbenchError(
                    f"sequence of {start + n} tokens exceeds its KV capacity of {seg.state.capacity}"
                )
            spans.append((len(ids), n, start))
            ids.extend(seg.tokens)
            pos_parts.append(torch.arange(start, start + n, dtype=torch.int64))
        rows = len(ids)
        positions = torch.cat(pos_parts)
        x = self.embed(torch.tensor(ids, dtype=torch.int64))
        h_q, d = c.n_heads, c.head_dim
        # Everything that depends only on positions is computed once per forward, not per layer.
        ropes = {b: rope_tables(positions, b, d) for b in {c.layer_rope_base(i) for i in range(c.n_layers)}}
        tiles = {
            w: [plan_tiles(positions[r0 : r0 + n], w) for (r0, n, _) in spans]
            for w in {c.layer_window(i) for i in range(c.n_layers)}
        }
        rows_at = [{g: locate(t, start, n) for g, t in seg.state.tables.items()}
                   for seg, (_, n, start) in zip(segments, spans)]
        for at, (_, n, start) in zip(rows_at, spans):
            if any(bool((page < 0).any()) for page, _ in at.values()):
                raise WorkbenchError(f"positions {start}..{start + n - 1} fall in a dropped page: "
                                     f"a block table must hold every position a forward writes")
        for li in range(len(self.layers)):
            q, k, v = self.layer_qkv(li, x, ropes)
            attn = torch.empty(rows, h_q, d)
            window = c.layer_window(li)
            for si, (seg, (r0, n, start)) in enumerate(zip(segments, spans)):
                group, j = seg.state.pages.where[li]
                kc, vc = seg.state.pages.k[group][:, j], seg.state.pages.v[group][:, j]
                write_rows(kc, vc, start, k[r0 : r0 + n], v[r0 : r0 + n], rows_at[si][group])
                index = seg.state.pages.index
                if index is not None and li in index.where:  # QSA: sparse past the boundary
                    index.update(li, kc, seg.state.tables[group], start, n)
                    attn[r0 : r0 + n] = index.attend(li, q[r0 : r0 + n], kc, vc, positions[r0 : r0 + n], c.attn_scale,
                                                     seg.state.tables[group], tiles[window][si])
                    continue
                attn[r0 : r0 + n] = attend(
                    q[r0 : r0 + n], kc, vc, positions[r0 : r0 + n], window, c.attn_scale, tiles[window][si],
                    seg.state.tables[group], mass=seg.state.pages.mass.get(group),
                )
            x = self.layer_out(li, x, attn)
        for seg, (r0, n, start) in zip(segments, spans):
            seg.state.length = start + n
        # the output head only for rows whose logits were asked for
        want = []
        for seg, (r0, n, _) in zip(segments, spans):
            if seg.logits == "all":
                want.append(torch.arange(r0, r0 + n))
            elif seg.logits == "last":
                want.append(torch.tensor([r0 + n - 1]))
        if not want:
            return [None] * len(segments)
        sel = torch.cat(want)
        hx = rms_norm(x[sel], self.output_norm, c.rms_eps)
        logits = linear(hx, self.head)
        out, i = [], 0
        for seg, (r0, n, _) in zip(segments, spans):
            k = n if seg.logits == "all" else 1 if seg.logits == "last" else 0
            out.append(logits[i : i + k] if k else None)
            i += k
        return out


# ---- loading ----------------------------------------------------------------------------------

def _tensor(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized; load_model has already refused unsupported quant types."""
    from .quants import dequantize
    import gguf

    if name not in g.tensors:
        raise WorkbenchError(f"{g.path.name} lacks tensor '{name}', which a {g.architecture} model requires")
    t = g.tensors[name]
    w = dequantize(g.raw(name), gguf.GGMLQuantizationType(t.qtype), t.shape)
    return w if dtype == torch.float32 else w.to(dtype)


def _load_tokenizer(g: GGUFFile):
    from .atomic import atomic_write_text
    from .tokenizer import Tokenizer

    cfile = cache_dir() / "tokenizers" / f"{g.index.sha256}.json"
    if cfile.exists():
        try:
            return Tokenizer.from_json(cfile.read_text())
        except Exception:
            pass
    tok = Tokenizer.from_metadata(g.metadata)
    atomic_write_text(cfile, tok.to_json())
    return tok


def load_model(path: str | Path | GGUFFile | None = None, *, dtype: str = "bfloat16") -> Model:
    """Load a GGUF model (the embedded Gemma 3 270M default when `path` is None).

    dtype: "bfloat16" (fast CPU path) or "float32" (the path checked against transformers).
    """
    import gguf

    from .quants import SUPPORTED, bytes_per_row

    if dtype not in DTYPES:
        raise WorkbenchError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    if path is None:
        from .default_model import default_model_path

        path = default_model_path()
    g = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(g.metadata, set(g.tensors))
    tdt = DTYPES[dtype]
    for name, t in g.tensors.items():
        if gguf.GGMLQuantizationType(t.qtype) not in SUPPORTED:
            names = ", ".join(sorted(s.name for s in SUPPORTED))
            raise WorkbenchError(
                f"tensor {name} has quant type {t.qtype_name}, which is not supported; supported: {names}"
            )
    tok = _load_tokenizer(g)

    def w(name):
        return _tensor(g, name, tdt)

    def f32(name):
        return _tensor(g, name, torch.float32)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layer = Layer(
            attn_norm=f32(p + "attn_norm.weight"),
            wqkv=torch.cat([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]),
            wo=w(p + "attn_output.weight"),
            ffn_norm=f32(p + "ffn_norm.weight"),
            w_gate_up=torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
            w_down=w(p + "ffn_down.weight"),
        )
        if cfg.qk_norm:
            layer.q_norm = f32(p + "attn_q_norm.weight")
            layer.k_norm = f32(p + "attn_k_norm.weight")
        if cfg.post_norms:
            layer.post_attn_norm = f32(p + "post_attention_norm.weight")
            layer.post_ffw_norm = f32(p + "post_ffw_norm.weight")
        layers.append(layer)
    emb = g.tensors["token_embd.weight"]
    emb_q = gguf.GGMLQuantizationType(emb.qtype)
    with warnings.catch_warnings():  # a read-only file mapping; never written
        warnings.simplefilter("ignore", UserWarning)
        embed_raw = torch.from_numpy(g.raw("token_embd.weight"))
    embed_raw = embed_raw.view(emb.shape[0], bytes_per_row(emb_q, emb.shape[1]))
    head = w("output.weight") if not cfg.tied_output else w("token_embd.weight")
    if cfg.vocab_size != emb.shape[0]:
        cfg = ModelConfig(**{**cfg.__dict__, "vocab_size": emb.shape[0]})
    return Model(cfg, tok, layers, embed_raw, emb_q, head, f32("output_norm.weight"), tdt, g)


def load_draft(path: str, target: Model, *, what: str, field: str) -> Model:
    """The GGUF at `path` loaded as a draft of `target` (at its dtype): refused, from its
    metadata before its weights load, unless it has the target's vocabulary, since a token id
    must mean the same token to both. `what` names the draft in the errors (e.g. "draft
    scorer"), `field` the option that gave the path."""
    import os

    if not isinstance(path, str) or not os.path.isfile(path):
        raise WorkbenchError(f"{field}={path!r} is not a file: allowed a path to a .gguf file")
    draft = GGUFFile.open(path)
    tokens, own = draft.get("tokenizer.ggml.tokens"), target.source.get("tokenizer.ggml.tokens")
    if tokens is None or list(tokens) != list(own):
        size = "no" if tokens is None else len(tokens)
        raise WorkbenchError(f"the {what} {os.path.basename(path)} has another vocabulary ({size} tokens) than the "
                             f"model ({len(own)} tokens): allowed a draft with the same tokenizer")
    return load_model(draft, dtype=target.dtype_name)


def first_layers(model: Model, num_layers: int) -> Model:
    """A view of `model` as its first `num_layers` layers, then its own output norm and head
    (a self-draft, layer skip from the top): every tensor is the target's, nothing is copied."""
    c = model.config
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < c.n_layers:
        raise WorkbenchError(f"draft_layers={num_layers!r} is out of range for this model: allowed an integer "
                             f"1..{c.n_layers - 1} (it has {c.n_layers} layers)")
    from dataclasses import replace

    cfg = replace(c, n_layers=num_layers, swa_layers=c.swa_layers[:num_layers])
    return Model(cfg, model.tokenizer, model.layers[:num_layers], model.embed_raw, model.embed_qtype, model.head,
                 model.output_norm, model.dtype, model.source)
