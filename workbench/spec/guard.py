"""The yield guard: each step, a draft length 0..k_max for each slot, from what it measured.

Each slot's acceptance is a per-token rate alpha (a draft token is kept with probability alpha,
given the one before it was): counts of kept and rejected draft tokens, decayed towards a prior
of 2 kept to 1 rejected at each observation (a verify of the slot's draft, or a shadow draft's
check), so alpha is the acceptance of the slot's latest drafts however far apart they fell.
(Decayed every step instead, a slot held at k = 0 forgot what its shadow drafts showed before
the next one came: 44% of it left after 16 steps, 4% after 64, so code editing's slots, whose
shadows kept 7 of 8 draft tokens, read as the prior's 2/3 and at 16 slots never drafted; with
a simulated H100, `scripts/host_overhead.py --device-ms`, 1.10-1.15x AR with the pipeline,
and 1.43-1.48x with the counts kept, docs/GPU_NOTES.md session 31.) A slot the
guard kept at k = 0 for `probe_every` steps in a row drafts one token once (a probe, one verify
row; each probe that changes nothing doubles the wait for the next, up to `probe_max`), so a
proposer that starts to pay, or a cost estimate that was too high, is found again (without it a
slot whose first drafts missed, or that began where rows were dear, would never draft again).
Probes fall on the steps of one shared cadence (every `probe_every`-th step, counted by
`tick`): a slot whose wait is over probes at the next such step, beside the other slots due.
(With `probes` off the speculator measures such a slot's acceptance from shadow drafts instead:
speculator.py.) Waits count steps, not calls. Between them a run the guard keeps at k = 0 is
plain decoding step after step, which a runner may launch ahead of the host (H100 run 90: 16
slots probing at staggered steps left essays no two plain steps in a row to overlap). The
lengths depend on the counts and the step alone, never on the step's own tokens, so the
speculator may decide a step's lengths one step early (`Speculator.plain_next`). A draft of k
then emits on average E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens for the step's cost of 1 +
c k, where c is one verify row's cost beside the slot's share of a decode step. The guard picks
the k with the most tokens per cost; k = 0 is plain decoding, at plain decoding's cost, and is
chosen unless drafting gains `margin`.

c is measured from the run's own steps (`StepCost`: wall time against rows of the steps that
ran only decode and verify rows, least squares with forgetting): a step of n decode rows costs
a + b n, so one more row costs b beside each slot's share (a + b n) / n. Until it has seen two
different row counts it uses SpecConfig.row_cost. With the step rule on, c is at most what the
verify steps' own slope says (`StepRule.row_cost`; the prior until `explore` of them were
measured): the one line over both kinds reads a verify step's own overhead as its extra rows'
cost, and where those were few (a slot or two drafting) that is most of a share, up to all of it,
so the slot stops drafting and is never measured again (H200 run 122: agentic at one slot).
Proposing costs too (`DraftCost`): a draft model's forwards, or a lookup's host time, per draft
token; the speculator adds it to c as a fraction of the same share, and takes it out of the step
times StepCost fits. On a GPU a decode step is bound by reading the weights and a few more rows
are nearly free (c near 0: draft long); on a CPU at 16 slots a row costs nearly what a slot's
share does (c near 1: draft only what is very likely kept).

The step as a whole (`StepRule`, the speculator's): a slot's draft makes its step a verify
step, which on the GPU costs more than its rows: a plain step is launched ahead of the host
(run-ahead) and a verify is not, and its forward is a chunk graph rather than a decode graph.
So with the cost measured, each step's lengths are also weighed together: the step's expected
tokens over the fitted wall time of a verify step of its rows, against plain decoding's tokens
(one a slot) over the fitted wall time of a plain step, each fitted from the run's own steps of
that kind. When drafting does not gain `margin`, the step decodes plainly (its probes aside).
H100 run 91 showed why: essays at 16 slots, each slot's rule drafting (row cost 0.06 from one
fit over both kinds), verified in 866 of 96 steps' slots at 4.3 tokens each and went at 0.75x
plain decoding, whose steps ran ahead at 0.8 ms against 3-4 ms a verify step. A vetoed run is
let through once, at the probe cadence, when the plain steps under the veto took 1/remeasure
times what the step was expected to cost beyond a plain one, so a verify fit that was too dear
is measured again at about `remeasure` of the run; and once a verify step was measured, the
rule vetoes until `explore` plain steps were too (a run whose slots all draft from its first
step has none to compare with). `could_pay` asks whether the best step, every slot's full
draft all kept, would pay: where it would not, the speculator measures no acceptance.

The engine's pipeline (SpecConfig.pipeline) verifies the slots' halves in turn, one half's host
work beside the other's forward, so a half's step costs the time it adds, not a whole verify
step's wall time: the rule fits those steps apart (`half`) and weighs a half (`of`: the
decoding slots of both) against plain decoding of all of them. Where the pipeline could run,
a whole step's drafts are weighed as its two halves (the speculator's `split`): pricing them as
one verify step would veto the very steps that would start it (H100 runs 98-106: code editing
at 16 slots, a whole verify step 3.8-4.7 ms for ~112 tokens, vetoed; its forward alone 2.6).
Until a half step was measured, a half pays, so the pipeline gets measured. Such a step is
weighed whole too, and runs whole where that is expected to go faster (`ratio`; the
speculator's `whole`, which the engine follows): on an H100 essays at 16 slots never paid as
halves, so never drafted, while whole steps went at 1.21x AR (session 32, run 113). The half
fit takes the steady halves only: the first of a run holds the other half's planning too,
which later halves do under a forward (fitted, the pipeline's start made every half look
dearer than a whole step, and once a whole step won the halves were never measured again).

Seed 002's rule, for comparison (`SpecConfig(guard="cohort")`, `CohortGuard`; the draft-yield
ablation's `guards=cohort`): fewer than `cohort_min_emitted` (6) tokens emitted per request on
the first packed sample turns speculation off for the rest of the run; otherwise every slot
drafts k for the rest of it. Nothing is measured after that first step and nothing probes.
(A chain of k < 5 draft tokens emits at most k + 1 < 6 a step, so with seed 002's threshold the
rule always turns such runs off after one verify step: seed 002 verified deeper trees.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable

__all__ = ["CohortGuard", "DraftCost", "StepCost", "StepRule", "TreeGuard", "YieldGuard"]


# A step slower than OUTLIER times its fitted time counts as that much: one step that compiled a
# kernel (no graph captured, so the engine cannot tell it apart) or met a collector pause, at
# hundreds of ms, would otherwise make rows look dear for hundreds of steps (the fit forgets 2% a
# step), while a real change still moves the fit, one clipped step at a time.
OUTLIER = 5.0


class StepCost:
    """wall_ms ~ a + b rows, fitted online over decode/verify steps (recursive least squares
    with forgetting factor `forget`; after 4 steps, a step past OUTLIER times the fit is
    clipped to it)."""

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self._s = [0.0] * 5  # weighted sums: n, x, x^2, y, xy
        self.num_steps = 0
        self._rows: set[int] = set()

    def observe(self, rows: int, wall_ms: float) -> None:
        if self.num_steps >= 4:  # (a step past OUTLIER times its fitted time counts as that much)
            at = self.at(rows)
            if at is not None and at > 0:
                wall_ms = min(wall_ms, OUTLIER * at)
        f = self.forget
        n, x, xx, y, xy = self._s
        self._s = [f * n + 1, f * x + rows, f * xx + rows * rows, f * y + wall_ms, f * xy + rows * wall_ms]
        self.num_steps += 1
        if len(self._rows) < 2:
            self._rows.add(rows)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in ms, or None before two different row counts were seen."""
        n, x, xx, y, xy = self._s
        det = n * xx - x * x
        if len(self._rows) < 2 or det <= 1e-9:
            return None
        b = (n * xy - x * y) / det
        a = (y - b * x) / n
        # the least-squares line with a, b >= 0: clamping b alone would keep the intercept of a
        # falling line (H100 run 96: code editing at one slot, verify steps of 5 rows at 0.95 ms
        # and one of 4 at 1.6 ms, read as 4.3 ms for any verify: the slot never drafted)
        if b < 0:
            return max(y / n, 0.0), 0.0
        if a < 0:
            return 0.0, (xy / xx if xx > 0 else 0.0)
        return a, b

    def at(self, rows: int) -> float | None:
        """The fitted wall time of a step of `rows` rows, in ms: the line where two row counts
        were seen, the (weighted) mean where one was, None before any step."""
        ab = self.fit()
        if ab is not None:
            return ab[0] + ab[1] * rows
        n, _, _, y, _ = self._s
        return y / n if n else None

    def speaks_for(self, rows: float) -> bool:
        """Whether the fit prices a step of `rows` rows from what it saw: a line once two row
        counts were seen; with one, steps of at least half its rows. Below that its flat price
        (the one size's mean) overstates a small step: on an H100 a whole verify fit holding one
        16-slot step (79 rows, 4.4 ms) priced every step of the tail after the pipeline, 2-7
        slots, at 4.4 ms, so none verified and none was measured (run 119, agentic at 16
        slots: the last 60-70 steps of each pass decoded plainly, where a slot's 8 kept drafts
        took 1.2 ms in run 113)."""
        if not self.num_steps:
            return False
        if len(self._rows) >= 2:
            return True
        (only,) = self._rows
        return 2 * rows >= only

    def row_cost(self, decode_rows: int, prior: float) -> float:
        """One verify row's cost beside one slot's share of a step of `decode_rows` rows."""
        ab = self.fit()
        if ab is None:
            return prior
        a, b = ab
        share = (a + b * decode_rows) / max(decode_rows, 1)
        return min(b / share, 1.0) if share > 0 else prior

    def share_ms(self, decode_rows: int) -> float | None:
        """One slot's share of a step of `decode_rows` rows, in ms (None before a fit)."""
        ab = self.fit()
        if ab is None:
            return None
        a, b = ab
        return (a + b * decode_rows) / max(decode_rows, 1)


class DraftCost:
    """What proposing costs, per draft token of one request, in ms: a proposer's wall time per
    step over the tokens it proposed (a draft model's round is shared by the requests drafting
    in it, so this is a round's time over the requests in it), smoothed over steps."""

    def __init__(self, smooth: float = 0.9):
        self.smooth = smooth
        self.ms_per_token: float | None = None

    def observe(self, wall_ms: float, tokens: int) -> None:
        if tokens <= 0:
            return
        x = wall_ms / tokens
        m = self.ms_per_token
        self.ms_per_token = x if m is None else self.smooth * m + (1 - self.smooth) * x


PRIOR_KEPT, PRIOR_REJECTED = 2.0, 1.0


@dataclass
class _Slot:
    kept: float = PRIOR_KEPT
    rejected: float = PRIOR_REJECTED
    since: int | None = None  # the step its run at k = 0 began, or its latest probe (None: drafting)
    gap: int = 0  # steps at k = 0 before the next probe (0: not yet set)
    probing: bool = False  # the latest length was a probe

    @property
    def alpha(self) -> float:
        return self.kept / (self.kept + self.rejected)


class YieldGuard:
    def __init__(self, k_max: int, *, enabled: bool = True, decay: float = 0.95, margin: float = 0.05,
                 probe_every: int = 16, probe_max: int = 256, probes: bool = True):
        self.k_max = k_max
        self.enabled = enabled
        self.decay = decay
        self.margin = margin
        self.probe_every = probe_every
        # each probe that leaves the slot at k = 0 doubles the wait for the next, up to
        # probe_max: a proposer that never pays costs a probe every probe_max steps, not every
        # probe_every (H200 run 81: a self-draft's probes alone cost C1 18%)
        self.probe_max = max(probe_max, probe_every)
        # False: no probes (the speculator measures such slots' acceptance from shadow drafts,
        # checked against what plain decoding emitted: Speculator's module docstring)
        self.probes = probes
        self.step = 0  # ticks so far: probes fall on the steps where step % probe_every == 0
        self._slots: dict[Hashable, _Slot] = {}

    def _slot(self, rid: Hashable) -> _Slot:
        s = self._slots.get(rid)
        if s is None:
            s = self._slots[rid] = _Slot()
        return s

    def best(self, rid: Hashable, row_cost: float) -> int:
        """The length with the most expected tokens per cost for `rid` (0: plain decoding gains
        more than `margin`), without the probe's bookkeeping."""
        alpha = min(self._slot(rid).alpha, 0.999)
        best_k, best = 0, 1.0 + self.margin
        for k in range(1, self.k_max + 1):
            gain = (1 - alpha ** (k + 1)) / (1 - alpha) / (1 + row_cost * k)
            if gain > best:
                best_k, best = k, gain
        return best_k

    def length(self, rid: Hashable, row_cost: float) -> int:
        """The draft length for request `rid` this step (k_max with the guard off)."""
        if not self.enabled:
            return self.k_max
        best_k = self.best(rid, row_cost)
        slot = self._slots[rid]
        slot.probing = False
        if best_k == 0:
            if slot.since is None:
                slot.since = self.step
            slot.gap = slot.gap or self.probe_every
            # (counted in steps, not calls: a step decided without asking still counts)
            if self.probes and self.step - slot.since + 1 >= slot.gap and self.on_cadence():
                slot.since = self.step + 1
                slot.gap = min(2 * slot.gap, self.probe_max)
                slot.probing = True
                return 1  # the probe
        else:
            slot.since = None
            slot.gap = self.probe_every
        return best_k

    def on_cadence(self) -> bool:
        """Whether this step is one of the shared cadence's, where probes fall."""
        return self.step % self.probe_every == 0

    def observe(self, rid: Hashable, drafted: int, kept: int, emitted: int | None = None) -> None:
        """A verify of `drafted` tokens kept `kept` of them (`emitted`: CohortGuard's interface;
        the acceptance rate needs only the kept count)."""
        s, d = self._slot(rid), self.decay  # (the older observations' weight: module docstring)
        s.kept = PRIOR_KEPT + d * (s.kept - PRIOR_KEPT) + kept
        s.rejected = PRIOR_REJECTED + d * (s.rejected - PRIOR_REJECTED) + int(kept < drafted)

    def tick(self) -> None:
        """One step passed (the probe cadence's count)."""
        self.step += 1

    def alpha(self, rid: Hashable) -> float:
        return self._slot(rid).alpha if rid in self._slots else _Slot().alpha

    def probing(self, rid: Hashable) -> bool:
        """Whether the latest length given `rid` was a probe."""
        s = self._slots.get(rid)
        return s is not None and s.probing

    def expected(self, rid: Hashable, k: int) -> float:
        """E(k): the tokens a draft of k is expected to emit (1 at k = 0)."""
        a = min(self.alpha(rid), 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def forget(self, rid: Hashable) -> None:
        self._slots.pop(rid, None)


class StepRule:
    """The step-level rule (module docstring): plain and verify steps' wall times fitted apart,
    and each step's drafts weighed against plain decoding."""

    def __init__(self, margin: float = 0.05, probe_every: int = 16, explore: int = 4, remeasure: float = 0.01):
        self.plain = StepCost()
        self.verify = StepCost()
        self.half = StepCost()  # the pipeline's verify steps of one half (the time each added)
        # plain steps measured before the first comparison: a run whose slots all draft from the
        # start never decodes plainly on its own, so it vetoes until it has (H100 run 92: essays
        # at 16 slots verified in every step, with no plain step to compare them with)
        self.explore = explore
        # a held veto lets one step through, on the probe cadence, once the plain steps decoded
        # under it took 1/remeasure times what that step is expected to cost beyond a plain
        # one: re-measuring a verify fit that may be too dear costs about `remeasure` of the
        # run (a wait doubling from 16 steps let 4 verify steps of ~3 ms through in a 255-step
        # pass of essays at 16 slots, 6% of it: H100 run 94)
        self.remeasure = remeasure
        self.margin, self.probe_every = margin, probe_every
        self.since: int | None = None  # the step the current run of vetoes began (None: none)
        self.ahead_seen = False  # a plain step ran ahead (observe)

    def forget_veto(self) -> None:
        """A fresh run of vetoes (the fits kept)."""
        self.since = None

    def observe(self, rows: int, wall_ms: float, verify: bool, ahead: bool = False,
                pipelined: bool = False) -> None:
        """A step of `rows` rows took `wall_ms` (`verify`: it verified drafts; `ahead`: a plain
        step the runner had launched ahead; `pipelined`: a half's step in the pipeline, its
        wall time the time it added). Once a plain step ran ahead, only such steps are
        plain decoding's price: the one after a verify cannot, and is a verify's cost (H100 run
        96: essays at 16 slots measured plain steps only between verifies, at 1.4 ms against
        0.57 ms run ahead, so verifies of 2.4 ms for 51 tokens looked like they paid)."""
        if pipelined:  # (a half's plain step, drafts all cut, prices neither kind)
            if verify:
                self.half.observe(rows, wall_ms)
        elif verify:
            self.verify.observe(rows, wall_ms)
        elif ahead or not self.ahead_seen:
            if ahead and not self.ahead_seen:
                self.ahead_seen, self.plain = True, StepCost()
            self.plain.observe(rows, wall_ms)

    def row_cost(self, decode_rows: int, prior: float) -> float:
        """One verify row's cost beside one slot's share of a plain step of `decode_rows` rows,
        each from its own kind's fit: the verify steps' slope over the plain steps' share (a
        verify step's overhead as such is this rule's to weigh, not a row's); `prior` until
        `explore` verify steps of two sizes and a plain step were measured (a slope from two
        or three verify steps is mostly their noise)."""
        ab, p = self.verify.fit(), self.plain.at(decode_rows)
        if ab is None or self.verify.num_steps < self.explore or not p or p <= 0:
            return prior
        return min(ab[1] / (p / max(decode_rows, 1)), 1.0)

    def ratio(self, slots: int, rows: int, tokens: float, extra_ms: float,
              of: int | None = None) -> tuple[float, float]:
        """(such a step's expected tokens a ms over plain decoding's, its expected ms beyond
        plain decoding of its slots): inf where its kind was not measured yet, or at one size
        only and well above this step's (`StepCost.speaks_for`: it pays, so it gets measured),
        0 where plain steps must be measured first. `of`: the step is a half of
        the decoding slots (the engine's pipeline: its halves' steps alternate), priced by the
        half steps' fit and weighed against a plain step of all `of` of them."""
        fit = self.verify if of is None else self.half
        if fit.num_steps and self.plain.num_steps < self.explore:
            return 0.0, 0.0  # (measure plain steps first)
        n = of or slots
        p, v = self.plain.at(n), fit.at(rows)
        if p is None or v is None or p <= 0 or not fit.speaks_for(rows):
            return math.inf, 0.0  # (not measured at such a size: it pays, so it gets measured)
        return tokens / (v + extra_ms) / (n / p), v + extra_ms - p * slots / n

    def _weigh(self, slots: int, rows: int, tokens: float, extra_ms: float,
               of: int | None = None) -> tuple[bool, float]:
        """(whether such a step gains `margin`, its expected ms beyond plain decoding of its
        slots), as `ratio` weighs it."""
        r, more = self.ratio(slots, rows, tokens, extra_ms, of)
        return r >= 1 + self.margin, more

    def could_pay(self, slots: int, rows: int, of: int | None = None) -> bool:
        """Whether a verify step of `rows` rows over `slots` slots (of `of`, as `_weigh`), every
        row's token kept (the best any draft could do), would gain: where it would not, no
        draft can, and measuring acceptance is wasted (the speculator's shadow drafts)."""
        return self._weigh(slots, rows, float(rows), 0.0, of)[0]

    def pays(self, slots: int, rows: int, tokens: float, extra_ms: float, step: int,
             of: int | None = None) -> bool:
        """Whether a verify step of `rows` rows over `slots` decoding slots, expected to emit
        `tokens` and to take `extra_ms` beside its forward (proposing), gains `margin` over a
        plain step (True until both kinds were measured; `step`: the guard's step count, on
        whose probe cadence a veto held long enough lets one step through to be measured)."""
        gains, more = self._weigh(slots, rows, tokens, extra_ms, of)
        if gains:
            self.since = None
            return True
        if self.since is None:
            self.since = step
        p = self.plain.at(of or slots)
        if p and step % self.probe_every == 0 and (step - self.since) * p * self.remeasure >= more:
            self.since = step + 1
            return True
        return False


@dataclass
class _TreeTrial:
    """One slot's trial window (verifies with alternatives, their rows, the tokens they gained)
    and its chains-only wait."""

    verifies: int = 0
    rows: int = 0
    gained: int = 0
    chains_left: int = 0  # verifies still to draft chains only
    wait: int = 0  # the next failed window's chains-only wait


class TreeGuard:
    """Token trees' guard, per slot: whether this step's tree may carry alternative paths.

    An alternative path's rows are worth the draft tokens an alternative keeps beyond what the
    main draft kept, when it wins. After `trials` verifies with alternatives, a slot whose
    gained tokens per alternative row are below the row cost c (a token is worth a slot's
    share of a decode step, a row c of it) drafts chains only, for `wait` verifies, doubled
    each time a new trial window fails too (up to `wait_max`); a window that pays resets it.
    So a tree that never wins costs about `trials` verifies' rows per wait, and one that wins
    keeps branching."""

    def __init__(self, enabled: bool = True, trials: int = 4, wait: int = 8, wait_max: int = 256):
        self.enabled, self.trials, self.wait0, self.wait_max = enabled, trials, wait, wait_max
        self._slots: dict[Hashable, _TreeTrial] = {}

    def _trial(self, rid: Hashable) -> _TreeTrial:
        return self._slots.setdefault(rid, _TreeTrial(wait=self.wait0))

    def allows(self, rid: Hashable) -> bool:
        if not self.enabled:
            return True
        st = self._trial(rid)
        if st.chains_left > 0:
            st.chains_left -= 1
            return False
        return True

    def observe(self, rid: Hashable, rows: int, gained: int, cost: float) -> None:
        """A verify whose alternatives took `rows` rows and kept `gained` tokens beyond the
        main draft; `cost` is a verify row's cost (YieldGuard's c)."""
        if not self.enabled or rows == 0:
            return
        st = self._trial(rid)
        st.verifies += 1
        st.rows += rows
        st.gained += gained
        if st.verifies >= self.trials:
            if st.gained < cost * st.rows:
                st.chains_left, st.wait = st.wait, min(2 * st.wait, self.wait_max)
            else:
                st.wait = self.wait0
            st.verifies = st.rows = st.gained = 0

    def forget(self, rid: Hashable) -> None:
        self._slots.pop(rid, None)


class CohortGuard:
    """Seed 002's cohort-yield rule, YieldGuard's interface: every slot drafts k_max until the
    first step that verified drafts (the packed sample) has been observed; then, if the requests
    verified in it emitted fewer than `min_emitted` tokens each on average, every slot decodes
    plainly for the rest of the run (k = 0, no probes), else every slot keeps drafting k_max.
    `decision`: None before the sample, "on" or "off" after it."""

    def __init__(self, k_max: int, *, min_emitted: int = 6):
        self.k_max = k_max
        self.min_emitted = min_emitted
        self.decision: str | None = None
        self._emitted = 0
        self._requests = 0

    def length(self, rid: Hashable, row_cost: float) -> int:
        if self.decision is None and self._requests:
            self.decision = "on" if self._emitted >= self.min_emitted * self._requests else "off"
        return 0 if self.decision == "off" else self.k_max

    def observe(self, rid: Hashable, drafted: int, kept: int, emitted: int | None = None) -> None:
        """A verify of `drafted` tokens kept `kept` and emitted `emitted` (default kept + 1)."""
        if self.decision is None and drafted:
            self._emitted += kept + 1 if emitted is None else emitted
            self._requests += 1

    def tick(self) -> None:
        pass

    def forget(self, rid: Hashable) -> None:
        pass
