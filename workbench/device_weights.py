"""The model's weights on the device, as `TritonRunner` multiplies them.

Each GGUF tensor goes to the device as its own blocks (never dequantized), regrouped once into
packed planes (`kernels.qmatmul.pack_weights`, same bits); only the embedding table (and a tied
head beside its planes) keeps its GGUF bytes, for the embedding gather.
Each weight gets the product kernel it will always take (its `form`), chosen here by format
and role, never by the row count of a call: that is what keeps a row's result independent of
the batch. Same-format projections of one input are fused by concatenating rows (q|k|v when
all one format, gate|up), each member writing its column range of one partial buffer.

Llama GGUF rope rotates adjacent pairs; the kernels rotate (i, i + D/2). Permuting the rows of
W_q and W_k (and of the QK-norm weights) inside each head turns one into the other: q.k is
unchanged by a common permutation of q and k, and V is not permuted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import WorkbenchError
from .model import Model


@dataclass
class QWeight:
    raw: torch.Tensor | None  # uint8 [N, row_bytes] GGUF blocks on the device (None once packed, but the table's)
    fmt: object  # kernels.quant_tiles.QuantFormat
    N: int
    K: int
    splits: int
    k_split: int = 0  # weights per K slice where splits > 1 (its product's: kernels.qmatmul.k_slice)
    packed: object = None  # kernels.qmatmul.PackedWeight (None: the embedding table, the dense head)
    form: str = "gather"  # the product kernel this weight always takes: "mma" or "gemv", the head's
    # "dense" or "q8i8"; "gather": the embedding table (its GGUF bytes, gathered by row)
    dense: torch.Tensor | None = None  # form "dense" (the head): the dequantized [N, K] for kernels.dense_mma


@dataclass
class Proj:
    """One product x @ [W_0; W_1; ...]^T: same-format members fused, each written into its
    column range of one partial buffer [splits, M, N]."""

    parts: list[tuple[int, QWeight]]
    N: int
    K: int
    splits: int
    dense: torch.Tensor | None = None  # bf16 [N, K] for dense="cublas_bf16"


@dataclass
class DevLayer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: Proj
    wo: Proj
    gate_up: Proj
    down: Proj
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffw_norm: torch.Tensor | None = None


@dataclass
class DeviceWeights:
    layers: list[DevLayer]
    embed: QWeight  # raw blocks, for the embedding gather
    head: Proj  # one member, unsplit (the logits are written directly): the dense copy or packed planes
    output_norm: torch.Tensor
    nbytes: int  # device bytes of all of the above
    step_bytes: int  # what one decode step reads: all but the embedding table (rows are gathered)

    layer_bytes: tuple[int, ...] = ()  # device bytes of each layer (all read by every step)

    def first_layers(self, num_layers: int) -> "DeviceWeights":
        """The first `num_layers` layers with this embedding, output norm and head, sharing
        every tensor (a self-draft's weights: no new device bytes)."""
        step = self.step_bytes - sum(self.layer_bytes[num_layers:])
        return DeviceWeights(self.layers[:num_layers], self.embed, self.head, self.output_norm, 0, step,
                             self.layer_bytes[:num_layers])


def load_device_weights(model: Model, device: torch.device, *, layer_forms: dict[str, str],
                        head_form: str, dense: str = "quant") -> DeviceWeights:
    """Every weight of ``model`` on ``device`` in the runner's layout. ``layer_forms``: the
    layers' form per format ("mma" or "gemv"; a format not named takes "mma"), ``head_form``: the
    head's ("dense": dequantized once, for ``kernels.dense_mma``; "q8i8": a Q8_0 head's packed
    planes for ``kernels.dense_mma.q8i8_mma``).
    ``dense="cublas_bf16"`` also keeps bf16 copies for the non-invariant comparison variant."""
    from .kernels import qmatmul as qm
    from .kernels.quant_tiles import FORMATS

    c = model.config
    g = model.source
    if head_form not in ("dense", "q8i8"):
        raise WorkbenchError(f"head_form={head_form!r} is not allowed: allowed dense, q8i8")
    d = c.head_dim
    perm = None if c.rope_neox else torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    nbytes = 0

    def raw(name: str, heads: int | None = None) -> QWeight:
        if name not in g.tensors:
            raise WorkbenchError(f"{g.path.name} lacks tensor '{name}', which backend='triton' needs")
        t = g.tensors[name]
        fmt = FORMATS.get(t.qtype_name)
        if fmt is None:
            raise WorkbenchError(
                f"backend='triton': tensor {name} has quant type {t.qtype_name}; the Triton "
                f"kernels read {', '.join(FORMATS)} (use backend='torch')")
        n, k = t.shape
        if k % fmt.block_size:
            raise WorkbenchError(f"tensor {name}: K={k} is not a multiple of the {fmt.name} block size")
        b = torch.from_numpy(np.ascontiguousarray(g.raw(name))).view(n, fmt.row_bytes(k))
        if heads is not None and perm is not None:
            b = b[(torch.arange(heads)[:, None] * d + perm[None, :]).reshape(-1)]
        return QWeight(b, fmt, n, k, qm.num_k_splits(n, k))

    def proj(names: list[tuple[str, int | None]], dense_w: torch.Tensor | None) -> Proj:
        nonlocal nbytes
        ws = [raw(n, h) for n, h in names]
        K = ws[0].K
        parts: list[tuple[int, QWeight]] = []
        off = 0
        for w in ws:  # fuse consecutive members of one format
            if parts and parts[-1][1].fmt.name == w.fmt.name:
                o, p = parts[-1]
                parts[-1] = (o, QWeight(torch.cat([p.raw, w.raw]), p.fmt, p.N + w.N, K, 0))
            else:
                parts.append((off, w))
            off += w.N
        # one K slice for the product (its members write one partial buffer), by its shape and formats
        ks = qm.k_slice(off, K, tuple(w.fmt.name for _, w in parts))
        splits = -(-K // ks)
        for _, w in parts:
            w.splits, w.k_split = splits, ks
            w.packed = qm.pack_weights(w.raw.contiguous().to(device), w.fmt.name, w.N, K, k_split=ks)
            w.raw = None
            w.form = layer_forms.get(w.fmt.name, "mma")
            nbytes += w.packed.nbytes
        dw = dense_w.to(torch.bfloat16).to(device) if dense == "cublas_bf16" else None
        return Proj(parts, off, K, splits, dw)

    def vec(t: torch.Tensor | None, permute: bool = False) -> torch.Tensor | None:
        nonlocal nbytes
        if t is None:
            return None
        t = t.float()
        if permute and perm is not None:
            t = t[perm]
        nbytes += 4 * t.numel()
        return t.contiguous().to(device)

    def perm_rows(w: torch.Tensor) -> torch.Tensor:  # the fused dense qkv, for dense="cublas_bf16"
        if perm is None:
            return w
        idx = torch.cat([
            (torch.arange(c.n_heads)[:, None] * d + perm[None, :]).reshape(-1),
            c.q_dim + (torch.arange(c.n_kv_heads)[:, None] * d + perm[None, :]).reshape(-1),
            torch.arange(c.q_dim + c.kv_dim, c.q_dim + 2 * c.kv_dim),
        ])
        return w[idx]

    layers, layer_bytes = [], []
    for i, L in enumerate(model.layers):
        p = f"blk.{i}."
        before = nbytes
        layers.append(DevLayer(
            attn_norm=vec(L.attn_norm), ffn_norm=vec(L.ffn_norm),
            qkv=proj([(p + "attn_q.weight", c.n_heads), (p + "attn_k.weight", c.n_kv_heads),
                      (p + "attn_v.weight", None)], perm_rows(L.wqkv) if dense != "quant" else None),
            wo=proj([(p + "attn_output.weight", None)], L.wo),
            gate_up=proj([(p + "ffn_gate.weight", None), (p + "ffn_up.weight", None)], L.w_gate_up),
            down=proj([(p + "ffn_down.weight", None)], L.w_down),
            q_norm=vec(L.q_norm, True), k_norm=vec(L.k_norm, True),
            post_attn_norm=vec(L.post_attn_norm), post_ffw_norm=vec(L.post_ffw_norm),
        ))
        layer_bytes.append(nbytes - before)
    output_norm = vec(model.output_norm)
    emb = raw("token_embd.weight")
    emb.raw = emb.raw.to(device)
    nbytes += emb.raw.numel()
    table_bytes = emb.raw.numel()
    if c.tied_output:
        head = QWeight(emb.raw, emb.fmt, emb.N, emb.K, 1)
    else:
        head = raw("output.weight")
        head.raw = head.raw.to(device)
    head.splits = 1  # one K pass: the logits are written directly (a shape-only choice)
    if head_form == "dense":  # the values the packed decode makes (bf16(d * q)), once
        head.dense = model.head.to(device).contiguous()  # (the model's compute dtype: the products' precision)
        head.form = "dense"
        nbytes += head.dense.numel() * head.dense.element_size()
    elif head.fmt.name != "Q8_0":
        raise WorkbenchError(f"head_matmul='q8i8' reads a Q8_0 head; this head is {head.fmt.name}: allowed dense")
    else:  # (tied: a packed copy beside the embedding's raw bytes)
        head.packed = qm.pack_weights(head.raw, head.fmt.name, head.N, head.K)
        head.form = "q8i8"
        nbytes += head.packed.nbytes
    if not c.tied_output:
        head.raw = None
    dense_head = None
    if dense != "quant":  # (the same bf16 tensor as the dense head's where there is one)
        same = head.dense is not None and head.dense.dtype == torch.bfloat16
        dense_head = head.dense if same else model.head.to(torch.bfloat16).to(device)
    return DeviceWeights(layers, emb, Proj([(0, head)], head.N, head.K, 1, dense_head), output_norm, nbytes,
                         nbytes - table_bytes, tuple(layer_bytes))


def head_qtype(model: Model) -> str | None:
    """The GGUF type name of the output head's tensor (the token embedding where tied), or None."""
    t = model.source.tensors.get("token_embd.weight" if model.config.tied_output else "output.weight")
    return None if t is None else t.qtype_name

