"""Speculator: the engine's speculative-decoding state (one proposer, one yield guard, the
measured step cost) and each request's counters, the activation proof of its rows.

Per step the engine asks `drafts(contexts)` for every decoding request's draft (the guard's
length, then the proposer's tokens), schedules them, runs the verify rows, accepts with
verify.py's rule, and reports back with `observe` (per verify) and `record_step` (the step's
rows and wall time, which the guard's cost model learns from). After a step that verified
nothing the engine may ask `plain_next` first: the next step's lengths decided a step early,
so that a next step with no draft runs ahead as plain decoding does.

Held decisions: with the yield guard on, a slot's length is decided again only at the guard's
probe cadence and after a verify or a shadow draft observed something of it; between those
steps it keeps its length, and the step rule's verdict on them is kept too. So a run held at
k = 0 costs the speculator a dict a step, not the guard's sums over every slot.

Quiet steps: where the latest step drafted nothing for the same decoding requests, none was
observed since, and the next step is neither on the probe cadence nor due a shadow draft, the
next step's lengths are that step's again (every input of theirs is unchanged), so `drafts` and
`plain_next` answer it in constant time: the guard ticks, and the requests' skip counts are
added up when the run of such steps ends. Why: a held run re-derived per step cost the engine
0.03 ms of host time a step at 16 slots on an H200, whose plain step is 0.6 ms (run 121: essays
at 16 slots, every pass that verified nothing at 0.84-0.94x AR).

Shadow drafts: a proposer whose drafts cost host lookups only (`shadows = True`: n-gram,
suffix) keeps drafting, now and then, for a slot at k = 0, without verifying: under the exact
rule a draft token is kept exactly when it is the token the target emits there, so once plain
decoding has emitted as many tokens, the draft's acceptance is known, and the guard observes it
as a verify's. The guard then needs no probes for such a slot (a probe turned a plain step into
a verify step of 2-4 ms against 0.5 ms plain for essays at 16 slots, H100 run 94: six such a
pass cost the run 4%), and a slot whose proposals start to pay is found at once. A slot's
shadows wait probe_every steps, doubling to probe_max until it verifies again; none is
proposed where the step rule's fits say no draft could pay (`StepRule.could_pay`: a step of
every slot's full draft, all kept). Model proposers (a draft model's forward is the cost) and
`verify="rejection"` (acceptance is drawn, not a match) keep the probes.

Token trees (`SpecConfig.tree`, a node budget N): a proposer with `propose_tree` gives each
slot its main draft and alternatives (`branches`, request id -> the alternative paths). Each
path is verified as a linear chain of its own: its rows run on a fork of the slot's pages (the
committed context shared, the partial last page copied: PagedMemory.fit), so sibling nodes
have their own KV rows and every row reduces over its own context's keys in plain decoding's
order, bitwise a decode step there, by the same construction as a chain's. A path's shared
prefix is computed again in each path (the cost of that construction: rows, not exactness).
After the forward the path that keeps the most draft tokens wins (the first of equals): its
fork becomes the slot's pages, the others are freed. The guard's length applies to the tree:
a slot granted j of k draft tokens gets a budget of N * j // k; and with the guard on, the
tree guard (guard.py's TreeGuard) drops a slot's alternatives for a while when the tokens
they gained do not pay for their rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from .config import SpecConfig
from .guard import CohortGuard, DraftCost, StepCost, StepRule, TreeGuard, YieldGuard
from .proposers import Proposer, make_proposer

__all__ = ["SpecStats", "Speculator"]


@dataclass
class SpecStats:
    """One request's speculation counters."""

    verify_steps: int = 0  # steps it verified a draft in
    drafted: int = 0  # draft tokens verified (the winning path's, with token trees)
    accepted: int = 0  # of those, kept
    emitted: int = 0  # tokens its verify steps emitted (kept + the target's own)
    guard_skips: int = 0  # steps the guard chose no draft for it
    empty: int = 0  # steps the guard allowed a draft and the proposer had none
    vetoed: int = 0  # of the guard_skips, steps its own rule drafted and the step-level rule did not
    hist: list[int] = field(default_factory=list)  # hist[a]: verify steps that kept a draft tokens
    position_drafted: list[int] = field(default_factory=list)  # per draft position i: drafted
    position_accepted: list[int] = field(default_factory=list)  # and kept
    tree_paths: int = 0  # token trees: alternative paths verified beside the main draft
    tree_tokens: int = 0  # and their draft tokens
    tree_wins: int = 0  # verify steps an alternative kept more than the main draft
    shadows: int = 0  # shadow drafts checked against what plain decoding emitted (module docstring)
    shadow_drafted: int = 0  # their tokens
    shadow_accepted: int = 0  # of those, the ones a verify would have kept

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


@dataclass
class _Shadow:
    """One slot's shadow drafts: the next step one may be proposed at, the pending one (its
    context length when proposed, its tokens, the step its tokens are all out by) and the
    wait between them."""

    due: int
    gap: int
    pos: int = 0
    draft: tuple[int, ...] = ()
    check: int = 0


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
        self._given = proposer is not None  # (forget_proposals keeps a given proposer)
        # a step's rows stay within what the runner verifies fastest (TritonRunner: its chunk
        # graphs' scored rows; None: no such limit)
        self.max_step_rows = getattr(runner, "graphed_verify_rows", None)
        # shadow drafts (module docstring): a proposer whose drafts cost host lookups only, and
        # the exact rule, under which a draft's acceptance is what plain decoding's tokens say;
        # the yield guard then needs no probes
        self.shadowing = (getattr(self.proposer, "shadows", False) and config.verify == "exact"
                          and config.guard is True)
        self.guard = _guard(config, probes=not self.shadowing)
        self.cost = StepCost()
        # the step-level rule (guard.py's StepRule): with the yield guard on and the cost measured;
        # it re-weighs a held verdict on the guard's cadence
        self.step_rule = (StepRule(probe_every=self.guard.probe_every)
                          if config.guard is True and config.measure_cost else None)
        self.draft_cost = DraftCost()
        self._draft_ms = 0.0  # the proposer's time in the latest drafts() call
        self._stats: dict[Hashable, SpecStats] = {}  # (`stats`: with the quiet steps counted in)
        # token trees: request id -> the alternative paths of the latest drafts() call
        self.branches: dict[Hashable, tuple[tuple[int, ...], ...]] = {}
        self.tree = config.tree is not None and hasattr(self.proposer, "propose_tree")
        self.tree_guard = TreeGuard(enabled=config.guard is True)
        self._cost = config.row_cost  # the latest decision's row cost (the tree guard's too)
        # the next step's lengths, decided early (plain_next; _QUIET: the latest step's, all 0)
        self._pinned: dict[Hashable, int] | object | None = None
        # the slots' own lengths as last decided, and the slots observed since (_decide)
        self._held: dict[Hashable, int] = {}
        self._dirty: set[Hashable] = set()
        # the step rule's verdict on _held, with the step shape it was weighed for (_lengths;
        # None: not weighed since)
        self._veto: tuple[tuple, bool] | None = None
        # a step the engine's pipeline could split is expected to go faster whole (the latest
        # weighing's word: the engine then runs it as one verify step)
        self.whole = False
        self._shadows: dict[Hashable, _Shadow] = {}
        self._shadow_pays = True  # the step rule's could_pay at the latest cadence step
        self._shadow_next = 0  # the first step a shadow may be due at
        # quiet steps (module docstring): the requests and `split` of the latest step that
        # drafted nothing, with those of them the step rule vetoed (None: that step drafted),
        # and the quiet steps taken since, not yet in the requests' counts
        self._quiet: tuple[tuple, bool, tuple] | None = None
        self._quiet_steps = 0
        self._vetoed: list[Hashable] = []  # the latest _lengths' vetoed requests

    def forget_proposals(self) -> None:
        """A fresh proposer of the config's kind, keeping the guard's measured step cost (an
        ablation's untimed pass: the timed one must not draft from what the warm-up learnt).
        Refused while a request is live; a proposer that was given is kept (the caller's)."""
        if self._stats:
            raise RuntimeError("forget_proposals with requests in flight")
        self._end_quiet()
        # (a draft model learns nothing across requests; a given proposer is the caller's)
        if self.config.proposer in ("ngram", "suffix") and not self._given:
            self.proposer = make_proposer(self.config)
        self.guard = _guard(self.config, probes=not self.shadowing)
        self.tree_guard = TreeGuard(enabled=self.config.guard is True)
        self._pinned = None
        self._held, self._dirty, self._veto, self._shadows, self._shadow_next = {}, set(), None, {}, 0
        self.whole = False
        if self.step_rule is not None:  # (its fits kept, as the row cost's are)
            self.step_rule.forget_veto()

    def start(self, rid: Hashable, prompt_ids: Sequence[int]) -> None:
        self.proposer.start(rid, prompt_ids)
        self._stats[rid] = SpecStats()

    def row_cost(self, decode_rows: int) -> float:
        """What one more draft token of a slot costs beside its share of a decode step: its
        verify row, plus proposing it (both measured; SpecConfig.row_cost until they are, or
        always with measure_cost off)."""
        if not self.config.measure_cost:
            return self.config.row_cost
        c = self.cost.row_cost(decode_rows, self.config.row_cost)
        if self.step_rule is not None:
            # one line over both kinds of step reads a verify step's own overhead (not launched
            # ahead, a chunk graph) as its extra rows' cost: with few extra rows (a slot or two
            # drafting) a row then costs most of a share, up to all of it where the line falls
            # below zero, and a slot so priced never drafts, so is never measured again (H200
            # run 122: agentic at one slot read c = 1 after its warm-up, then verified one draft
            # token and decoded 93 steps plainly; simulated, a first verify of 5 rows at 1.6 ms
            # beside plain steps of 0.1 ms does it). That overhead is the step rule's to weigh;
            # a row costs at most what the verify steps' own slope says.
            c = min(c, self.step_rule.row_cost(decode_rows, self.config.row_cost))
        share, per_token = self.cost.share_ms(decode_rows), self.draft_cost.ms_per_token
        if share and per_token is not None:
            c += per_token / share
        return c

    @property
    def decided_row_cost(self) -> float:
        """The row cost the guard's latest decisions used (a step's telemetry: computing it
        anew every step cost host time at 16 slots)."""
        return self._cost

    def plain_next(self, rids: Sequence[Hashable], of: int | None = None, split: bool = False) -> bool:
        """Whether the next step drafts nothing for the decoding requests `rids`: decides that
        step's draft lengths now, and the next `drafts` call keeps them. Only between a step
        that verified nothing and the next one: the guard's lengths change with what a verify or a
        shadow draft observed and with the step count, never with this step's tokens, so they
        are what that call would decide (the row cost is one step older). A runner may then
        launch the next step before this one's tokens are read (run-ahead), as plain decoding
        does. The engine's pipeline asks it of a half before planning its step (`of`: the
        decoding requests of both halves, as `drafts` takes it; `split` as `drafts`)."""
        if of is None and self._is_quiet(rids, split):
            self._pinned = _QUIET
            return True
        self._end_quiet()
        self._pinned = self._lengths(rids, of=of, split=split)
        return not any(self._pinned.values())

    def _is_quiet(self, rids: Sequence[Hashable], split: bool) -> bool:
        """Whether this step's lengths are the latest step's, all 0 (module docstring): the
        same requests, nothing observed since, not on the probe cadence, no shadow draft due."""
        q = self._quiet
        return (q is not None and not self._dirty and q[1] == split and not self.guard.on_cadence()
                and (not self.shadowing or (self.guard.step < self._shadow_next and len(self._shadows) == len(q[0])))
                and q[0] == tuple(rids))

    @property
    def stats(self) -> dict[Hashable, SpecStats]:
        """Request id -> its counters so far (the quiet steps taken counted in)."""
        self._count_quiet()
        return self._stats

    def _count_quiet(self) -> None:
        """The quiet steps taken so far, into their requests' counts: each skipped, and vetoed
        where the decision they repeat vetoed it."""
        q, n = self._quiet, self._quiet_steps
        if q is None or not n:
            return
        self._quiet_steps = 0
        for rid in q[0]:
            self._stats[rid].guard_skips += n
        for rid in q[2]:
            self._stats[rid].vetoed += n

    def _end_quiet(self) -> None:
        """A quiet run's end: its steps counted, and the next step decided in full."""
        self._count_quiet()
        q, self._quiet = self._quiet, None
        if q is None:
            return
        if self._pinned is _QUIET:  # (plain_next's quiet word, as the full decision it stands for)
            self._pinned = dict.fromkeys(q[0], 0)
            for rid in q[2]:
                self._stats[rid].vetoed += 1

    def _decide(self, rids: Sequence[Hashable], of: int | None = None, split: bool = False) -> dict[Hashable, int]:
        """Each slot's own length (the guard's). With the yield guard on, a slot's length is
        decided again only at the probe cadence's steps (where probes fall, and the row cost
        moves) and after something was observed of it; in between the slot keeps its
        length, so a run held at k = 0 costs the speculator a dict a step, not the guard's sums
        (H100 run 93: deciding every slot every step was 0.13 ms of host time a step at 16
        slots, essays 0.69x of AR against 0.91x with the held decisions, run 94). `rids` may be
        a part of the decoding requests (the pipeline's halves, `of` of them in all): the held
        lengths are kept for every request, each part's decided on its own calls (both parts
        of a step see the same cadence: the guard ticks once a step, `drafts`)."""
        g = self.guard
        n = of or len(rids)
        if not isinstance(g, YieldGuard) or not g.enabled:
            cost = self._cost = self.row_cost(n)
            return {rid: g.length(rid, cost) for rid in rids}
        held, dirty = self._held, self._dirty
        if g.on_cadence() or any(rid not in held for rid in rids):
            cost = self._cost = self.row_cost(n)
            held = {**held, **{rid: g.length(rid, cost) for rid in rids}}
            if self.step_rule is not None and self.shadowing:
                k = self.config.k
                rows = len(rids) * (1 + k)
                if self.max_step_rows is not None:
                    rows = min(rows, self.max_step_rows)
                slots, part_rows, part_of, _ = _weighed(len(rids), rows, of, split)
                # (a step the pipeline may split can also run whole: either may pay)
                self._shadow_pays = (self.step_rule.could_pay(slots, part_rows, part_of)
                                     or (part_of != of and self.step_rule.could_pay(len(rids), rows)))
            changed = True
        else:
            changed = bool(dirty) and not dirty.isdisjoint(rids)
            if changed:  # (the row cost as measured now: cheap next to the guard's sums)
                cost = self._cost = self.row_cost(n)
                held = {**held, **{rid: g.length(rid, cost) for rid in rids if rid in dirty}}
        if changed:
            self._held, self._veto = held, None
            # a probe lasts one step: its slot is decided again at the next (another part's
            # observed slots stay to be decided at its own call)
            self._dirty = dirty.difference(rids) | {rid for rid in rids if held[rid] and g.probing(rid)}
        return held

    def _lengths(self, rids, pinned: Mapping[Hashable, int] | None = None,
                 of: int | None = None, split: bool = False) -> dict[Hashable, int]:
        """The draft length per request for one step (those in `pinned` as decided already):
        the guard's, cut to the runner's fastest verify, weighed as a step by the step rule
        (`of`: the step is a part of that many decoding requests, `_decide`; `split`: the
        step may run as the pipeline's two halves, and is weighed so, `_weighed`)."""
        pinned = pinned or {}
        vetoed = []
        decided = self._decide(rids, of, split)
        lengths = {rid: pinned[rid] if rid in pinned else decided[rid] for rid in rids}
        if self.max_step_rows is not None:
            _fit(lengths, self.max_step_rows - len(lengths))
        if self.step_rule is not None and any(lengths.values()) and any(rid not in pinned for rid in lengths):
            drafted = sum(lengths.values())
            # (the verdict is kept for a step of the same shape: the pipeline's halves, a step
            # that may or may not split, and one that lost slots are weighed anew)
            key = (of, split, len(lengths), drafted)
            veto = self._veto[1] if self._veto is not None and self._veto[0] == key else None
            if veto is None or pinned or self.guard.on_cadence():
                tokens = sum(self.guard.expected(rid, k) for rid, k in lengths.items())
                extra = drafted * (self.draft_cost.ms_per_token or 0.0)
                n, all_rows = len(lengths), len(lengths) + drafted
                slots, rows, part_of, share = _weighed(n, all_rows, of, split)
                whole = False
                if part_of != of:  # (split: run whole where that is expected to go faster)
                    rule = self.step_rule
                    whole = (rule.ratio(n, all_rows, tokens, extra)[0]
                             > rule.ratio(slots, rows, share * tokens, share * extra, part_of)[0])
                    if whole:
                        slots, rows, part_of, share = n, all_rows, of, 1.0
                veto = not self.step_rule.pays(slots, rows, share * tokens, share * extra, self.guard.step, part_of)
                self.whole = whole
                if not pinned:
                    self._veto = (key, veto)
            if veto:
                for rid, k in lengths.items():  # (plain decoding, but for the probes)
                    if k and not self.guard.probing(rid):
                        lengths[rid] = 0
                        self._stats[rid].vetoed += 1
                        vetoed.append(rid)
        self._vetoed = vetoed
        return lengths

    def drafts(self, contexts: Mapping[Hashable, Sequence[int]], *, of: int | None = None,
               tick: bool = True, split: bool = False) -> dict[Hashable, tuple[int, ...]]:
        """Request id -> its draft for this step, for the decoding requests `contexts` (request
        id -> prompt and output so far; read only for those the guard lets draft, so it may be
        a lazy mapping); requests without one decode plainly. The engine's pipeline drafts
        each half on its own: `of` the decoding requests of both, `tick` only on the second
        (the guard counts steps of every slot, so both halves meet the same cadence). `split`:
        a whole step that the pipeline may run as two halves, weighed as those (guard.py)."""
        if (of is None and tick and (self._pinned is None or self._pinned is _QUIET)
                and self._is_quiet(contexts, split)):
            self._pinned, self._draft_ms = None, 0.0
            self._quiet_steps += 1
            self.guard.tick()
            return {}
        self._end_quiet()
        pinned, self._pinned = self._pinned, None
        complete = pinned is None or pinned.keys() == contexts.keys()  # (decided for these requests alone)
        if pinned is not None and complete:
            lengths = pinned
        else:  # (the requests changed since, or a part of them: those not pinned decided now)
            lengths = self._lengths(list(contexts), pinned, of, split)
        asks = {}
        for rid, k in lengths.items():
            if k == 0:
                self._stats[rid].guard_skips += 1
            else:
                asks[rid] = (contexts[rid], k)
        many = getattr(self.proposer, "propose_many", None)
        t0 = time.perf_counter()
        self.branches = {}
        if self.tree:
            got = self._trees(asks, len(contexts) + sum(lengths.values()))
        elif many is not None:
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
                self._stats[rid].empty += 1
        if self.shadowing:
            self._shadow(contexts, lengths)
            if of is not None:  # (a part: the other's shadows may be due before this one's)
                self._shadow_next = 0
        if tick:
            self.guard.tick()
        # (a step that drafted nothing, decided in full for its requests by the held rule, may
        # start a quiet run: one decided in part kept no verdict for the next to reuse)
        if (of is None and tick and complete and not any(lengths.values()) and isinstance(self.guard, YieldGuard)
                and self.guard.enabled and not self.tree):
            self._quiet = (tuple(contexts), split, tuple(self._vetoed))
        return out

    def _shadow(self, contexts: Mapping[Hashable, Sequence[int]], lengths: Mapping[Hashable, int]) -> None:
        """Shadow drafts for the slots at k = 0 this step (module docstring): a slot's pending
        draft is checked once plain decoding has emitted as many tokens, and the acceptance it
        shows is observed as a verify's would be; a slot due proposes its next. The wait
        between a slot's shadows doubles, from probe_every to probe_max steps, until it verifies
        again; none is proposed while the step rule says no draft could pay."""
        g, step = self.guard, self.guard.step
        if step < self._shadow_next and len(self._shadows) == len(lengths) and not any(lengths.values()):
            return  # (nothing due: a held run costs this comparison)
        cadence = step + g.probe_every - step % g.probe_every  # (where _shadow_pays is decided again)
        upcoming = cadence
        for rid, k in lengths.items():
            sh = self._shadows.get(rid)
            if k:  # (a verify measures it)
                if sh is not None:
                    sh.draft, sh.gap = (), g.probe_every
                continue
            if sh is None:
                sh = self._shadows[rid] = _Shadow(due=step, gap=g.probe_every)
            ctx = None
            if sh.draft and step >= sh.check:
                ctx = contexts[rid]
                got = ctx[sh.pos : sh.pos + len(sh.draft)]
                kept = 0
                while kept < len(sh.draft) and kept < len(got) and got[kept] == sh.draft[kept]:
                    kept += 1
                g.observe(rid, len(sh.draft), kept)
                self._dirty.add(rid)
                st = self._stats[rid]
                st.shadows += 1
                st.shadow_drafted += len(sh.draft)
                st.shadow_accepted += kept
                # (the wait doubles until the slot verifies again, which resets it: a slot whose
                # drafts the step rule keeps vetoing learns nothing new from more shadows, and at
                # 16 slots one every 16 steps cost essays 0.05 ms a step, H100 run 97)
                sh.gap = min(2 * sh.gap, g.probe_max)
                sh.draft, sh.due = (), step + sh.gap
            if not sh.draft and step >= sh.due and self._shadow_pays:
                ctx = contexts[rid] if ctx is None else ctx
                d = tuple(self.proposer.propose(rid, ctx, self.config.k))[: self.config.k]
                if d:
                    sh.pos, sh.draft, sh.check = len(ctx), d, step + len(d)
                else:
                    sh.due = step + sh.gap
            if sh.draft:
                upcoming = min(upcoming, sh.check)
            elif self._shadow_pays:
                upcoming = min(upcoming, max(sh.due, step + 1))
        self._shadow_next = upcoming

    def _trees(self, asks: Mapping[Hashable, tuple[Sequence[int], int]], rows: int) -> dict[Hashable, tuple[int, ...]]:
        """Each ask's tree: its main draft is returned, its alternatives go to `branches`, while
        the step's rows (`rows` so far: every decode row and main draft token) stay within the
        runner's fastest form; a path costs its tokens and its fed token's row."""
        k_max, budget = self.config.k, self.config.tree
        room = None if self.max_step_rows is None else self.max_step_rows - rows
        got = {}
        for rid, (ctx, k) in asks.items():
            paths = self.proposer.propose_tree(rid, ctx, k, max(k, budget * k // k_max))
            if not paths:
                continue
            got[rid] = paths[0]
            alts = []
            for p in paths[1:] if self.tree_guard.allows(rid) else ():
                if room is not None and room < 1 + len(p):
                    break
                alts.append(p)
                if room is not None:
                    room -= 1 + len(p)
            if alts:
                self.branches[rid] = tuple(alts)
        return got

    def observe(self, rid: Hashable, drafted: int, kept: int, emitted: int, *, alternatives: int = 0,
                alternative_tokens: int = 0, won: bool = False, main_kept: int | None = None) -> None:
        """A verify of `drafted` tokens kept `kept` and emitted `emitted` tokens (token trees:
        those of the winning path, beside `alternatives` other paths of `alternative_tokens`
        tokens; `won`: an alternative kept more than the main draft, which kept `main_kept`)."""
        self.guard.observe(rid, drafted, kept, emitted)
        self._dirty.add(rid)
        if alternatives:
            gained = kept - (kept if main_kept is None else main_kept) if won else 0
            self.tree_guard.observe(rid, alternatives + alternative_tokens, gained, self._cost)
        st = self._stats[rid]
        st.record(drafted, kept, emitted)
        st.tree_paths += alternatives
        st.tree_tokens += alternative_tokens
        st.tree_wins += int(won)

    def record_step(self, rows: int, wall_ms: float, verify: bool = True, ahead: bool = False,
                    pipelined: bool = False) -> None:
        """A step that ran only decode and verify rows (`rows` of them; `verify`: some of them
        verify rows; `ahead`: launched ahead by the runner; `pipelined`: a half's step in the
        engine's pipeline, `wall_ms` the time it added) took `wall_ms`, its drafts() call
        included (taken out here: DraftCost has it)."""
        ms = max(wall_ms - self._draft_ms, 0.0)
        self.cost.observe(rows, ms)
        if self.step_rule is not None:
            self.step_rule.observe(rows, ms, verify, ahead, pipelined)
        self._draft_ms = 0.0

    def skip_step(self) -> None:
        """A step whose time says nothing of its rows (it captured a CUDA graph): not fitted."""
        self._draft_ms = 0.0

    def finish(self, rid: Hashable, context: Sequence[int], num_prompt: int) -> SpecStats:
        self._end_quiet()
        self.proposer.finish(rid, context, num_prompt)
        self.guard.forget(rid)
        self.tree_guard.forget(rid)
        self._shadows.pop(rid, None)
        self._dirty.discard(rid)
        self._held.pop(rid, None)
        return self._stats.pop(rid)


_QUIET = object()  # plain_next's word: the next step is a quiet one (module docstring)


def _weighed(slots: int, rows: int, of: int | None, split: bool) -> tuple[float, float, int | None, float]:
    """(slots, rows, of, share of its tokens) the step rule weighs for a step of `rows` rows over
    `slots` decoding slots: with `split` (a whole step the engine's pipeline may run as two
    halves), one half of it, of all `slots` (StepRule's `of`), with half its tokens."""
    if split and of is None and slots >= 2:
        return slots / 2, rows / 2, slots, 0.5
    return slots, rows, of, 1.0


def _guard(config: SpecConfig, probes: bool = True):
    """The config's draft-length guard: the yield guard (on or off; `probes` off where shadow
    drafts measure its slots), or seed 002's cohort rule."""
    if config.guard == "cohort":
        return CohortGuard(config.k, min_emitted=config.cohort_min_emitted)
    return YieldGuard(config.k, enabled=config.guard, probes=probes)
