"""Prompt compression before admission (PFlash): keep the blocks of a long prompt that its end
attends to, and admit that shorter prompt instead.

    kept = compress(model, prompt_ids, 0.25, CompressionOptions())
    kept.kept_ids          # sinks + the best-scored blocks, in order + the tail (the question)

How a prompt is scored: a scorer model (the target's own first K layers, or a draft GGUF of the
same vocabulary) runs over the whole prompt; at each of its full-attention layers among those K
the last W prompt tokens (the query window, normally the question) attend to every earlier
token; their attention probabilities, summed over heads, window rows and layers, score each
token; tokens are pooled into fixed blocks and the best blocks are kept whole, in their
original order. The first `sink_tokens` tokens and the window are always kept. Ties go to the
earlier block, so the result is a function of the prompt alone.

The kept tokens are a new, dense prompt (positions 0..n-1): compression changes what the
engine is asked, not how it serves it, so the compressed request is bitwise the request
submitted with `kept_ids` directly. It is lossy by design; `compression_quality.py` measures
how far the continuation moves.

Where the scorer runs (`CompressionOptions.device`): "cpu" is the torch reference path, bitwise
`Model.logits`'s layers; "cuda" runs the same layer ops (`Model.layer_qkv`, `layer_out`) on the
GPU with attention by `scaled_dot_product_attention` (`DeviceScorer`): not the CPU's bits, but a
function of the prompt on given hardware, and seconds faster at 32K tokens, where the CPU
scorer takes most of a request's time to first token. "auto" (the default) is "cuda" when the
engine serves on a GPU (backend="triton" with CUDA present) and "cpu" otherwise (the torch
backend, or the Triton interpreter).

The options and `check_ratio` import no torch (EngineConfig holds them, and the scheduler
imports EngineConfig); the scorer imports it when it runs.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from .errors import ConfigError, WorkbenchError, refuse_unknown_keys

__all__ = ["CompressedPrompt", "CompressionOptions", "DeviceScorer", "PromptCompressor", "ScoreSummary", "check_ratio",
           "compress", "load_scorer", "run_layers", "rank_blocks", "scorer_device", "scoring_layers", "select_blocks",
           "window_probability", "window_scores"]

SCORERS = ("target", "draft")
POOLS = ("mean", "max")
SCORE_LAYERS = ("global", "all")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CompressionOptions:
    # "target": the served model's own first `num_layers` layers; "draft": a draft GGUF at
    # `draft_path` (same vocabulary), its first `num_layers` layers
    scorer: str = "target"
    draft_path: str | None = None
    # The scorer runs its first num_layers layers (capped at its depth); of those, the ones of
    # `score_layers` score: "global" its full-attention layers (all of them in a model without
    # sliding windows), "all" every one. The defaults as measured on Gemma 3 270M
    # (data/compression/needle_scorer.parquet, scripts/compression_quality.py: needle prompts of
    # ~2K and ~4K tokens, 3 seeds x 5 depths, ratio 0.25, window 32, max pooling, spread 8):
    # scored by the sliding layers 0-3 or 0-4, the needle's block ranks at 0.36-0.41 of the
    # blocks on average (chance is 0.5: they never attend that far) and the code survives in
    # 10-12 of 30 prompts; by the first global layer (5) alone, in the top 3.2% at worst and 30
    # of 30; all of layers 0-5, top 18% at worst (the sliding layers dilute it); adding global
    # layer 11 gains nothing (4.8%). So: six layers, the shortest prefix holding a global layer;
    # the scorer then costs ~5.5/18 of a prefill without the output head (0.6 s for 2K tokens,
    # 1.4 s for 4K on this 2-core CPU; data/compression/needle_quality.parquet, scorer_s).
    num_layers: int = 6
    score_layers: str = "global"
    # the last W prompt tokens: their attention scores the prompt; always kept. 32 holds a short
    # question (the needle's is ~22 tokens); 16 and 64 score as well on layer 5 (same table)
    window: int = 32
    block_size: int = 32  # tokens are kept in whole blocks of this many
    sink_tokens: int = 4  # the first tokens, always kept (attention sinks, the BOS)
    # a block's score from its tokens' scores: "max" or "mean" (they tie on the table above;
    # max since a fact is a few tokens of its block, and mean divides it by the rest)
    pool: str = "max"
    # a token's score also counts for the tokens within this many of it, before blocks are
    # pooled, so that a fact cut by a block boundary keeps both halves (a 6-digit code is 6
    # tokens on Gemma 3; without it, 29 of 30 codes survive on the table above); 0: off
    spread: int = 8
    # "auto": prompts shorter than this are left whole; longer ones keep about auto_kept_tokens
    # (seed 002 kept ~2K of 38K-45K-token prompts)
    auto_min_tokens: int = 8192
    auto_kept_tokens: int = 2048
    chunk_size: int = 512  # prompt rows per pass of the scorer (bounds its activations only)
    # where the scorer runs: "cpu", "cuda" or "auto" (the engine's device; module docstring)
    device: str = "auto"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ConfigError(f"compression.device={self.device!r} is not allowed: allowed {', '.join(DEVICES)}")
        if self.scorer not in SCORERS:
            raise ConfigError(f"compression.scorer={self.scorer!r} is not allowed: allowed {', '.join(SCORERS)}")
        if self.pool not in POOLS:
            raise ConfigError(f"compression.pool={self.pool!r} is not allowed: allowed {', '.join(POOLS)}")
        if self.score_layers not in SCORE_LAYERS:
            raise ConfigError(f"compression.score_layers={self.score_layers!r} is not allowed: "
                              f"allowed {', '.join(SCORE_LAYERS)}")
        if self.draft_path is not None:
            if not isinstance(self.draft_path, (str, os.PathLike)):
                raise ConfigError(f"compression.draft_path={self.draft_path!r} is not allowed: "
                                  f"allowed a path to a .gguf file")
            object.__setattr__(self, "draft_path", os.fspath(self.draft_path))
        if self.scorer == "draft" and self.draft_path is None:
            raise ConfigError("compression.scorer='draft' needs compression.draft_path: allowed a path to a .gguf file")
        if self.scorer == "target" and self.draft_path is not None:
            raise ConfigError("compression.draft_path is the draft scorer's: allowed with scorer='draft' only")
        for name in ("num_layers", "window", "block_size", "auto_kept_tokens", "chunk_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("sink_tokens", self.sink_tokens, lo=0)
        _positive_int("spread", self.spread, lo=0)
        _positive_int("auto_min_tokens", self.auto_min_tokens)
        floor = self.sink_tokens + self.window
        if not floor <= self.auto_kept_tokens <= self.auto_min_tokens:
            raise ConfigError(f"compression.auto_kept_tokens={self.auto_kept_tokens} is out of range: allowed "
                              f"{floor}..{self.auto_min_tokens} (sink_tokens + window .. auto_min_tokens)")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CompressionOptions":
        refuse_unknown_keys(cls, d, "compression")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(name: str, value: Any, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"compression.{name}={value!r} is out of range: allowed an integer >= {lo}")


def check_ratio(value: Any, name: str = "prompt_compression") -> str | float:
    """'off', 'auto' or a kept fraction in (0, 1] (as a float); anything else is refused."""
    allowed = "allowed 'off', 'auto' or a ratio in (0, 1]"
    if isinstance(value, str):
        if value in ("off", "auto"):
            return value
        raise ConfigError(f"{name}={value!r} is not allowed: {allowed}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{name}={value!r} is out of range: {allowed}")
    return float(value)


@dataclass(frozen=True)
class ScoreSummary:
    layers: tuple[int, ...]  # the scorer's layers that scored
    window: int  # query rows
    num_blocks: int  # candidate blocks (between the sinks and the window)
    num_kept_blocks: int
    kept_mass: float  # share of the window's attention on the candidates that the kept blocks hold
    scorer_s: float  # seconds the scorer took
    device: str = "cpu"  # where it ran (CompressionOptions.device, resolved)


@dataclass(frozen=True)
class CompressedPrompt:
    kept_ids: tuple[int, ...]
    kept_positions: tuple[int, ...]  # where each kept token stood in the raw prompt
    raw_tokens: int
    effective_tokens: int
    compressed: bool  # False: the prompt is admitted whole (below the threshold, or too short)
    asked: str  # what was asked: "auto" or the ratio, e.g. "0.25"
    scores: ScoreSummary | None = None  # None when nothing was scored


def load_scorer(model, options: CompressionOptions):
    """The model that scores: `model` itself, or the draft GGUF, refused (from its metadata,
    before its weights load) unless it has the target's vocabulary: a token id must mean the
    same token to both."""
    if options.scorer == "target":
        return model
    from .model import load_draft

    return load_draft(options.draft_path, model, what="draft scorer", field="compression.draft_path")


def scorer_device(options: CompressionOptions, backend: str = "torch") -> str:
    """The device the scorer runs on for an engine of `backend`: options.device, "auto"
    resolved (cuda for backend="triton" on a machine with CUDA); "cuda" without one is refused."""
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("compression.device='cuda' needs a CUDA device, and this machine has none: "
                              "allowed 'cpu' or 'auto' here")
    return device


class PromptCompressor:
    """What the engine holds when compression is on: the scorer (loaded once, its layers on the
    scoring device) and the options."""

    def __init__(self, model, mode: str | float, options: CompressionOptions, backend: str = "torch"):
        self.mode = check_ratio(mode)
        if self.mode == "off":
            raise WorkbenchError("PromptCompressor needs prompt_compression 'auto' or a ratio, not 'off'")
        self.options = options
        self.scorer = load_scorer(model, options)
        layers = scoring_layers(self.scorer.config, options)  # (refused now, not at the first request)
        self.device = scorer_device(options, backend)
        self.on_device = DeviceScorer(self.scorer, max(layers) + 1, self.device) if self.device != "cpu" else None

    def compress(self, prompt_ids: Sequence[int]) -> CompressedPrompt:
        return compress(self.scorer, prompt_ids, self.mode, self.options, self.on_device)


def target_tokens(num_tokens: int, mode: str | float, options: CompressionOptions) -> int:
    """How many tokens the compressed prompt should keep (before block granularity)."""
    if mode == "auto":
        return num_tokens if num_tokens < options.auto_min_tokens else min(num_tokens, options.auto_kept_tokens)
    return min(num_tokens, math.ceil(mode * num_tokens))


def compress(model, prompt_ids: Sequence[int], ratio_or_auto: str | float,
             options: CompressionOptions = CompressionOptions(), on_device: "DeviceScorer | None" = None
             ) -> CompressedPrompt:
    """Keep about `ratio` of the prompt (or, for "auto", about options.auto_kept_tokens of a
    prompt of at least options.auto_min_tokens): the sinks, the best blocks, the window.
    `model` scores (the target, or a draft from `load_scorer`); its vocabulary is the prompt's.
    on_device: a DeviceScorer of `model` to score with (None: the CPU reference path)."""
    mode = check_ratio(ratio_or_auto, "ratio_or_auto")
    if mode == "off":
        raise WorkbenchError("compress() needs 'auto' or a ratio in (0, 1]; 'off' means do not call it")
    ids = [int(t) for t in prompt_ids]
    n = len(ids)
    asked = mode if isinstance(mode, str) else f"{mode:g}"
    blocks = candidate_blocks(n, options)
    num_keep = blocks_to_keep(n, target_tokens(n, mode, options), blocks, options)
    if num_keep == len(blocks):  # nothing to drop at this ratio and block size
        return CompressedPrompt(tuple(ids), tuple(range(n)), n, n, False, asked)
    t0 = time.perf_counter()
    layers = scoring_layers(model.config, options)
    token = (window_scores(model, ids, layers, options.window, options.chunk_size) if on_device is None
             else on_device.window_scores(ids, layers, options.window))
    scorer_s = time.perf_counter() - t0
    chosen = select_blocks(token, blocks, num_keep, options)
    mass = [float(token[a:b].sum()) for a, b in blocks]
    sinks, tail = _ends(n, options)
    positions = list(range(sinks)) + [p for b in chosen for p in range(*blocks[b])] + list(range(n - tail, n))
    summary = ScoreSummary(
        layers=layers, window=min(options.window, n), num_blocks=len(blocks), num_kept_blocks=num_keep,
        kept_mass=sum(mass[b] for b in chosen) / sum(mass) if sum(mass) > 0 else 0.0, scorer_s=scorer_s,
        device="cpu" if on_device is None else on_device.device.type)
    return CompressedPrompt(tuple(ids[p] for p in positions), tuple(positions), n, len(positions), True, asked, summary)


def _ends(n: int, options: CompressionOptions) -> tuple[int, int]:
    """(sink tokens, tail tokens) of an n-token prompt, always kept: the tail is the window
    and the fewer than block_size tokens before it that fill no whole block (so every
    candidate block is whole, and the kept count is the asked one to half a block)."""
    sinks = min(options.sink_tokens, n)
    tail = min(options.window, n - sinks)
    return sinks, tail + (n - sinks - tail) % options.block_size


def candidate_blocks(n: int, options: CompressionOptions) -> list[tuple[int, int]]:
    """[start, end) of the whole blocks between the sinks and the tail."""
    sinks, tail = _ends(n, options)
    b = options.block_size
    return [(a, a + b) for a in range(sinks, n - tail, b)]


def blocks_to_keep(n: int, target: int, blocks: list[tuple[int, int]], options: CompressionOptions) -> int:
    """How many blocks bring the kept tokens nearest `target` (all of them when target >= n)."""
    if target >= n:
        return len(blocks)
    sinks, tail = _ends(n, options)
    return max(0, min(len(blocks), round((target - sinks - tail) / options.block_size)))


def rank_blocks(token_scores, blocks: list[tuple[int, int]], options: CompressionOptions) -> list[int]:
    """Every block's index, best pooled score first; ties go to the earlier block."""
    import torch.nn.functional as F

    n = token_scores.shape[0]
    if options.spread:
        token_scores = F.max_pool1d(token_scores.view(1, 1, n), 2 * options.spread + 1, 1, options.spread).view(n)
    pooled = [float(token_scores[a:b].mean() if options.pool == "mean" else token_scores[a:b].max()) for a, b in blocks]
    return sorted(range(len(blocks)), key=lambda b: (-pooled[b], b))


def select_blocks(token_scores, blocks: list[tuple[int, int]], num_keep: int, options: CompressionOptions) -> list[int]:
    """The `num_keep` best blocks (rank_blocks), in prompt order."""
    return sorted(rank_blocks(token_scores, blocks, options)[:num_keep])


def scoring_layers(config, options: CompressionOptions) -> tuple[int, ...]:
    """The scorer's layers that score (CompressionOptions.score_layers); refused when none."""
    first = range(min(options.num_layers, config.n_layers))
    layers = tuple(li for li in first if options.score_layers == "all" or config.layer_window(li) == 0)
    if not layers:
        glob = [li for li in range(config.n_layers) if config.layer_window(li) == 0]
        need = f"num_layers >= {glob[0] + 1} or " if glob else ""
        raise WorkbenchError(f"compression.num_layers={options.num_layers} holds no full-attention layer of the "
                             f"scorer: allowed {need}score_layers='all'")
    return layers


def window_scores(model, ids: Sequence[int], layers: Sequence[int], window: int, chunk_size: int = 512) -> "torch.Tensor":
    """float64 [T]: for each prompt token, the attention probability the last `window` tokens
    give it, summed over heads, window rows and `layers`. Every key of a layer is scored (a
    sliding layer's too, with score_layers="all"). The model runs up to the last of `layers`;
    memory is the K and V of those layers plus [heads per KV head, W, T] scores at a time,
    never a [T, T] matrix."""
    import torch

    c = model.config
    n = len(ids)
    if n > c.context_length:
        raise WorkbenchError(f"a prompt of {n} tokens does not fit the scorer's context of {c.context_length} tokens")
    w = min(window, n)
    with torch.inference_mode():
        _, queries, keys = run_layers(model, ids, max(layers) + 1, w, chunk_size, finish_last=False, keep=layers)
        return window_probability(c, [queries[li] for li in layers], [keys[li] for li in layers], n, w)


def window_probability(c, queries, keys, n: int, w: int):
    """Sum over layers, heads and window rows of softmax(q k^T * scale) over the keys up to
    each window row: [T] float64."""
    import torch

    g = c.n_heads // c.n_kv_heads
    qpos = torch.arange(n - w, n).view(1, w, 1)
    hidden = torch.arange(n).view(1, 1, n) > qpos  # [1, W, T]: keys after a window row
    total = torch.zeros(n, dtype=torch.float64)
    for q, k in zip(queries, keys):  # q [W, H, D], k [T, Hkv, D]
        for kh in range(c.n_kv_heads):
            qh = q[:, kh * g : (kh + 1) * g].transpose(0, 1)  # [G, W, D]
            s = (qh @ k[:, kh].T) * c.attn_scale  # [G, W, T]
            p = s.masked_fill(hidden, float("-inf")).softmax(-1)
            total += p.sum((0, 1)).double()
    return total


def run_layers(model, ids: Sequence[int], num_layers: int, window: int, chunk_size: int = 512,
               finish_last: bool = True, keep: Sequence[int] | None = None):
    """The model's own first `num_layers` layers over `ids`, in chunks of `chunk_size` rows,
    through `Model.forward`'s own layer halves (`layer_qkv`, `layer_out`) on a contiguous
    cache. Returns (the last row's residual after those layers, or None unless finish_last;
    per layer the last `window` rows' queries [W, H, D]; per layer every key [T, Hkv, D]),
    queries and keys as attention sees them (norms and rope applied). The loop is its own
    because `Model.forward` returns logits only; `tests/test_compression.py` holds it to
    `Model.logits` bitwise. finish_last=False stops the last layer after its keys (the scorer
    needs nothing more of it). keep: the layers whose queries and keys are returned (None: all;
    the others' entries are None)."""
    import torch

    from .attention import KV_BLOCK, attend, plan_tiles, round_up_capacity, write_rows
    from .model import rope_tables

    c = model.config
    n = len(ids)
    h_kv, d = c.n_kv_heads, c.head_dim
    nb = round_up_capacity(n) // KV_BLOCK
    kc = [torch.empty(nb, h_kv, d, KV_BLOCK) for _ in range(num_layers)]
    vc = [torch.empty(nb, h_kv, KV_BLOCK, d) for _ in range(num_layers)]
    queries = [[] for _ in range(num_layers)]
    last = None
    for s0 in range(0, n, chunk_size):
        toks = ids[s0 : s0 + chunk_size]
        rows = len(toks)
        positions = torch.arange(s0, s0 + rows, dtype=torch.int64)
        x = model.embed(torch.tensor(toks, dtype=torch.int64))
        ropes = {b: rope_tables(positions, b, d) for b in {c.layer_rope_base(i) for i in range(num_layers)}}
        tiles = {wd: plan_tiles(positions, wd) for wd in {c.layer_window(i) for i in range(num_layers)}}
        in_window = max(0, s0 + rows - (n - window))  # this chunk's rows that are window rows
        for li in range(num_layers):
            q, k, v = model.layer_qkv(li, x, ropes)
            if in_window:
                queries[li].append(q[rows - in_window :])
            write_rows(kc[li], vc[li], s0, k, v)
            if li == num_layers - 1 and not finish_last:
                continue
            win = c.layer_window(li)
            x = model.layer_out(li, x, attend(q, kc[li], vc[li], positions, win, c.attn_scale, tiles[win]))
        last = x[-1]
    keep = set(range(num_layers) if keep is None else keep)
    keys = [kb.permute(0, 3, 1, 2).reshape(nb * KV_BLOCK, h_kv, d)[:n] if li in keep else None for li, kb in enumerate(kc)]
    queries = [torch.cat(q) if li in keep else None for li, q in enumerate(queries)]
    return (last if finish_last else None), queries, keys


class DeviceScorer:
    """The scorer's first `num_layers` layers on a GPU: the same layer ops as `run_layers`
    (`Model.layer_qkv`, `layer_out`, their weights copied to the device once), attention by
    `scaled_dot_product_attention` over a contiguous cache, in chunks of `chunk_rows` rows.
    Written here rather than reusing `run_layers` because that loop's attention (`attend`) is
    built for bitwise row invariance on the CPU, thousands of small products per chunk, which
    launch-bound a GPU. Its scores are not the CPU's bits; they are a function of the prompt on
    given hardware (`tests/test_compression.py` holds them to the CPU's on the CPU to rounding)."""

    def __init__(self, model, num_layers: int, device: str = "cuda", chunk_rows: int = 2048):
        import copy
        from dataclasses import fields

        import torch

        self.device = torch.device(device)
        self.num_layers = min(num_layers, model.config.n_layers)
        self.chunk_rows = chunk_rows
        self.model = copy.copy(model)  # a view: its first layers' weights on the device
        self.model.layers = [type(layer)(**{f.name: (None if getattr(layer, f.name) is None
                                                     else getattr(layer, f.name).to(self.device))
                                            for f in fields(layer)})
                             for layer in model.layers[: self.num_layers]]

    def window_scores(self, ids: Sequence[int], layers: Sequence[int], window: int):
        """window_scores(model, ids, layers, window) computed on the device: float64 [T] on the CPU."""
        import torch
        import torch.nn.functional as F

        from .model import rope_tables

        m, c, dev = self.model, self.model.config, self.device
        n = len(ids)
        if n > c.context_length:
            raise WorkbenchError(f"a prompt of {n} tokens does not fit the scorer's context of {c.context_length} tokens")
        w = min(window, n)
        last = max(layers) + 1
        g = c.n_heads // c.n_kv_heads
        with torch.inference_mode():
            keys = [torch.empty(n, c.n_kv_heads, c.head_dim, device=dev) for _ in range(last)]
            values = [torch.empty(n, c.n_kv_heads, c.head_dim, device=dev) for _ in range(last)]
            queries = [[] for _ in range(last)]
            for s0 in range(0, n, self.chunk_rows):
                rows = min(self.chunk_rows, n - s0)
                positions = torch.arange(s0, s0 + rows, dtype=torch.int64)
                x = m.embed(torch.tensor(ids[s0 : s0 + rows], dtype=torch.int64)).to(dev)
                ropes = {b: tuple(t.to(dev) for t in rope_tables(positions, b, c.head_dim))
                         for b in {c.layer_rope_base(i) for i in range(last)}}
                in_window = max(0, s0 + rows - (n - w))
                qpos = positions.to(dev).view(rows, 1)
                for li in range(last):
                    q, k, v = m.layer_qkv(li, x, ropes)
                    keys[li][s0 : s0 + rows], values[li][s0 : s0 + rows] = k, v
                    if in_window:
                        queries[li].append(q[rows - in_window :])
                    if li == last - 1:
                        continue  # the last scoring layer is needed up to its keys only
                    win = c.layer_window(li)
                    lo = max(0, s0 - win + 1) if win else 0
                    kpos = torch.arange(lo, s0 + rows, device=dev).view(1, -1)
                    visible = kpos <= qpos
                    if win:
                        visible &= (qpos - kpos) < win
                    kk = keys[li][lo : s0 + rows].transpose(0, 1).repeat_interleave(g, 0)  # [H, T, D]
                    vv = values[li][lo : s0 + rows].transpose(0, 1).repeat_interleave(g, 0)
                    attn = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=visible,
                                                          scale=c.attn_scale)  # [H, R, D]
                    x = m.layer_out(li, x, attn.transpose(0, 1).contiguous())
            q_cpu = [torch.cat(queries[li]).cpu() for li in layers]
            k_cpu = [keys[li].cpu() for li in layers]
        return window_probability(c, q_cpu, k_cpu, n, w)
