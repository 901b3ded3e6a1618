"""A fake runner for scheduler tests: per-slot "KV" lists and a deterministic "model".

The fake model samples `fake_token(kv)`, a hash of every token in the slot's KV. So a slot's
output equals its solo output only if the scheduler fed it exactly the right tokens at the right
positions, and the engine reset the slot between requests; any leak or misstep changes the
tokens (or trips the position check in `run`).

`FakePagedRunner` keeps the same "KV" in pages instead: each position's token is written into
the page its block table names and read back through the tables, so a page shared, recycled
or freed wrongly by the scheduler's allocator changes the tokens too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

from workbench.planner import SlotView, StepPlan
from workbench.scheduler import Request, RequestEvent, Scheduler, Segment
from workbench.state import KVGroup, StateLayout

VOCAB = 97


def fake_token(kv: Sequence[int], vocab: int = VOCAB) -> int:
    h = 1469598103934665603
    for t in kv:
        h = ((h ^ (t + 1)) * 1099511628211) % (1 << 64)
    return h % vocab


def solo_reference(request: Request, capacity: int) -> tuple[list[int], str]:
    """What the request produces alone, computed without the scheduler."""
    seq = list(request.prompt_ids)
    max_context = min(len(seq) + request.max_tokens, capacity)
    out: list[int] = []
    while True:
        tok = fake_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok in request.stop_ids:
            return out, "eos"
        if len(out) >= request.max_tokens:
            return out, "max_tokens"
        if len(request.prompt_ids) + len(out) >= max_context:
            return out, "max_context"


@dataclass
class FakeRunner:
    """Implements the scheduler's RunnerInfo protocol and runs plans on fake state."""

    slot_capacity: int = 512
    bytes_per_token: int = 1024
    bytes_per_prefill_row: int = 256
    fixed_bytes: int = 4096
    dense_boundary: int | None = None  # slots with at least this much context decode solo
    supports_fused_step: bool = True
    kv: dict[int, list[int]] = field(default_factory=dict)
    steps: list[list[list[tuple[Hashable, int, int, int]]]] = field(default_factory=list)

    def cache_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def batch_verdict(self, view: SlotView) -> tuple[bool, str | None]:
        if self.dense_boundary is not None and view.context_len >= self.dense_boundary:
            return False, f"sparse past dense boundary {self.dense_boundary}"
        return True, None

    def run(self, forwards: list[list[Segment]]) -> dict[int, int]:
        """Run each forward; returns slot id -> token sampled from its last row."""
        sampled: dict[int, int] = {}
        record = []
        for segments in forwards:
            record.append([(s.request_id, s.slot_id, s.start_pos, len(s.token_ids)) for s in segments])
            for seg in segments:
                kv = self.kv.setdefault(seg.slot_id, [])
                assert seg.slot_id not in sampled, f"slot {seg.slot_id} twice in one step"
                assert seg.start_pos == len(kv), (
                    f"slot {seg.slot_id}: segment at {seg.start_pos} but the KV holds {len(kv)}"
                )
                assert len(kv) + len(seg.token_ids) <= self.slot_capacity, "KV overflow"
                kv.extend(seg.token_ids)
                if seg.samples:
                    sampled[seg.slot_id] = fake_token(kv)
        self.steps.append(record)
        return sampled

    def reset(self, slot_id: int) -> None:
        self.kv.pop(slot_id, None)


@dataclass
class FakePagedRunner(FakeRunner):
    """A paged runner: two KV groups (a global one and a sliding one of `window` positions),
    pages of `page_size` positions holding token ids (None where never written)."""

    page_size: int = 16
    window: int = 24
    paged: bool = True
    kv_cache_key: bytes = b"fake-model\x00int"
    pages: dict[tuple[str, int], list] = field(default_factory=dict)
    host: dict[tuple[str, int], list] = field(default_factory=dict)  # host backing's pages
    num_moved: int = 0

    def move_pages(self, moves) -> None:
        """Host backing: whole pages copied to the host store and back (a host page is dropped
        once paged in, so paging in a page twice, or one never paged out, raises KeyError)."""
        for m in moves:
            if m.to_host:
                self.host[(m.group, m.host)] = list(self.pages[(m.group, m.device)])
            else:
                self.pages[(m.group, m.device)] = self.host.pop((m.group, m.host))
            self.num_moved += 1

    @property
    def state_layout(self) -> StateLayout:
        per_position = self.bytes_per_token // 2
        return StateLayout((KVGroup("global", (0,), 0, per_position), KVGroup("sliding", (1,), self.window, per_position)),
                           self.page_size, key_blocks=(self.page_size,))

    def run(self, forwards: list[list[Segment]]) -> dict[int, int]:
        sampled: dict[int, int] = {}
        record = []
        P = self.page_size
        for segments in forwards:
            record.append([(s.request_id, s.slot_id, s.start_pos, len(s.token_ids)) for s in segments])
            for seg in segments:
                assert seg.slot_id not in sampled, f"slot {seg.slot_id} twice in one step"
                for c in seg.copies:
                    src = self.pages.get((c.group, c.src), [None] * P)
                    self.pages[(c.group, c.dst)] = src[: c.num_positions] + [None] * (P - c.num_positions)
                end = seg.start_pos + len(seg.token_ids)
                for group, table in seg.block_tables.items():
                    assert len(table) * P >= end, f"{seg.request_id!r}: group {group} has no page for {end} positions"
                    for i, tok in enumerate(seg.token_ids):
                        pos = seg.start_pos + i
                        page = table[pos // P]
                        assert page >= 0, f"{seg.request_id!r}: position {pos} lies in a dropped page"
                        self.pages.setdefault((group, page), [None] * P)[pos % P] = tok
                # what attention would read: every position in the global group; in the sliding
                # group the window of the last row, which must agree with it
                glob = seg.block_tables["global"]
                kv = [self.pages[("global", glob[p // P])][p % P] for p in range(end)]
                assert None not in kv, f"{seg.request_id!r}: an unwritten position in its KV"
                slide = seg.block_tables["sliding"]
                for p in range(max(0, end - self.window), end):
                    assert self.pages[("sliding", slide[p // P])][p % P] == kv[p], "the groups disagree"
                if seg.samples:
                    sampled[seg.slot_id] = fake_token(kv)
        self.steps.append(record)
        return sampled

    def reset(self, slot_id: int) -> None:
        pass  # no state per slot: the scheduler's allocator took the pages back


def drive(
    scheduler: Scheduler,
    runner: FakeRunner,
    *,
    arrivals: dict[int, Iterable[Request]] | None = None,
    cancels: dict[int, Iterable[Hashable]] | None = None,
    check: Callable[[Scheduler, StepPlan], None] | None = None,
    max_steps: int = 100_000,
) -> "Drive":
    """The engine loop: add arrivals and apply cancels at each step boundary, then schedule ->
    run -> commit, resetting the slots that events name."""
    arrivals = arrivals or {}
    cancels = cancels or {}
    last = max([*arrivals, *cancels], default=0)
    result = Drive()
    events, plans = result.events, result.plans
    step = 0
    while step <= last or scheduler.has_work():
        assert step < max_steps, "the engine did not finish"
        for request in arrivals.get(step, ()):
            scheduler.add(request)
        for rid in cancels.get(step, ()):
            if rid in events:
                continue
            for ev in scheduler.cancel(rid):
                _record(ev, result, runner)
        plan = scheduler.schedule(len(plans))
        if plan is not None:
            if check is not None:
                check(scheduler, plan)
            plans.append(plan)
            moves = scheduler.page_moves(plan)
            if moves:
                runner.move_pages(moves)
            sampled = runner.run(scheduler.forwards(plan))
            for ev in scheduler.commit(plan, sampled):
                _record(ev, result, runner)
            scheduler.retire(len(plans) - 1)
        step += 1
    return result


@dataclass
class Drive:
    events: dict[Hashable, RequestEvent] = field(default_factory=dict)  # the final event of each
    plans: list[StepPlan] = field(default_factory=list)
    event_at: dict[Hashable, int] = field(default_factory=dict)  # runner steps run before it

    def touched_after_event(self, runner: FakeRunner) -> list[Hashable]:
        """Requests that a runner step touched after their final event (there must be none)."""
        return sorted(
            {rid for i, step in enumerate(runner.steps) for fwd in step for rid, *_ in fwd
             if rid in self.event_at and i >= self.event_at[rid]},
            key=repr,
        )


def _record(ev: RequestEvent, result: Drive, runner: FakeRunner) -> None:
    assert ev.request_id not in result.events, f"two final events for {ev.request_id!r}"
    result.events[ev.request_id] = ev
    result.event_at[ev.request_id] = len(runner.steps)
    if ev.slot_id is not None:
        runner.reset(ev.slot_id)
