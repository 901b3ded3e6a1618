"""Speculator: the engine's speculative-decoding state (one proposer, one yield guard, the
measured step cost) and each request's counters, the activation proof of its rows.

Per step the engine asks `drafts(contexts)` for every decoding request's draft (the guard's
length, then the proposer's tokens), schedules them, runs the verify rows, accepts with
verify.py's rule, and reports back with `observe` (per verify) and `record_step` (the step's
rows and wall time, which the guard's cost model learns from).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from .config import SpecConfig
from .guard import DraftCost, StepCost, YieldGuard
from .proposers import Proposer, make_proposer

__all__ = ["SpecStats", "Speculator"]


@dataclass
class SpecStats:
    """One request's speculation counters."""

    verify_steps: int = 0  # steps it verified a draft in
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    emitted: int = 0  # tokens its verify steps emitted (kept + the target's own)
    guard_skips: int = 0  # steps the guard chose no draft for it
    empty: int = 0  # steps the guard allowed a draft and the proposer had none
    hist: list[int] = field(default_factory=list)  # hist[a]: verify steps that kept a draft tokens
    position_drafted: list[int] = field(default_factory=list)  # per draft position i: drafted
    position_accepted: list[int] = field(default_factory=list)  # and kept

    @property
    def draft_yield(self) -> float | None:
        """Tokens emitted per verify step (1.0: no draft token ever kept)."""
        return self.emitted / self.verify_steps if self.verify_steps else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def record(self, drafted: int, kept: int, emitted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += kept
        self.emitted += emitted
        _bump(self.hist, kept)
        for i in range(drafted):
            _bump(self.position_drafted, i)
            if i < kept:
                _bump(self.position_accepted, i)


def _fit(lengths: dict[Hashable, int], budget: int) -> None:
    """Cut draft lengths until they sum to at most `budget` (>= 0), a token at a time from the
    longest (the first of equals in order): the step's verify rows then fit the runner's
    fastest form, and no slot loses more than it must."""
    budget = max(budget, 0)
    total = sum(lengths.values())
    while total > budget:
        rid = max(lengths, key=lengths.__getitem__)
        lengths[rid] -= 1
        total -= 1


def _bump(counts: list[int], i: int) -> None:
    while len(counts) <= i:
        counts.append(0)
    counts[i] += 1


class Speculator:
    def __init__(self, config: SpecConfig, proposer: Proposer | None = None, *, model=None, runner=None):
        """`proposer`: one of the interface's implementations, instead of config.proposer's
        (tests: an oracle, an adversary). `model`, `runner`: the target's, which a model-based
        proposer drafts beside."""
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config, model, runner)
        # a step's rows stay within what the runner verifies fastest (TritonRunner: its chunk
        # graphs' scored rows; None: no such limit)
        self.max_step_rows = getattr(runner, "graphed_verify_rows", None)
        self.guard = YieldGuard(config.k, enabled=config.guard)
        self.cost = StepCost()
        self.draft_cost = DraftCost()
        self._draft_ms = 0.0  # the proposer's time in the latest drafts() call
        self.stats: dict[Hashable, SpecStats] = {}

    def forget_proposals(self) -> None:
        """A fresh proposer of the config's kind, keeping the guard's measured step cost (an
        ablation's untimed pass: the timed one must not draft from what the warm-up learnt).
        Refused while a request is live, or with a proposer that was given."""
        if self.stats:
            raise RuntimeError("forget_proposals with requests in flight")
        if self.config.proposer in ("ngram", "suffix"):  # (a draft model learns nothing across requests)
            self.proposer = make_proposer(self.config)
        self.guard = YieldGuard(self.config.k, enabled=self.config.guard)

    def start(self, rid: Hashable, prompt_ids: Sequence[int]) -> None:
        self.proposer.start(rid, prompt_ids)
        self.stats[rid] = SpecStats()

    def row_cost(self, decode_rows: int) -> float:
        """What one more draft token of a slot costs beside its share of a decode step: its
        verify row, plus proposing it (both measured; SpecConfig.row_cost until they are, or
        always with measure_cost off)."""
        if not self.config.measure_cost:
            return self.config.row_cost
        c = self.cost.row_cost(decode_rows, self.config.row_cost)
        share, per_token = self.cost.share_ms(decode_rows), self.draft_cost.ms_per_token
        if share and per_token is not None:
            c += per_token / share
        return c

    def drafts(self, contexts: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, tuple[int, ...]]:
        """Request id -> its draft for this step, for the decoding requests `contexts` (request
        id -> prompt and output so far); requests without one decode plainly."""
        cost = self.row_cost(len(contexts))
        lengths = {rid: self.guard.length(rid, cost) for rid in contexts}
        if self.max_step_rows is not None:
            _fit(lengths, self.max_step_rows - len(contexts))
        asks = {}
        for rid, ctx in contexts.items():
            k = lengths[rid]
            if k == 0:
                self.stats[rid].guard_skips += 1
            else:
                asks[rid] = (ctx, k)
        many = getattr(self.proposer, "propose_many", None)
        t0 = time.perf_counter()
        if many is not None:
            got = many(asks) if asks else {}
        else:
            got = {rid: self.proposer.propose(rid, ctx, k) for rid, (ctx, k) in asks.items()}
        self._draft_ms = 1e3 * (time.perf_counter() - t0)
        if asks:
            self.draft_cost.observe(self._draft_ms, sum(min(len(d), asks[rid][1]) for rid, d in got.items()))
        out = {}
        for rid, (_, k) in asks.items():
            d = got.get(rid, ())
            if d:
                out[rid] = tuple(d[:k])
            else:
                self.stats[rid].empty += 1
        self.guard.tick()
        return out

    def observe(self, rid: Hashable, drafted: int, kept: int, emitted: int) -> None:
        """A verify of `drafted` tokens kept `kept` and emitted `emitted` tokens."""
        self.guard.observe(rid, drafted, kept)
        self.stats[rid].record(drafted, kept, emitted)

    def record_step(self, rows: int, wall_ms: float) -> None:
        """A step that ran only decode and verify rows (`rows` of them) took `wall_ms`, its
        drafts() call included (taken out here: DraftCost has it)."""
        self.cost.observe(rows, max(wall_ms - self._draft_ms, 0.0))
        self._draft_ms = 0.0

    def finish(self, rid: Hashable, context: Sequence[int], num_prompt: int) -> SpecStats:
        self.proposer.finish(rid, context, num_prompt)
        self.guard.forget(rid)
        return self.stats.pop(rid)
