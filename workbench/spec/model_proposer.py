"""Model-based proposers: drafts are a draft model's greedy tokens, batched across requests.

    SpecConfig(proposer="self", draft_layers=4)         # the target's first 4 layers + its head
    SpecConfig(proposer="draft", draft_model="d.gguf")  # a GGUF with the target's tokenizer

`ModelProposer` runs the draft on a runner of the target's kind (TorchRunner on the CPU,
TritonRunner on the GPU; the self-draft's Triton runner shares the target's device weights,
`DeviceWeights.first_layers`). The draft keeps its own KV pages, in a pool of its own with its
own `PageAllocator` (no prefix cache): a request's draft sequence holds the KV of the tokens
fed to the draft so far (`fed`). Each step, for every request asking for k tokens at once:

1. the draft sequence is cut back to the longest prefix it shares with the request's context
   (the rejected draft tokens go; issue 7's truncate);
2. the rest of the context is fed in chunks (the first time: the whole prompt), the last row
   scored: its argmax is draft token 1;
3. k - 1 single-row steps, each feeding the previous draft token, give tokens 2..k.

Every round is one forward over all the requests that still draft, so the draft's cost grows
with the round count (k), not with the number of requests. The draft's output only ever
decides what is proposed: verification keeps the target's output exact whatever it is.

Why the draft does not write into the target's pages (as a self-draft could: its first K layers'
KV for the context is exactly the target's own): the target's KV rows of a position are written
by the verify of that position, after the draft has already run over it, so sharing needs a
two-phase step (draft rows over the target's committed pages, then the verify) and a pool that
holds both; a follow-up. The separate pool costs the draft's prefill once per request, and
memory (draft_kv_tokens positions of the draft's layers).

What the self-draft costs: its K layers, plus the target's full head. On Gemma 3 270M the head
(262,144 x 640) is the largest single product of a decode step, so a self-draft step costs
much more than K/18 of a target step; a draft vocabulary restricted to frequent tokens (as
FR-Spec does) would cut that and is a follow-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import torch

from ..errors import WorkbenchError
from ..scheduler import Segment
from ..state import PageAllocator
from .config import MAX_K, SpecConfig

__all__ = ["DraftStats", "ModelProposer", "build_model_proposer"]

CHUNK = 256  # the most context rows a request feeds the draft in one forward (a prefill chunk)


@dataclass
class DraftStats:
    """The draft model's work since the proposer was made (the activation proof of its drafts)."""

    forwards: int = 0  # draft forwards run
    rows: int = 0  # rows they fed (catch-up and draft rows)
    tokens: int = 0  # draft tokens proposed
    restarts: int = 0  # draft sequences rebuilt from position 0 (their KV could not be cut back)
    full: int = 0  # requests given no draft because the draft's pool had no room
    seconds: float = 0.0  # wall time of the draft's forwards


class ModelProposer:
    """Greedy drafts of `model` (run by `runner`, whose KV pool this proposer allocates)."""

    def __init__(self, name: str, model, runner, kv_tokens: int):
        self.name = name
        self.model, self.runner = model, runner
        layout = runner.state_layout
        pages = max(2, -(-kv_tokens // layout.page_size))
        num_pages = {g: pages for g in layout.group_names}
        runner.init_kv_pool(num_pages)
        # max_rollback: a step cuts back at most the k - 1 draft tokens it fed (and one more, for a
        # context that did not grow), so a sliding group keeps the pages that needs
        self.alloc = PageAllocator(layout, num_pages, prefix_cache=False, max_rollback=MAX_K + 1)
        self.capacity = runner.slot_capacity
        self.fed: dict[Hashable, list[int]] = {}  # request -> tokens whose draft KV is written
        self.known: dict[Hashable, int] = {}  # request -> a length of its context seen before
        self.slot: dict[Hashable, int] = {}
        self._free_slots: list[int] = []
        self.stats = DraftStats()

    # -- the Proposer interface --------------------------------------------------------------
    def start(self, rid: Hashable, prompt_ids: Sequence[int]) -> None:
        self.alloc.add(rid)
        self.fed[rid], self.known[rid] = [], 0
        self.slot[rid] = self._free_slots.pop() if self._free_slots else len(self.slot)

    def finish(self, rid: Hashable, context: Sequence[int], num_prompt: int) -> None:
        if rid in self.fed:
            self.alloc.free(rid)
            del self.fed[rid], self.known[rid]
            self._free_slots.append(self.slot.pop(rid))

    def propose(self, rid: Hashable, context: Sequence[int], k: int) -> tuple[int, ...]:
        return self.propose_many({rid: (context, k)}).get(rid, ())

    def propose_many(self, asks: Mapping[Hashable, tuple[Sequence[int], int]]) -> dict[Hashable, tuple[int, ...]]:
        """Request id -> up to k draft tokens, for every (context, k) asked, in k rounds of one
        forward each (round 0 may take more than one: a long catch-up goes in chunks)."""
        t0 = time.perf_counter()
        pending: dict[Hashable, list[int]] = {}  # request -> context tokens still to feed
        want: dict[Hashable, int] = {}
        for rid, (ctx, k) in asks.items():
            # leave room in the slot for what is fed: the context, then k - 1 draft tokens
            k = min(k, self.capacity - len(ctx))
            if k < 1:
                continue
            pending[rid], want[rid] = self._rest(rid, ctx), k
        # (the pool is shared: room is checked as each piece is appended; a request that finds
        # none gets no draft this step, or a shorter one, and its fed KV stays valid)
        out: dict[Hashable, list[int]] = {}
        while pending:  # round 0: the catch-up, CHUNK rows per request per forward
            fwd, last = [], {}
            for rid, rest in list(pending.items()):
                piece, pending[rid] = rest[:CHUNK], rest[CHUNK:]
                if not self.alloc.can_append(rid, len(piece)):
                    self.stats.full += 1
                    del pending[rid]
                    continue
                fwd.append(self._segment(rid, piece, scored=not pending[rid]))
                if not pending[rid]:
                    del pending[rid]
                    last[fwd[-1].slot_id] = rid
            for slot, tok in self._run(fwd).items():
                out[last[slot]] = [tok]
        while True:  # rounds 1..k-1: one row each, the previous draft token fed
            fwd, who = [], {}
            for rid, toks in out.items():
                if len(toks) < want[rid]:
                    if not self.alloc.can_append(rid, 1):
                        want[rid] = len(toks)
                        continue
                    fwd.append(self._segment(rid, [toks[-1]], scored=True))
                    who[fwd[-1].slot_id] = rid
            if not fwd:
                break
            for slot, tok in self._run(fwd).items():
                out[who[slot]].append(tok)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.tokens += sum(map(len, out.values()))
        return {rid: tuple(t) for rid, t in out.items()}

    # -- internals -----------------------------------------------------------------------------
    def _rest(self, rid: Hashable, ctx: Sequence[int]) -> list[int]:
        """Cut the draft sequence back to what it shares with `ctx`; the context tokens it lacks.
        A context only ever grows (a request's prompt, then its output), so the comparison
        starts where the last one ended: O(k) a step, whatever the context length."""
        fed = self.fed[rid]
        n = min(self.known[rid], len(fed))
        while n < len(fed) and n < len(ctx) and fed[n] == ctx[n]:
            n += 1
        n = min(n, len(ctx) - 1)  # (at least the last token is fed: its row gives token 1)
        self.known[rid] = len(ctx)
        if n < len(fed):
            if n >= self.alloc.min_length(rid):
                self.alloc.truncate(rid, n)
            else:  # (a sliding group dropped a page that cut needs: start over)
                self.alloc.free(rid)
                self.alloc.add(rid)
                self.stats.restarts += 1
                n = 0
            del fed[n:]
        return list(ctx[n:])

    def _segment(self, rid: Hashable, tokens: list[int], scored: bool) -> Segment:
        start = len(self.fed[rid])
        copies = tuple(self.alloc.append(rid, len(tokens)))
        self.fed[rid] += tokens
        tables = {g: tuple(self.alloc.block_table(rid, g).ids()) for g in self.alloc.layout.group_names}
        return Segment(self.slot[rid], rid, tuple(tokens), start, scored, tables, copies)

    def _run(self, fwd: list[Segment]) -> dict[int, int]:
        """One draft forward; slot -> the greedy token of its scored row."""
        if not fwd:
            return {}
        self.stats.forwards += 1
        self.stats.rows += sum(len(s.token_ids) for s in fwd)
        scored = frozenset(s.slot_id for s in fwd if s.samples)
        res = self.runner.run(fwd, {s.slot_id: self.capacity for s in fwd}, argmax=scored)
        logits = [(slot, v) for slot, v in res.items() if not isinstance(v, int)]
        toks = {slot: v for slot, v in res.items() if isinstance(v, int)}
        if logits:  # (one argmax over the stacked rows, as the engine's greedy rows)
            picks = torch.stack([v for _, v in logits]).argmax(-1).tolist()
            toks.update((slot, int(t)) for (slot, _), t in zip(logits, picks))
        return toks


def build_model_proposer(config: SpecConfig, model, runner) -> ModelProposer:
    """The config's self-draft or draft-GGUF proposer for the target `model` run by `runner`
    (TorchRunner or TritonRunner): the draft runs on a runner of the same kind."""
    from ..model import first_layers, load_draft
    from ..runner import TorchRunner

    if config.proposer == "self":
        draft = first_layers(model, config.draft_layers)
        name = f"self:{config.draft_layers}"
    else:
        draft = load_draft(config.draft_model, model, what="draft model", field="speculation draft_model")
        name = "draft"
    capacity = runner.slot_capacity
    if isinstance(runner, TorchRunner):
        draft_runner = TorchRunner(draft, capacity)
    else:
        from ..runners.triton_runner import TritonRunner

        weights = runner.weights.first_layers(config.draft_layers) if config.proposer == "self" else None
        draft_runner = TritonRunner(draft, capacity, runner.options, device=runner.device, weights=weights)
    if draft.config.vocab_size != model.config.vocab_size:
        raise WorkbenchError(f"the draft model has {draft.config.vocab_size} logits per row, the model "
                             f"{model.config.vocab_size}: allowed a draft with the same vocabulary")
    return ModelProposer(name, draft, draft_runner, config.draft_kv_tokens)
