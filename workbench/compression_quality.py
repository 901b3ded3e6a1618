"""How far prompt compression moves a continuation: lossy by design, so measured.

`compare(model, prompt_ids, ratio)` serves the prompt twice, greedy, on two engines that differ
only in `prompt_compression`, and reports

* prefix_match: how many leading tokens of the compressed continuation equal the uncompressed one;
* top1_agreement and mean_kl over the uncompressed continuation, teacher-forced: at each of its
  positions the next-token distribution after the whole prompt (the uncompressed run's own
  logits) against the one after the kept prompt plus the same continuation so far, KL(whole ||
  kept) in nats.

`needle_trial` plants a fact (a random 6-digit code bound to a name) at a depth of bland filler
text, asks for it at the end, and records whether each continuation retrieves it (the code
appears in its greedy text) and whether the scorer kept the code's tokens.

The teacher-forced side of the kept prompt runs on the torch reference forward (`Model.forward`),
which is bitwise the torch engine's (chunk invariance); with an engine config of backend
"triton" the whole-prompt side is that engine's logits and the two sides differ by its numerics.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Sequence

from .compression import CompressionOptions, check_ratio
from .engine_config import EngineConfig
from .errors import WorkbenchError

__all__ = ["Comparison", "NeedlePrompt", "compare", "continuation_logits", "needle_prompt", "needle_trial"]

# Filler for the needle task: plain sentences with no codes, names or digits in them.
FILLER = (
    "The river ran slowly past the old mill.", "A light rain fell over the hills that morning.",
    "The market opened early and closed before noon.", "Birds gathered on the wires above the road.",
    "The library kept its windows open in summer.", "A long train crossed the valley without stopping.",
    "The bakery on the corner sold bread and small cakes.", "Clouds moved in from the sea by evening.",
    "The garden path was lined with tall grass.", "A quiet wind turned the pages of a newspaper.",
    "The school bell rang twice before the lesson.", "Lamps were lit along the harbour at dusk.",
    "The farmer checked the fences after the storm.", "A small boat drifted near the rocks.",
    "The museum moved its paintings to a larger hall.", "Snow covered the roofs of the village.",
)
NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas")


@dataclass(frozen=True)
class Comparison:
    raw_tokens: int
    effective_tokens: int
    compressed: bool
    num_tokens: int  # continuation tokens compared
    prefix_match: int
    top1_agreement: float
    mean_kl: float
    whole: Any  # the uncompressed run's GenerationResult
    kept: Any  # the compressed run's GenerationResult

    def record(self) -> dict[str, Any]:
        return {"raw_tokens": self.raw_tokens, "effective_tokens": self.effective_tokens,
                "compressed": self.compressed, "num_tokens": self.num_tokens, "prefix_match": self.prefix_match,
                "top1_agreement": self.top1_agreement, "mean_kl": self.mean_kl,
                "ttft_whole_s": self.whole.ttft_s, "ttft_kept_s": self.kept.ttft_s,  # (kept: scoring included)
                "text_whole": self.whole.text, "text_kept": self.kept.text}


def continuation_logits(model, prompt_ids: Sequence[int], continuation: Sequence[int], chunk: int = 512):
    """float32 [len(continuation), vocab]: row i is the next-token logits after prompt_ids +
    continuation[:i] (teacher forcing), the output head only on those rows."""
    import torch

    from .model import Segment

    if not prompt_ids or not continuation:
        raise WorkbenchError("continuation_logits needs a prompt and a continuation of at least one token")
    ids = list(prompt_ids) + list(continuation[:-1])
    state = model.new_state(len(ids))
    head_from = len(prompt_ids) - 1
    rows = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            part = ids[s : s + chunk]
            if s + len(part) <= head_from:
                model.forward([Segment(state, part, "none")])
                continue
            split = max(0, head_from - s)  # rows of this chunk before the first wanted one
            if split:
                model.forward([Segment(state, part[:split], "none")])
            rows.append(model.forward([Segment(state, part[split:], "all")])[0])
    return torch.cat(rows)


def _engines(model, ratio_or_auto, options: CompressionOptions, config: EngineConfig | None, context: int):
    from .engine import Engine

    base = config or EngineConfig(max_concurrency=1, max_context=context, dtype=model.dtype_name)
    whole = Engine(model, replace(base, prompt_compression="off", compression=CompressionOptions()), keep_logits=True)
    kept = Engine(model, replace(base, prompt_compression=ratio_or_auto, compression=options))
    return whole, kept


def compare(model, prompt_ids: Sequence[int], ratio_or_auto: str | float,
            options: CompressionOptions = CompressionOptions(), *, max_tokens: int = 32,
            config: EngineConfig | None = None) -> Comparison:
    """Serve `prompt_ids` whole and compressed (greedy, EOS ignored, max_tokens each) and
    compare the continuations (module docstring). `config`: the engines' base config (its
    prompt_compression fields are replaced); default one slot, a context that fits."""
    import torch

    mode = check_ratio(ratio_or_auto, "ratio_or_auto")
    if mode == "off":
        raise WorkbenchError("compare() needs 'auto' or a ratio in (0, 1]: 'off' has nothing to compare")
    whole_engine, kept_engine = _engines(model, mode, options, config, len(prompt_ids) + max_tokens + 1)
    whole = whole_engine.generate([list(prompt_ids)], max_tokens=max_tokens, ignore_eos=True)[0]
    kept = kept_engine.generate([list(prompt_ids)], max_tokens=max_tokens, ignore_eos=True)[0]
    ref = whole.logits.double().log_softmax(-1)
    got = continuation_logits(model, kept.effective_prompt_ids, whole.token_ids).double().log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    match = 0
    for a, b in zip(whole.token_ids, kept.token_ids):
        if a != b:
            break
        match += 1
    return Comparison(
        raw_tokens=kept.raw_prompt_tokens, effective_tokens=kept.effective_prompt_tokens,
        compressed=bool(kept.compression and kept.compression.compressed), num_tokens=len(whole.token_ids),
        prefix_match=match, top1_agreement=float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
        mean_kl=float(kl.mean()), whole=whole, kept=kept)


@dataclass(frozen=True)
class NeedlePrompt:
    ids: tuple[int, ...]
    name: str
    code: str
    depth: float  # where the fact stands, as a fraction of the filler
    code_positions: tuple[int, ...]  # the prompt positions of the code's tokens


def needle_prompt(model, num_tokens: int, depth: float, seed: int = 0) -> NeedlePrompt:
    """About `num_tokens` tokens: filler with "The secret code for NAME is CODE." planted at
    `depth` (0: the start, 1: the end of the filler), then the question."""
    if not 0 <= depth <= 1:
        raise WorkbenchError(f"depth={depth!r} is out of range: allowed 0..1")
    rnd = random.Random(seed)
    name = rnd.choice(NAMES)
    code = f"{rnd.randrange(100000, 1000000)}"
    fact = f" The secret code for {name} is {code}."
    question = f"\n\nQuestion: What is the secret code for {name}?\nAnswer: The secret code for {name} is"
    tok = model.tokenizer
    budget = num_tokens - len(tok.encode(fact + question))
    sentences, used = [], len(tok.encode(""))  # (the BOS, where the model adds one)
    while True:
        s = " " + rnd.choice(FILLER)
        n = len(tok.encode(s, add_bos=False))
        if used + n > budget:
            break
        sentences.append(s)
        used += n
    if not sentences:
        raise WorkbenchError(f"num_tokens={num_tokens} is too short for a needle prompt: "
                             f"allowed >= ~{num_tokens - budget + 16}")
    at = round(depth * len(sentences))
    before = "".join(sentences[:at]).lstrip()
    head = tok.encode(before + fact[: fact.index(code)])
    ids = tok.encode(before + fact + "".join(sentences[at:]) + question)
    code_ids = tok.encode(code, add_bos=False)
    k = len(code_ids)
    start = next((i for i in range(len(head) - 1, len(ids) - k + 1) if list(ids[i : i + k]) == code_ids), None)
    if start is None:
        raise WorkbenchError("the code's tokens were not found in the needle prompt (tokenizer merged them)")
    return NeedlePrompt(tuple(ids), name, code, depth, tuple(range(start, start + len(code_ids))))


def needle_trial(model, num_tokens: int, depth: float, ratio_or_auto: str | float,
                 options: CompressionOptions = CompressionOptions(), *, seed: int = 0, max_tokens: int = 12,
                 config: EngineConfig | None = None) -> dict[str, Any]:
    """One needle prompt served whole and compressed: retrieval of each and the agreement figures."""
    needle = needle_prompt(model, num_tokens, depth, seed)
    cmp = compare(model, needle.ids, ratio_or_auto, options, max_tokens=max_tokens, config=config)
    kept_positions = set(cmp.kept.compression.kept_positions)
    return {
        "target_tokens": num_tokens, "depth": depth, "seed": seed, "code": needle.code,
        "retrieved_whole": needle.code in cmp.whole.text, "retrieved_kept": needle.code in cmp.kept.text,
        "code_kept": all(p in kept_positions for p in needle.code_positions),
        "kept_mass": None if cmp.kept.compression.scores is None else cmp.kept.compression.scores.kept_mass,
        "scorer_s": None if cmp.kept.compression.scores is None else cmp.kept.compression.scores.scorer_s,
        **cmp.record(),
    }
