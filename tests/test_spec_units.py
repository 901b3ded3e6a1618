"""Unit tests for speculative decoding's pure parts (issue 21): the proposers, the acceptance
rules, the per-position generators, the yield guard and its step-cost model, the config.

test_speculation.py proves the engine's output exact end to end; these tests pin each part's
own contract on small hand-built inputs and against brute-force references, so that a wrong
proposal, a miscounted acceptance or a biased rejection sampler shows up here, named, rather
than as a lower draft yield in a benchmark."""

import math
import random
import re

import pytest
import torch

from workbench.errors import ConfigError, WorkbenchError
from workbench.sampling import token_generator
from workbench.spec import MAX_K, NgramProposer, SpecConfig, StepCost, SuffixProposer, YieldGuard
from workbench.spec.guard import CohortGuard
from workbench.spec.verify import accept_exact, accept_rejection, num_accepted


# --- NgramProposer -----------------------------------------------------------------------------


def _ngram_ref(context, k, n_max, n_min):
    """Brute force: for n = n_max..n_min, the latest end j < len(context) of an earlier
    occurrence of the context's last n tokens; the draft is the k tokens after it."""
    L = len(context)
    for n in range(n_max, n_min - 1, -1):
        if n > L:
            continue
        suffix = list(context[L - n :])
        for j in range(L - 1, n - 1, -1):
            if list(context[j - n : j]) == suffix:
                return tuple(context[j : j + k])
    return ()


def _propose_fresh(context, k, n_max=4, n_min=2):
    p = NgramProposer(n_max, n_min)
    p.start("r", context)
    return p.propose("r", context, k)


def test_ngram_takes_the_longest_suffix_first():
    # (1, 2, 3) recurs at end 3 (followed by 10); the shorter (2, 3) recurs later, at end 7
    ctx = [1, 2, 3, 10, 7, 2, 3, 20, 9, 1, 2, 3]
    assert _propose_fresh(ctx, 3, n_max=3, n_min=2) == (10, 7, 2)
    # with the 3-gram out of reach, the 2-gram's latest occurrence decides
    assert _propose_fresh(ctx, 3, n_max=2, n_min=2) == (20, 9, 1)


def test_ngram_takes_the_latest_earlier_occurrence():
    ctx = [1, 2, 5, 1, 2, 6, 8, 1, 2]
    assert _propose_fresh(ctx, 2, n_max=2, n_min=2) == (6, 8)
    assert _propose_fresh(ctx, 1, n_max=2, n_min=2) == (6,)


def test_ngram_proposes_nothing_when_no_suffix_recurs():
    assert _propose_fresh([1, 2, 3, 4, 5, 6], 4, n_max=4, n_min=1) == ()
    # a single token recurs (3), but ngram_min=2 asks for at least a 2-gram
    assert _propose_fresh([3, 1, 2, 4, 3], 4, n_max=4, n_min=2) == ()
    assert _propose_fresh([3, 1, 2, 4, 3], 4, n_max=4, n_min=1) == (1, 2, 4, 3)
    assert _propose_fresh([], 4) == ()
    assert _propose_fresh([7], 4, n_max=2, n_min=1) == ()


def test_ngram_never_matches_the_suffix_with_itself():
    # the whole context is the suffix: its only occurrence is at the end, which is no match
    assert _propose_fresh([4, 5, 6, 7], 4, n_max=4, n_min=4) == ()
    # [5, 5]: the 1-gram (5,) ends earlier at 1, so the draft is what followed it, never empty
    assert _propose_fresh([5, 5], 3, n_max=1, n_min=1) == (5,)
    # overlapping occurrence: (7, 7) ends at 2 and at 3 (the suffix); the earlier one counts
    assert _propose_fresh([7, 7, 7], 3, n_max=2, n_min=2) == (7,)


def test_ngram_proposes_at_most_k_tokens():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3]
    for k in range(0, 12):
        d = _propose_fresh(ctx, k)
        assert len(d) == min(k, 9)
        assert d == tuple(([4, 5, 6, 7, 8, 9, 1, 2, 3] * 2)[:k])[: len(d)]


@pytest.mark.parametrize("n_max,n_min", [(4, 2), (3, 1), (2, 2), (5, 3)])
def test_ngram_incremental_equals_fresh_and_reference(n_max, n_min):
    """One proposer fed a growing context (skipping random steps, as when the guard gives a slot
    no draft) proposes what a fresh proposer and the brute force propose on the full context."""
    rnd = random.Random(n_max * 10 + n_min)
    block = [rnd.randrange(6) for _ in range(7)]
    seq = []
    while len(seq) < 400:  # random tokens over a small vocabulary, with copied blocks mixed in
        seq += block if rnd.random() < 0.3 else [rnd.randrange(6) for _ in range(rnd.randrange(1, 6))]
    inc = NgramProposer(n_max, n_min)
    inc.start("r", seq[:1])
    num_nonempty = 0
    for L in range(1, len(seq) + 1):
        if rnd.random() < 0.25:
            continue
        ctx = seq[:L]
        k = rnd.randrange(1, 8)
        got = inc.propose("r", ctx, k)
        assert got == _propose_fresh(ctx, k, n_max, n_min) == _ngram_ref(ctx, k, n_max, n_min), L
        assert len(got) <= k
        num_nonempty += bool(got)
    assert num_nonempty > 100  # the comparison ran over real proposals, not only empty ones


def test_ngram_keeps_requests_apart():
    p = NgramProposer(2, 2)
    p.start("a", [])
    p.start("b", [])
    assert p.propose("a", [1, 2, 9, 1, 2], 2) == (9, 1)
    assert p.propose("b", [3, 1, 2], 2) == ()  # a's (1, 2) is not b's
    p.finish("a", [1, 2, 9, 1, 2], 2)
    with pytest.raises(KeyError):
        p.propose("a", [1, 2, 9, 1, 2], 2)


# --- SuffixProposer ----------------------------------------------------------------------------


def _finished(p, rid, prompt, output):
    p.start(rid, prompt)
    p.propose(rid, list(prompt), 1)  # it ran: its own counts were built, then it finishes
    p.finish(rid, list(prompt) + list(output), len(prompt))


def test_suffix_learns_a_finished_requests_output():
    p = SuffixProposer(depth=8, min_match=2)
    a_prompt, a_out = [1, 2, 3], [10, 11, 12, 13, 14]
    b = [50, 51, 10, 11]
    p.start("a", a_prompt)
    p.propose("a", a_prompt + a_out, 4)
    p.start("b", b)
    assert p.propose("b", b, 5) == ()  # a is still running: its output is not learnt yet
    p.finish("a", a_prompt + a_out, len(a_prompt))
    assert p.propose("b", b, 5) == (12, 13, 14)  # a's continuation, up to where it ends
    assert p.propose("b", b, 2) == (12, 13)
    # only the output is learnt (after contexts that may reach into the prompt)
    p.start("c", [60, 1, 2])
    assert p.propose("c", [60, 1, 2], 3) == ()
    p.start("d", [60, 2, 3])
    assert p.propose("d", [60, 2, 3], 2) == (10, 11)


def test_suffix_ties_go_to_the_lower_token_id():
    p = SuffixProposer(depth=4, min_match=2)
    _finished(p, "a1", [90], [7, 8, 20])
    _finished(p, "a2", [91], [7, 8, 15])
    p.start("b", [5, 7, 8])
    assert p.propose("b", [5, 7, 8], 1) == (15,)
    # a higher count wins over a lower id
    _finished(p, "a3", [92], [7, 8, 20])
    p.start("c", [5, 7, 8])
    assert p.propose("c", [5, 7, 8], 1) == (20,)


def test_suffix_prefers_the_longest_match_over_the_most_frequent():
    p = SuffixProposer(depth=4, min_match=2)
    _finished(p, "a1", [90], [1, 7, 8, 30])
    _finished(p, "a2", [91], [2, 7, 8, 40])
    _finished(p, "a3", [92], [3, 7, 8, 40])
    p.start("b", [1, 7, 8])
    assert p.propose("b", [1, 7, 8], 1) == (30,)  # (1, 7, 8) matched, though (7, 8) -> 40 twice
    p.start("c", [4, 7, 8])
    assert p.propose("c", [4, 7, 8], 1) == (40,)


def test_suffix_respects_min_match():
    for min_match, expected in [(1, (12,)), (2, (12,)), (3, ())]:
        p = SuffixProposer(depth=8, min_match=min_match)
        _finished(p, "a", [1], [10, 11, 12])
        p.start("b", [70, 10, 11])  # matches a's output on 2 tokens only
        assert p.propose("b", [70, 10, 11], 1) == expected, min_match
    p = SuffixProposer(depth=8, min_match=2)
    _finished(p, "a", [1], [10, 11, 12])
    p.start("b", [70, 11])  # a 1-token match is below min_match=2
    assert p.propose("b", [70, 11], 1) == ()


def test_suffix_uses_the_requests_own_context():
    p = SuffixProposer(depth=8, min_match=2)
    ctx = [5, 6, 7, 1, 2, 5, 6]
    p.start("r", ctx)
    assert p.propose("r", ctx, 3) == (7, 1, 2)
    ctx += [7, 1]
    assert p.propose("r", ctx, 2) == (2, 5)


# --- accept_exact, num_accepted ----------------------------------------------------------------


class _Picks:
    """pick(i) from a list, counting the calls and refusing out-of-order rows."""

    def __init__(self, picks):
        self.picks, self.rows = picks, []

    def __call__(self, i):
        assert i == len(self.rows), "rows are picked in order, once each"
        self.rows.append(i)
        return self.picks[i]


def test_accept_exact_keeps_all_plus_a_bonus():
    pick = _Picks([5, 6, 7, 9])
    out = accept_exact([5, 6, 7], pick)
    assert out == [5, 6, 7, 9] and pick.rows == [0, 1, 2, 3]
    assert num_accepted([5, 6, 7], out) == 3


def test_accept_exact_stops_at_the_first_mismatch_lazily():
    for m in range(4):  # mismatch at row m
        draft = [5, 6, 7, 8]
        picks = draft[:m] + [99] + [100 + i for i in range(8)]
        pick = _Picks(picks)
        out = accept_exact(draft, pick)
        assert out == draft[:m] + [99]
        assert len(pick.rows) == m + 1  # never a row past the first mismatch
        assert num_accepted(draft, out) == m


def test_accept_exact_empty_draft_is_one_decode():
    pick = _Picks([42, 43])
    assert accept_exact([], pick) == [42] and pick.rows == [0]
    assert num_accepted([], [42]) == 0


def test_num_accepted_agrees_with_accept_exact_on_random_bursts():
    rnd = random.Random(3)
    for _ in range(500):
        k = rnd.randrange(0, 6)
        draft = [rnd.randrange(3) for _ in range(k)]
        picks = [rnd.randrange(3) for _ in range(k + 1)]
        out = accept_exact(draft, _Picks(picks))
        kept = 0
        while kept < k and picks[kept] == draft[kept]:
            kept += 1
        assert out == picks[: kept + 1]
        assert num_accepted(draft, out) == kept


# --- accept_rejection --------------------------------------------------------------------------

_VOCAB, _K = 10, 2


def _tv(p, q):
    return 0.5 * float((p - q).abs().sum())


def _random_dist(g):
    return torch.softmax(torch.randn(_VOCAB, generator=g) * 1.5, dim=-1)


def test_accept_rejection_follows_the_target_distribution():
    """A deterministic draft, a fixed random target per position: the first emitted token's
    empirical distribution converges to the target's at position 0 (total variation shrinking
    with N, and at the largest N far below the distance to unrelated distributions); the second,
    given the first was the draft token, follows position 1's."""
    g = torch.Generator().manual_seed(1234)
    target = torch.stack([_random_dist(g) for _ in range(_K + 1)])  # rows 0, 1 and the bonus row
    # the target's likeliest tokens as the draft: kept about 2/3 of the time at row 0, so both
    # the rejection branch and the conditional second token get many samples
    draft = [int(target[i].argmax()) for i in range(_K)]
    assert 0.2 < float(target[0, draft[0]]) < 0.9
    refs = [_random_dist(g) for _ in range(10)]
    ref_distance = sum(_tv(target[0], r) for r in refs) / len(refs)

    sampler = torch.Generator().manual_seed(99)
    distances = []
    for n in (1000, 10000, 100000):
        first = torch.zeros(_VOCAB)
        second = torch.zeros(_VOCAB)
        for _ in range(n):
            out = accept_rejection(draft, lambda i: target[i], sampler)
            assert 1 <= len(out) <= _K + 1
            first[out[0]] += 1
            if out[0] == draft[0]:
                second[out[1]] += 1
        distances.append(_tv(first / n, target[0]))
    assert distances[0] > distances[1] > distances[2], distances
    assert distances[2] * 20 < ref_distance, (distances, ref_distance)
    num_second = int(second.sum())
    assert num_second > 30000
    second_distance = _tv(second / num_second, target[1])
    assert second_distance * 20 < sum(_tv(target[1], r) for r in refs) / len(refs), second_distance


def test_accept_rejection_is_deterministic_under_a_seeded_generator():
    g = torch.Generator().manual_seed(5)
    target = torch.stack([_random_dist(g) for _ in range(_K + 1)])
    runs = []
    for _ in range(2):
        s = torch.Generator().manual_seed(17)
        runs.append([tuple(accept_rejection([1, 2], lambda i: target[i], s)) for _ in range(200)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5  # the draws vary from call to call


def test_accept_rejection_point_masses():
    """A target sure of the draft keeps it all; a target that gives it no mass never keeps it."""
    sure = torch.zeros(_K + 1, _VOCAB)
    sure[0, 3] = sure[1, 4] = sure[2, 5] = 1.0
    s = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert accept_rejection([3, 4], lambda i: sure[i], s) == [3, 4, 5]
    never = torch.full((_K + 1, _VOCAB), 1.0 / (_VOCAB - 1))
    never[:, 3] = 0.0
    for _ in range(50):
        out = accept_rejection([3, 4], lambda i: never[i], s)
        assert len(out) == 1 and out[0] != 3


# --- token_generator ---------------------------------------------------------------------------


def _draws(seed, index, position, n=8):
    return tuple(torch.rand(n, generator=token_generator(seed, index, position)).tolist())


def test_token_generator_is_a_pure_function_of_the_triple():
    for triple in [(0, 0, 0), (7, 3, 11), (2**62, 5, 1000)]:
        assert _draws(*triple) == _draws(*triple)
    # a generator used in between changes nothing for the next one of the same triple
    g = token_generator(7, 3, 11)
    torch.rand(100, generator=g)
    assert _draws(7, 3, 11) == _draws(7, 3, 11)


def test_token_generator_differs_across_positions_indices_and_seeds():
    by_position = {_draws(1, 0, p) for p in range(300)}
    by_index = {_draws(1, i, 0) for i in range(300)}
    by_seed = {_draws(s, 0, 0) for s in range(300)}
    assert len(by_position) == len(by_index) == len(by_seed) == 300
    # neighbouring positions never share draws (not one stream shifted by an offset)
    for p in range(50):
        a = set(_draws(9, 2, p, 32))
        assert not a & set(_draws(9, 2, p + 1, 32))
        assert not a & set(_draws(9, 3, p, 32))
    # and swapping index and position gives another generator
    assert _draws(4, 5, 6) != _draws(4, 6, 5)


def test_token_generator_unseeded_is_none():
    assert token_generator(None, 0, 0) is None
    assert token_generator(None, 3, 17) is None


# --- YieldGuard --------------------------------------------------------------------------------


def test_guard_off_always_drafts_k_max():
    guard = YieldGuard(6, enabled=False)
    for _ in range(30):
        guard.observe("r", 6, 0)
    for c in (0.0, 0.5, 1.0):
        assert guard.length("r", c) == 6
        assert guard.length("new", c) == 6


def test_the_cohort_guard_decides_once_on_its_first_sample():
    guard = CohortGuard(8, min_emitted=6)
    assert guard.length("a", 1.0) == 8 and guard.decision is None
    guard.observe("a", 0, 0, 1)  # (a request that verified nothing is not in the sample)
    assert guard.length("a", 1.0) == 8 and guard.decision is None
    guard.observe("a", 8, 3, 4)
    guard.observe("b", 8, 6, 7)  # 11 emitted by 2 requests: 5.5 each, fewer than 6
    assert guard.length("a", 0.0) == 0 and guard.decision == "off"
    guard.observe("a", 8, 8, 9)  # (after the decision nothing changes it)
    assert guard.length("b", 0.0) == guard.length("new", 0.0) == 0
    on = CohortGuard(4, min_emitted=5)
    on.observe("a", 4, 4)  # emitted defaults to kept + 1
    assert on.length("a", 1.0) == on.length("z", 1.0) == 4 and on.decision == "on"


class _Repeat:
    """A proposer whose every draft is `token` repeated k times."""

    name = "repeat"

    def __init__(self, token: int):
        self.token = token

    def start(self, rid, prompt_ids):
        pass

    def propose(self, rid, context, k):
        return (self.token,) * k

    def finish(self, rid, context, num_prompt):
        pass


def _rule_only(k_max, **kw):
    """A guard without the periodic probe: length() is then the gain rule alone, and calling it
    does not move the skip counter towards a probe."""
    return YieldGuard(k_max, probe_every=10**9, **kw)


def test_guard_high_acceptance_drafts_long():
    guard = _rule_only(8)
    for _ in range(100):
        guard.observe("r", 8, 8)
        guard.tick()
    assert guard.alpha("r") > 0.95
    assert guard.length("r", 0.0) == 8
    assert guard.length("r", 0.02) >= 6


def test_guard_always_rejected_stops_and_keeps_its_counts_until_observed_again():
    """Counts decay towards the prior at each observation, not each step (guard.py's module
    docstring): a slot whose drafts were always rejected stops drafting and stays stopped
    however many steps pass (only a probe or a shadow draft can show otherwise), and a few
    drafts kept in full bring it back."""
    guard = _rule_only(4)
    c = 0.1
    assert guard.length("r", c) >= 1  # the prior drafts at a cheap row
    for _ in range(50):
        guard.observe("r", 4, 0)
    low = guard.alpha("r")
    assert low < 0.1 and guard.length("r", c) == 0  # (the prior weighs as much as the latest ~20 drafts)
    for _ in range(500):
        guard.tick()
    assert guard.alpha("r") == low and guard.length("r", c) == 0
    for seen in range(1, 50):
        guard.observe("r", 4, 4)
        if guard.length("r", c) >= 1:
            break
    assert seen < 10, seen


def test_a_shadowed_slots_acceptance_lasts_between_its_shadows():
    """A slot held at k = 0 whose shadow drafts (one every 64 steps) keep 7 of 8 tokens: its
    alpha after four of them is theirs, not the prior's, and steps alone do not move it."""
    guard = _rule_only(8)
    for _ in range(4):
        guard.observe("r", 8, 7)
        for _ in range(64):
            guard.tick()
    assert guard.alpha("r") > 0.85
    assert guard.length("r", 0.2) >= 4


def test_guard_probes_a_skipped_slot_with_a_doubling_gap():
    guard = YieldGuard(4, probe_every=5, probe_max=20, decay=1.0)  # no decay: only the probe brings it back
    for _ in range(50):
        guard.observe("r", 4, 0)
    ks = []
    for _ in range(80):  # (waits are counted in steps: the guard's ticks)
        ks.append(guard.length("r", 0.1))
        guard.tick()
    # probes on the cadence (every 5th step) once 5, then 10, then 20 steps went at k = 0, and
    # every 20 from there (probe_max)
    assert [i for i, k in enumerate(ks) if k] == [5, 15, 35, 55, 75] and set(ks) == {0, 1}
    # a slot that drafts on its own merit is never counted towards a probe
    guard.observe("good", 4, 4)
    assert all(guard.length("good", 0.1) >= 2 for _ in range(20))
    # once a slot drafts again, its gap is back to probe_every
    for _ in range(200):
        guard.observe("r", 4, 4)
    assert guard.length("r", 0.1) >= 2
    for _ in range(5000):
        guard.observe("r", 4, 0)
    ks = []
    for _ in range(20):  # (from step 80, a cadence step)
        ks.append(guard.length("r", 0.1))
        guard.tick()
    assert [i for i, k in enumerate(ks) if k] == [5, 15]


def test_guard_longer_rows_never_draft_longer():
    guard = _rule_only(MAX_K)
    rnd = random.Random(0)
    for s in range(40):  # slots with acceptances across 0..1
        kept, rejected = rnd.randrange(0, 200), rnd.randrange(0, 60)
        if kept:
            guard.observe(s, kept, kept)
        for _ in range(rejected):
            guard.observe(s, 1, 0)
    costs = [i / 40 for i in range(41)]
    num_changed = 0
    for s in range(40):
        ks = [guard.length(s, c) for c in costs]
        assert all(a >= b for a, b in zip(ks, ks[1:])), (s, guard.alpha(s), ks)
        num_changed += ks[0] != ks[-1]
    assert num_changed > 10
    # and at one row cost, a higher acceptance never drafts shorter
    by_alpha = sorted(range(40), key=guard.alpha)
    for c in (0.0, 0.1, 0.3):
        ks = [guard.length(s, c) for s in by_alpha]
        assert all(a <= b for a, b in zip(ks, ks[1:])), (c, ks)


def test_guard_forget_restores_the_prior():
    guard = _rule_only(4)
    prior = guard.alpha("fresh")
    for _ in range(50):
        guard.observe("r", 4, 0)
    assert guard.alpha("r") < prior
    guard.forget("r")
    assert guard.alpha("r") == prior
    assert guard.length("r", 0.1) == guard.length("fresh", 0.1) >= 1


# --- StepCost ----------------------------------------------------------------------------------


def test_step_cost_needs_two_row_counts():
    cost = StepCost()
    assert cost.fit() is None
    for _ in range(20):
        cost.observe(4, 10.0)
    assert cost.fit() is None
    assert cost.row_cost(4, 0.37) == 0.37  # the prior, before a fit
    cost.observe(8, 12.0)
    a, b = cost.fit()
    assert a == pytest.approx(8.0) and b == pytest.approx(0.5)


@pytest.mark.parametrize("a,b", [(2.0, 0.5), (30.0, 0.05), (0.5, 3.0)])
def test_step_cost_recovers_a_line(a, b):
    cost = StepCost()
    rnd = random.Random(1)
    for _ in range(200):
        rows = rnd.randrange(1, 33)
        cost.observe(rows, a + b * rows)
    fa, fb = cost.fit()
    assert fa == pytest.approx(a, rel=1e-6, abs=1e-9) and fb == pytest.approx(b, rel=1e-6)
    for n in (1, 4, 16, 64):
        assert cost.row_cost(n, 0.9) == pytest.approx(min(b / ((a + b * n) / n), 1.0), rel=1e-6)


def test_step_cost_follows_a_change_and_caps_at_one():
    cost = StepCost()
    for i in range(100):
        rows = 1 + i % 8
        cost.observe(rows, 5.0 + 1.0 * rows)
    for i in range(400):  # the machine changed: forgetting lets the fit move to the new line
        rows = 1 + i % 8
        cost.observe(rows, 1.0 + 2.0 * rows)
    a, b = cost.fit()
    assert a == pytest.approx(1.0, rel=1e-2) and b == pytest.approx(2.0, rel=1e-2)
    # a line through a negative intercept: a is clamped at 0, and a row costs a whole share
    steep = StepCost()
    for rows in (2, 4, 6, 8):
        steep.observe(rows, -3.0 + 1.0 * rows)
    assert steep.fit()[0] == 0.0
    assert steep.row_cost(4, 0.1) == 1.0
    # free rows (b = 0): a row costs nothing
    flat = StepCost()
    for rows in (1, 5, 9):
        flat.observe(rows, 7.0)
    assert flat.row_cost(8, 0.5) == 0.0


# --- SpecConfig --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, dict(proposer="suffix", k=7, verify="rejection", guard=False, row_cost=0.6,
                                         measure_cost=False, ngram_max=6, ngram_min=3, suffix_depth=12)])
def test_spec_config_round_trips(kw):
    c = SpecConfig(**kw)
    d = c.to_dict()
    assert SpecConfig.from_dict(d) == c
    assert d == {**SpecConfig().to_dict(), **kw}


def test_spec_config_unknown_key_lists_the_valid_keys():
    with pytest.raises(ConfigError) as e:
        SpecConfig.from_dict({"k": 2, "draft_len": 3})
    msg = str(e.value)
    assert "draft_len" in msg and "\n" not in msg
    for name in SpecConfig().to_dict():
        assert name in msg


@pytest.mark.parametrize("kw,field", [(dict(k=0), "k"), (dict(k=MAX_K + 1), "k"), (dict(proposer="eagle"), "proposer"),
                                      (dict(verify="typical"), "verify"), (dict(row_cost=1.5), "row_cost"),
                                      (dict(ngram_min=5, ngram_max=4), "ngram_min"), (dict(tree=4), "tree"),
                                      (dict(guard=1), "guard"),
                                      (dict(measure_cost="yes"), "measure_cost")])
def test_spec_config_refuses_bad_values(kw, field):
    with pytest.raises(WorkbenchError, match=field):
        SpecConfig(**kw)


def test_a_slow_proposer_costs_what_it_takes_and_the_guard_stops_drafting():
    """A proposer that takes 30 ms per call, beside steps of about 1 ms a slot: its time per
    draft token joins the row cost, the step times the cost model fits leave it out, and the
    guard then keeps the slot at k = 0 (always-accepted drafts do not pay for it)."""
    import time

    from workbench.spec.speculator import Speculator

    class Slow:
        name = "slow"

        def start(self, rid, prompt_ids):
            pass

        def propose(self, rid, context, k):
            time.sleep(0.03)
            return tuple(range(k))

        def finish(self, rid, context, num_prompt):
            pass

    sp = Speculator(SpecConfig(k=4, row_cost=0.05), Slow())
    sp.step_rule = None  # (the slot's own rule alone: the step rule is the next tests')
    sp.start("a", [1, 2, 3])
    assert sp.row_cost(1) == 0.05  # nothing measured yet: the config's prior
    assert sp.drafts({"a": [1, 2, 3]}) == {"a": (0, 1, 2, 3)}
    sp.record_step(1, sp._draft_ms + 1.0)  # a plain-sized step, once the proposer's time is out
    sp.observe("a", 4, 4, 5)
    sp.drafts({"a": [1, 2, 3]})
    sp.record_step(5, sp._draft_ms + 1.2)
    a, b = sp.cost.fit()
    assert a == pytest.approx(0.95, abs=1e-6) and b == pytest.approx(0.05, abs=1e-6)
    assert sp.draft_cost.ms_per_token >= 7  # 30 ms over 4 tokens
    assert sp.row_cost(1) > 5
    for _ in range(3):
        sp.observe("a", 4, 4, 5)
    assert sp.drafts({"a": [1, 2, 3]}) == {}
    assert sp.stats["a"].guard_skips == 1


def test_a_steps_drafts_fit_the_runners_graphed_verify_rows():
    """A runner whose chunk graphs take 9 rows: three slots asking k = 4 each (15 rows) are cut
    to 6 draft tokens in all, longest first (2 each); without the limit each gets 4."""
    from types import SimpleNamespace

    from workbench.spec.speculator import Speculator, _fit

    ctx = {r: [1, 2, 3] for r in "abc"}
    sp = Speculator(SpecConfig(k=4, guard=False), _Repeat(7), runner=SimpleNamespace(graphed_verify_rows=9))
    for r in ctx:
        sp.start(r, ctx[r])
    assert sp.drafts(ctx) == {r: (7, 7) for r in "abc"}
    free = Speculator(SpecConfig(k=4, guard=False), _Repeat(7), runner=SimpleNamespace(graphed_verify_rows=None))
    for r in ctx:
        free.start(r, ctx[r])
    assert free.drafts(ctx) == {r: (7,) * 4 for r in "abc"}
    lengths = {"a": 5, "b": 1, "c": 3}
    _fit(lengths, 6)
    assert lengths == {"a": 2, "b": 1, "c": 3}  # (5,1,3 -> 4,1,3 -> 3,1,3 -> 2,1,3: the first of equals is cut)
    _fit(lengths, -2)
    assert lengths == {"a": 0, "b": 0, "c": 0}


def test_probes_fall_on_one_cadence_whatever_step_a_slot_stopped_drafting_at():
    """Slots that stopped drafting at different steps probe only at steps that are multiples of
    probe_every (counted by tick), all due slots together: between those steps the guard's k = 0
    is plain decoding step after step, which a runner can launch ahead."""
    guard = YieldGuard(4, probe_every=8, probe_max=32, decay=1.0)
    probes = {"a": [], "b": [], "c": []}
    for step in range(200):
        if step in (0, 3, 13):  # each slot's drafts start to miss at its own step
            rid = "abc"[(0, 3, 13).index(step)]
            for _ in range(50):
                guard.observe(rid, 4, 0)
        for rid in probes:
            if step >= (0, 3, 13)["abc".index(rid)] and guard.length(rid, 0.1):
                probes[rid].append(step)
        guard.tick()
    for rid, steps in probes.items():
        assert steps and all(s % 8 == 0 for s in steps), (rid, steps)
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        assert gaps == sorted(gaps) and gaps[-1] == 32, (rid, gaps)  # (the wait still doubles to probe_max)


def test_plain_next_decides_the_next_steps_lengths_once():
    """`plain_next` decides the coming step's draft lengths a step early and `drafts` keeps them:
    True while every slot is at k = 0 (their contexts are then never read), False when a probe is
    due, and the guard's step counts advance once a step either way."""
    from workbench.spec.speculator import Speculator

    class Unread(dict):
        def __getitem__(self, rid):
            raise AssertionError(f"the context of {rid} was read at k = 0")

    sp = Speculator(SpecConfig(k=4, row_cost=0.1, measure_cost=False), _Repeat(1))
    sp.guard.probe_every = sp.guard.probe_max = 4
    for r in "ab":
        sp.start(r, [1, 2])
        for _ in range(50):
            sp.guard.observe(r, 4, 0)
    seen = []
    for step in range(12):
        plain = sp.plain_next(["a", "b"])
        ctx = Unread(a=None, b=None) if plain else {"a": [1, 2], "b": [1, 2]}
        got = sp.drafts(ctx)
        assert plain == (got == {})
        seen.append(bool(got))
    assert seen == [i % 4 == 0 and i > 0 for i in range(12)]  # probes at steps 4 and 8 only
    # the requests changed since plain_next: the lengths of those still there are kept, a new one's decided
    assert sp.stats["a"].guard_skips == 10  # (twelve steps, two of them probes)
    sp.start("c", [1])
    assert sp.plain_next(["a", "b"]) is False  # (step 12: a probe is due)
    assert sp.drafts({"a": [1, 2], "c": [1]}) == {"a": (1,), "c": (1,) * 4}  # (c: the prior's length)


def test_the_step_rule_weighs_a_steps_drafts_against_a_plain_step():
    """Plain steps of 16 rows at 1 ms (run ahead), verify steps at 2 ms + 0.03 ms a row: 16
    slots drafting 2 tokens each at alpha 0.6 emit ~31 tokens in 2.96 ms (10.6 a ms) against
    16 a ms plainly, so the step decodes plainly; at alpha 0.95 and 8 tokens each (~106 tokens
    in 6.3 ms) it verifies. Unmeasured, it never vetoes; a veto lets one step through at the
    probe cadence once the plain steps under it took 1/remeasure times the step's excess."""
    from workbench.spec.guard import StepRule

    rule = StepRule(probe_every=4, remeasure=0.25)
    assert rule.pays(16, 48, 1.0, 0.0, step=1)  # (nothing measured yet)
    for _ in range(10):
        rule.observe(16, 1.0, verify=False)
    for rows in (20, 48, 80, 144):
        rule.observe(rows, 2.0 + 0.03 * rows, verify=True)
    e = lambda a, k: (1 - a ** (k + 1)) / (1 - a)  # noqa: E731
    assert rule.verify.at(48) == pytest.approx(3.44)
    assert not rule.pays(16, 48, 16 * e(0.6, 2), 0.0, step=1)
    assert rule.pays(16, 144, 16 * e(0.95, 8), 0.0, step=1)
    assert not rule.pays(16, 144, 16 * e(0.95, 8), 10.0, step=1)  # (a proposer that costs 10 ms a step)
    # a verify of 48 rows costs 3.44 ms, 2.44 beyond a plain step: let through once 0.25 of the
    # plain steps under the veto took that, 10 steps, at the next cadence step
    through = [s for s in range(1, 60) if rule.pays(16, 48, 16 * e(0.6, 2), 0.0, step=s)]
    assert through == [12, 24, 36, 48]
    assert rule.could_pay(16, 144) and not rule.could_pay(16, 20)  # (every row kept: 144 in 6.32 ms; 20 in 2.6)


def test_the_step_rule_prices_the_pipelines_half_steps_apart():
    """Code editing at 16 slots as the H100 measured it (runs 98-106): plain steps of 16 rows
    run ahead at 0.66 ms, whole verify steps of 144 rows at 4.7 ms (their host unhidden), so a
    whole step of ~112 tokens does not pay. The pipeline's half steps (72 rows, the time each
    adds ~2.0 ms) are fitted apart and weighed, per half of ~56 tokens, against plain decoding
    of all 16 slots: they pay. A half pays until one was measured, and a half's step never
    moves the whole verify fit; a half's plain step (its drafts all cut) prices nothing."""
    from workbench.spec.guard import StepRule

    rule = StepRule()
    for _ in range(8):
        rule.observe(16, 0.66, verify=False, ahead=True)
    rule.observe(144, 4.7, verify=True)
    assert not rule.pays(16, 144, 112.0, 0.0, step=1)
    assert rule.pays(8, 72, 56.0, 0.0, step=1, of=16)  # (no half step measured yet)
    for _ in range(4):
        rule.observe(72, 2.0, verify=True, pipelined=True)
        rule.observe(8, 0.5, verify=False, pipelined=True)
    assert rule.half.num_steps == 4 and rule.verify.num_steps == 1 and rule.plain.num_steps == 8
    assert rule.verify.at(144) == pytest.approx(4.7) and rule.half.at(72) == pytest.approx(2.0)
    assert rule.pays(8, 72, 56.0, 0.0, step=1, of=16)  # (28 a ms against 24.2 plainly)
    assert not rule.pays(8, 72, 40.0, 0.0, step=1, of=16)  # (20 a ms)
    # (a half of 24 rows is well below the one size measured: unpriced, so it may pay)
    assert rule.could_pay(8, 72, of=16) and rule.could_pay(8, 24, of=16)
    rule.observe(40, 1.6, verify=True, pipelined=True)
    assert rule.could_pay(8, 72, of=16) and not rule.could_pay(8, 24, of=16)  # (the line: 1.4 ms)
    assert not rule.pays(16, 144, 112.0, 0.0, step=1)  # (the whole step's price is its own)


def test_a_whole_step_the_pipeline_may_split_is_weighed_as_its_halves():
    """The speculator's `split` (the engine's: the pipeline may run the step as two halves):
    where whole verify steps measured dear and the halves cheap, the same drafts are vetoed as
    one step and pass as two halves; without any half measured they pass, so the pipeline is
    tried and measured. (Each slot's draft of 4 at the prior's alpha 2/3 is worth ~2.6 tokens;
    plain decoding emits 4 in 0.66 ms.)"""
    from workbench.spec.speculator import Speculator

    def speculator():
        sp = Speculator(SpecConfig(k=4, row_cost=0.05), _Repeat(3))
        for r in "abcd":
            sp.start(r, [1])
        for _ in range(8):
            sp.step_rule.observe(4, 0.66, verify=False, ahead=True)
        for _ in range(4):  # (4 slots x 5 rows: 20 tokens at best, in 4.7 ms)
            sp.step_rule.observe(20, 4.7, verify=True)
        return sp

    ctx = {r: [1] for r in "abcd"}
    assert speculator().drafts(ctx) == {}
    assert speculator().drafts(ctx, split=True) == {r: (3,) * 4 for r in "abcd"}
    sp = speculator()
    for _ in range(4):
        sp.step_rule.observe(10, 0.5, verify=True, pipelined=True)  # (a half's ~5 tokens in 0.5 ms)
    assert sp.drafts(ctx, split=True) == {r: (3,) * 4 for r in "abcd"}
    sp = speculator()
    for _ in range(4):
        sp.step_rule.observe(10, 4.0, verify=True, pipelined=True)
    assert sp.drafts(ctx, split=True) == {}


def test_a_step_the_pipeline_may_split_runs_whole_where_that_goes_faster():
    """Where the step could run as the pipeline's halves, the speculator weighs it both ways and
    says which to run (`whole`, the engine's word): halves measured dear and whole steps cheap,
    the drafts pass as one whole step (essays at 16 slots on an H100, session 32: the halves
    never paid and whole steps went at 1.21x); halves cheap, as halves. And the rule can say a
    step pays whole where no draft could pay as halves (the question shadow drafts ask of both)."""
    from workbench.spec.speculator import Speculator

    def speculator(whole_ms, half_ms):
        sp = Speculator(SpecConfig(k=4, row_cost=0.05), _Repeat(3))
        for r in "abcd":
            sp.start(r, [1])
        for _ in range(8):
            sp.step_rule.observe(4, 0.66, verify=False, ahead=True)
        for rows in (16, 20):  # (two sizes each: lines, not means)
            sp.step_rule.observe(rows, whole_ms * rows / 20, verify=True)
            sp.step_rule.observe(rows // 2, half_ms * rows / 20, verify=True, pipelined=True)
        return sp

    ctx = {r: [1] for r in "abcd"}
    sp = speculator(whole_ms=1.0, half_ms=2.0)  # (a whole step of ~10.4 tokens in 1 ms: 1.7x plain)
    assert sp.drafts(ctx, split=True) == {r: (3,) * 4 for r in "abcd"} and sp.whole
    sp = speculator(whole_ms=1.6, half_ms=0.5)  # (a half of ~5.2 tokens in 0.5 ms)
    assert sp.drafts(ctx, split=True) == {r: (3,) * 4 for r in "abcd"} and not sp.whole
    assert sp.drafts(ctx) == {r: (3,) * 4 for r in "abcd"} and not sp.whole  # (no split: whole, as always)
    sp = speculator(whole_ms=9.0, half_ms=9.0)
    assert sp.drafts(ctx, split=True) == {}
    rule = speculator(whole_ms=1.0, half_ms=9.0).step_rule
    assert not rule.could_pay(2, 10, of=4) and rule.could_pay(4, 20)  # (shadows: either way may pay)


def test_the_step_rules_verdict_is_kept_only_for_a_step_of_the_same_shape():
    """Between the guard's cadence steps the step rule's verdict is kept, but only for a step of
    the shape it weighed: halves that pay say nothing of the whole step they came from, which
    does not (a verdict kept across that change let the whole step verify at a loss)."""
    from workbench.spec.speculator import Speculator

    sp = Speculator(SpecConfig(k=4, row_cost=0.05), _Repeat(3))
    for r in "abcd":
        sp.start(r, [1])
    for _ in range(8):
        sp.step_rule.observe(4, 0.66, verify=False, ahead=True)
    for rows in (16, 20):
        sp.step_rule.observe(rows, 9.0 * rows / 20, verify=True)
        sp.step_rule.observe(rows // 2, 0.5 * rows / 20, verify=True, pipelined=True)
    ctx = {r: [1] for r in "abcd"}
    assert sp.drafts(ctx, split=True) == {r: (3,) * 4 for r in "abcd"} and not sp.whole
    assert not sp.guard.on_cadence()  # (the next weighing would reuse a kept verdict)
    assert sp.drafts(ctx) == {}  # (whole, unsplittable: 16 rows at 7.2 ms)
    assert sp.stats["a"].vetoed == 1
    assert sp.drafts(ctx, split=True) == {r: (3,) * 4 for r in "abcd"}


def test_a_verify_steps_own_overhead_is_not_read_as_its_rows_cost():
    """One line over plain and verify steps puts a verify step's own overhead (on a GPU: not
    launched ahead, a chunk graph) on its extra rows: one verify of 5 rows at 1.3 ms beside plain
    steps of one row at 0.45 ms reads a row as 0.47 of a share (on an H200, where the line fell
    below zero, as all of it: the slot never drafted again; run 122, agentic at one slot), and
    the guard drafts half of what would be kept. The step rule weighs that
    overhead; a row costs the prior until verify steps of two sizes were measured, then their
    own slope over a plain step's share."""
    from workbench.spec.speculator import Speculator

    sp = Speculator(SpecConfig(k=8, row_cost=0.1), _Repeat(3))
    sp.start("a", [1])
    sp.record_step(5, 1.3, verify=True)
    for _ in range(20):
        sp.record_step(1, 0.45, verify=False, ahead=True)
    assert sp.cost.row_cost(1, 0.1) > 0.45  # (the one line's reading)
    assert sp.row_cost(1) == 0.1
    sp.guard.observe("a", 8, 8)
    assert sp.guard.best("a", sp.cost.row_cost(1, 0.1)) <= 4 and sp.guard.best("a", sp.row_cost(1)) == 8
    for rows in (9, 5, 9):  # a verify step: 1.2 ms + 0.02 a row
        sp.record_step(rows, 1.2 + 0.02 * rows, verify=True)
    assert sp.row_cost(1) == pytest.approx(0.02 / 0.45, rel=0.05)
    # where the one line prices rows lower than the verify steps' own slope, it stands
    cheap = Speculator(SpecConfig(k=8, row_cost=0.1), _Repeat(3))
    for rows in (16, 16, 144, 80, 16, 144, 80, 144, 80):
        cheap.record_step(rows, 0.3 + 0.006 * rows if rows > 16 else 0.6, verify=rows > 16, ahead=rows == 16)
    assert cheap.row_cost(16) == cheap.cost.row_cost(16, 0.1) < cheap.step_rule.row_cost(16, 0.1)


class _Shadowed(_Repeat):
    """_Repeat whose drafts cost host lookups only: the speculator shadows it."""

    shadows = True


def _quiet_script(sp, quiet: bool):
    """A scripted run of a speculator over 260 steps, whose step rule's fits say a verify of
    the slots' drafts does not pay (so it holds them at k = 0, but for shadows and re-measures);
    requests start and finish on the way. Returns what each step drafted, what plain_next said,
    each request's final counters, and the quiet steps taken."""
    if not quiet:
        sp._is_quiet = lambda rids, split: False
    # (proposing measured as free, and the steps' times the script's: no clock in the decisions)
    sp.draft_cost.observe = lambda wall_ms, tokens: None
    toks = {r: [1] for r in "abcde"}
    live = ["a", "b", "c", "d"]
    for r in live:
        sp.start(r, [1])
    for _ in range(8):
        sp.step_rule.observe(4, 0.5, verify=False, ahead=True)
    for _ in range(4):
        sp.step_rule.observe(20, 1.2, verify=True)
    trace, stats, taken = [], {}, 0
    for step in range(260):
        if step == 90:
            stats["b"] = sp.finish("b", toks["b"], 1)
            live.remove("b")
        if step == 150:
            sp.start("e", [1])
            live.append("e")
        before = sp._quiet_steps
        got = sp.drafts({r: toks[r] for r in live})
        taken += sp._quiet_steps > before
        for r in live:  # (the target emits 3 for a and c, 5 for the others: a and c's shadows are kept)
            toks[r].append(3 if r in "ac" else 5)
        for r, d in got.items():
            kept = len(d) if r in "ac" else 0
            sp.observe(r, len(d), kept, kept + 1)
        sp.record_step(len(live) + sum(map(len, got.values())), (1.5 if got else 0.5) + sp._draft_ms, verify=bool(got),
                       ahead=not got)
        trace.append((got, None if got else sp.plain_next(list(live))))
    for r in list(live):
        stats[r] = sp.finish(r, toks[r], 1)
    return trace, stats, taken


def test_quiet_steps_decide_what_the_full_decision_would():
    """A run held at k = 0 takes quiet steps (speculator.py: constant time, the counts added up
    at the run's end): each step's drafts and plain_next answers, and every request's counters
    (skips, vetoes, shadows, verifies), are those of deciding every step in full, across
    requests that finish and start, shadows that come due and the probe cadence."""
    from workbench.spec.speculator import Speculator

    runs = [_quiet_script(Speculator(SpecConfig(k=4, row_cost=0.05), _Shadowed(3)), quiet) for quiet in (True, False)]
    (trace, stats, taken), (trace_full, stats_full, taken_full) = runs
    assert trace == trace_full and stats == stats_full
    assert taken_full == 0 and taken > 150  # (proof that quiet steps ran: most of the 260)
    assert all(s.guard_skips > 0 for s in stats.values()) and stats["a"].vetoed > 0 and stats["a"].shadows > 0
    assert any(got for got, _ in trace)  # (and steps that verified: re-measures)


def test_a_vetoed_step_decodes_plainly_but_for_its_probes():
    """With the step rule's fits saying verify steps do not pay, every slot's draft is vetoed
    (counted), except a slot whose length was a probe; plain_next then says the step is plain."""
    from workbench.spec.speculator import Speculator

    sp = Speculator(SpecConfig(k=4, row_cost=0.05), _Repeat(3))
    for r in "ab":
        sp.start(r, [1])
    for _ in range(5):
        sp.step_rule.observe(2, 1.0, verify=False)
        sp.step_rule.observe(6, 9.0, verify=True)
    ctx = {"a": [1], "b": [1]}
    assert sp.drafts(ctx) == {}
    assert sp.stats["a"].vetoed == sp.stats["a"].guard_skips == 1
    assert sp.plain_next(["a", "b"]) and sp.drafts(ctx) == {}
    # b stops drafting on its own (always rejected) until its probe, which the veto lets through
    for _ in range(60):
        sp.guard.observe("b", 4, 0)
    sp.step_rule.remeasure = 0.0  # (no veto let through: only the probes verify)
    sp.guard.decay = 1.0  # (b's acceptance stays low: only its probe drafts)
    got = [sp.drafts(ctx) for _ in range(40)]
    assert [g for g in got if g] == [{"b": (3,)}]  # (its probe: at the guard's step 32)
    assert sp.stats["b"].vetoed < sp.stats["a"].vetoed


def test_the_step_rule_measures_plain_steps_before_it_compares():
    """A run whose slots draft from the first step: once a verify step is measured, the rule
    vetoes until `explore` plain steps are too, then compares (here verifies pay)."""
    from workbench.spec.guard import StepRule

    rule = StepRule(explore=3)
    rule.observe(48, 3.0, verify=True)
    verdicts = []
    for _ in range(5):
        verdicts.append(rule.pays(16, 48, 90.0, 0.0, step=1))
        if not verdicts[-1]:
            rule.observe(16, 1.0, verify=False)
    assert verdicts == [False, False, False, True, True]


def test_a_fit_of_one_size_does_not_price_a_much_smaller_step():
    """One whole verify measured, 16 slots and 79 rows at 4.4 ms (H100 run 119's warm-up): a tail
    step of 2 slots and 18 rows, its 16 tokens worth 1.3 ms, is not priced at 4.4 ms (it pays,
    so it gets measured); once it is, the line through both sizes prices it, and a step of
    about the measured size was priced all along."""
    from workbench.spec.guard import StepRule

    rule = StepRule(explore=1)
    for _ in range(4):
        rule.observe(16, 0.65, verify=False, ahead=True)
    rule.observe(2, 0.45, verify=False, ahead=True)
    rule.observe(79, 4.4, verify=True)
    assert rule.ratio(2, 18, 16.0, 0.0)[0] == math.inf and rule.pays(2, 18, 16.0, 0.0, step=1)
    assert not rule.pays(16, 60, 20.0, 0.0, step=1)  # (about its size: priced, and too dear)
    rule.observe(18, 1.3, verify=True)
    r, more = rule.ratio(2, 18, 16.0, 0.0)
    assert 1.5 < r < 3 and more > 0  # (16 tokens in ~1.3 ms against two in 0.45)


def test_proposers_index_the_prompt_at_start():
    """The prompt is indexed when a request starts (not inside its first drafting step, whose
    time DraftCost counts): proposals are those of indexing it then."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    for make in (lambda: NgramProposer(3, 2), lambda: SuffixProposer(4, 2)):
        early, late = make(), make()
        early.start("r", prompt)
        late.start("r", [])  # (nothing indexed at start: its first propose indexes the whole context)
        ctx = prompt + [7]
        assert early.propose("r", ctx, 3) == late.propose("r", ctx, 3) != ()


class _Shadowed(_Repeat):
    """_Repeat whose drafts cost host lookups only (the speculator may shadow-draft with it),
    counting its calls."""

    shadows = True

    def __init__(self, token: int):
        super().__init__(token)
        self.calls = 0

    def propose(self, rid, context, k):
        self.calls += 1
        return super().propose(rid, context, k)


def _plain_steps(sp, ctx: list, next_token, steps: int) -> list:
    """`steps` steps of one slot "a" at whatever the speculator decides, each emitting
    next_token(position) (the target's own token: a draft is kept where it equals it)."""
    got = []
    for _ in range(steps):
        d = sp.drafts({"a": ctx})
        got.append(d)
        n = 0
        for t in d.get("a", ()):  # (a verify: the exact rule's burst)
            if t != next_token(len(ctx) + n):
                break
            n += 1
        if "a" in d:
            sp.observe("a", len(d["a"]), n, n + 1)
        ctx += [next_token(len(ctx) + i) for i in range(n + 1)]
    return got


def test_shadow_drafts_measure_acceptance_at_k0_without_verifying():
    """A slot held at k = 0 by its first rejections: its proposer still drafts now and then in
    the shadow of plain steps, and once plain decoding emitted those tokens the speculator
    counts what a verify would have kept. A proposer that is right from then on brings the slot
    back to drafting with no probe (no verify row spent to find it out); one that stays wrong
    keeps it at k = 0, its shadows ever rarer."""
    from workbench.spec.speculator import Speculator

    for right in (True, False):
        prop = _Shadowed(7)
        sp = Speculator(SpecConfig(k=4, row_cost=0.1, measure_cost=False), prop)
        assert sp.shadowing and sp.guard.probes is False
        sp.guard.decay = 1.0  # (only what is observed moves the counts)
        sp.start("a", [1, 2])
        for _ in range(30):
            sp.guard.observe("a", 4, 0)
        ctx = [1, 2]
        got = _plain_steps(sp, ctx, (lambda p: 7) if right else (lambda p: 8), 200)
        st = sp.stats["a"]
        assert st.shadows > 0 and st.shadow_drafted == 4 * st.shadows
        if right:
            first = next(i for i, d in enumerate(got) if d)
            assert all(not d for d in got[:first]) and set(got[first]["a"]) == {7}
            assert got[-1] == {"a": (7,) * 4}  # (the drafts lengthen as they are kept)
            assert st.shadow_accepted == st.shadow_drafted and st.verify_steps > 100
        else:
            assert not any(got) and st.verify_steps == 0 and st.shadow_accepted == 0
            assert st.shadows <= 6  # (waits 16, 32, 64, 128, 256 steps: not one every 16)
        assert st.guard_skips == 200 - st.verify_steps


def test_no_shadow_draft_where_no_draft_could_pay():
    """With the step rule's fits saying even a step of every slot's full draft, all kept, would
    not pay, the proposer is not asked for shadow drafts (its lookups would buy nothing)."""
    from workbench.spec.speculator import Speculator

    prop = _Shadowed(7)
    sp = Speculator(SpecConfig(k=4, row_cost=0.05), prop)
    for _ in range(8):
        sp.step_rule.observe(1, 1.0, verify=False)
        sp.step_rule.observe(5, 9.0, verify=True)
    sp.cost.observe(1, 1.0)
    sp.cost.observe(5, 9.0)  # (a row as dear as 2 ms: the slot's own rule says k = 0 too)
    sp.start("a", [1, 2])
    _plain_steps(sp, [1, 2], lambda p: 7, 100)
    assert prop.calls == 0 and sp.stats["a"].shadows == 0 and sp.stats["a"].verify_steps == 0
    assert not sp.step_rule.could_pay(1, 5)


def test_held_decisions_match_deciding_every_step():
    """Between cadence steps the speculator keeps each slot's decided length and decides again
    only slots something was observed of: over a run of mixed acceptance the lengths are the
    ones deciding every slot at every step gives (a slot's counts move only when it is
    observed)."""
    from workbench.spec.speculator import Speculator

    rng = random.Random(3)
    runs = []
    for held in (True, False):
        rng.seed(3)
        sp = Speculator(SpecConfig(k=4, row_cost=0.2, measure_cost=False), _Repeat(7))
        rids = ["a", "b", "c"]
        for r in rids:
            sp.start(r, [1])
        lengths = []
        for step in range(120):
            if not held:
                sp._held = {}  # (decide every slot again)
            d = sp.drafts({r: [1] for r in rids})
            lengths.append({r: len(d.get(r, ())) for r in rids})
            for r, draft in d.items():
                p = {"a": 0.95, "b": 0.3, "c": 0.7}[r]
                kept = 0
                while kept < len(draft) and rng.random() < p:
                    kept += 1
                sp.observe(r, len(draft), kept, kept + 1)
        runs.append(lengths)
    assert runs[0] == runs[1]


def test_step_cost_fits_a_line_with_no_negative_part():
    """A falling line is fitted as the mean (b = 0 with its own intercept, not the falling
    line's), a line through below zero as one through the origin."""
    falling = StepCost(forget=1.0)
    for _ in range(10):
        falling.observe(5, 0.95)
    falling.observe(4, 1.6)
    a, b = falling.fit()
    assert b == 0.0 and a == pytest.approx((10 * 0.95 + 1.6) / 11)
    steep = StepCost(forget=1.0)
    for rows, ms in ((10, 0.5), (20, 2.0)):
        steep.observe(rows, ms)
    a, b = steep.fit()
    assert a == 0.0 and b == pytest.approx((10 * 0.5 + 20 * 2.0) / (100 + 400))


def test_the_step_rule_prices_plain_steps_by_those_run_ahead():
    """Once a plain step ran ahead, only such steps price plain decoding: the plain step after
    a verify cannot run ahead, and its time is the verify's doing."""
    from workbench.spec.guard import StepRule

    rule = StepRule()
    rule.observe(16, 1.4, verify=False)  # (a runner without run-ahead: every plain step counts)
    assert rule.plain.at(16) == pytest.approx(1.4)
    for _ in range(5):
        rule.observe(16, 0.57, verify=False, ahead=True)
        rule.observe(16, 1.4, verify=False)  # (after a verify: not plain decoding's price)
    assert rule.plain.at(16) == pytest.approx(0.57) and rule.plain.num_steps == 5


def test_one_slow_step_does_not_price_rows_for_hundreds():
    """A step past OUTLIER times its fitted time (a kernel compiled inside it, no graph captured)
    counts as OUTLIER times the fit: after it the fitted time stays within a few times the
    steps' own, instead of hundreds of times for hundreds of steps."""
    from workbench.spec.guard import OUTLIER

    cost = StepCost()
    for _ in range(10):
        cost.observe(16, 0.6)
        cost.observe(48, 2.5)
    cost.observe(48, 1000.0)
    assert cost.at(48) < OUTLIER * 2.5 / 2


def test_spec_overrides_parse_typed_fields_and_refuse_bad_ones():
    """SpecConfig.overridden: a script's --spec-variant word, each field typed and checked as the
    constructor checks it; an unknown name, a bad value or an item without '=' is one line."""
    base = SpecConfig(k=8)
    got = base.overridden("pipeline=0, guard=false,row_cost=0.25,tree=none")
    assert (got.pipeline, got.guard, got.row_cost, got.tree, got.k) == (0, False, 0.25, None, 8)
    assert base.overridden("") == base and base.overridden("k=4").k == 4
    for text, want in (("foo=1", "unknown speculation key(s) 'foo'"), ("k=99", "allowed an integer 1..16"),
                       ("pipeline", "is not name=value"), ("verify=both", "allowed exact, rejection")):
        with pytest.raises(ConfigError, match=re.escape(want)):
            base.overridden(text)


def test_spec_config_reads_proposer_and_k_from_one_word():
    """spec_config: a script's PROPOSER:K (the scripts' --spec), other fields as keywords; a word
    without a K is one line."""
    from workbench.spec import spec_config

    assert spec_config("ngram:8") == SpecConfig(k=8)
    assert spec_config("self:4:2", guard=False) == SpecConfig(proposer="self", draft_layers=4, k=2, guard=False)
    for text in ("ngram", "ngram:x", ":4"):
        with pytest.raises(ConfigError, match=re.escape(f"speculation {text!r} is not PROPOSER:K")):
            spec_config(text)
