"""Engine: N concurrent slots over one model, each producing exactly what it would alone.

`step()` reads as plan -> run -> commit:

    plan = scheduler.schedule(step_id)          # plain Python: who decodes, which chunks,
                                                # which pages (paged runners)
    for forward in scheduler.forwards(plan):    # the runner owns the tensors
        logits |= runner.run(forward)
    sample each slot's row with its own generator
    events = scheduler.commit(plan, sampled)    # bookkeeping; reset finished slots
    scheduler.retire(step_id)                   # the device is done with the step's pages

The streaming form is cooperative: iterating a handle's tokens drives `step()` until that
request has something new, so every other admitted request advances at the same time.

With `EngineConfig(prompt_compression=...)` a prompt is compressed once at submit, before the
scheduler sees it (workbench/compression.py): the scheduler admits and prefills the kept
tokens, the result keeps the raw prompt (`prompt_ids`, what usage bills) beside the admitted
one (`effective_prompt_ids`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Hashable, Iterator, Sequence

import psutil
import torch

from .compression import CompressedPrompt, PromptCompressor
from .engine_config import EngineConfig
from .errors import WorkbenchError
from .model import Model
from .runner import TorchRunner
from .sampling import SamplingParams, probabilities, sample, token_generator
from .scheduler import Request, Scheduler, branch_slot
from .spec.proposers import Proposer
from .spec.speculator import SpecStats, Speculator
from .spec.verify import accept_exact, accept_rejection, num_accepted
from .telemetry import Telemetry, percentile

__all__ = ["Engine", "EngineConfig", "GenerationResult", "RequestHandle"]


@dataclass
class GenerationResult:
    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "max_tokens" | "max_context" | "cancelled"
    submitted_at: float
    first_token_at: float | None
    finished_at: float
    token_times: list[float] = field(repr=False, default_factory=list)
    prefill_started_at: float | None = None
    logits: "torch.Tensor | None" = field(repr=False, default=None)  # [generated, vocab] when kept
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's cached_tokens)
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # tokens re-prefilled after preemptions
    num_swaps: int = 0  # times paged out to the host store (host backing)
    max_wait_steps: int = 0  # the most steps in a row it waited, admitted, after its first step
    # the prompt the scheduler admitted: prompt_ids after compression (None: prompt_ids itself)
    effective_prompt_ids: list[int] | None = field(repr=False, default=None)
    compression: CompressedPrompt | None = field(repr=False, default=None)  # None: compression off
    spec: SpecStats | None = field(repr=False, default=None)  # speculation's counters; None: off

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def raw_prompt_tokens(self) -> int:
        """The prompt as submitted: what usage bills (seed 002 billed raw)."""
        return len(self.prompt_ids)

    @property
    def effective_prompt_tokens(self) -> int:
        """The prompt as admitted and prefilled (after compression)."""
        return len(self.prompt_ids if self.effective_prompt_ids is None else self.effective_prompt_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_s(self) -> float | None:
        return None if self.prefill_started_at is None else self.prefill_started_at - self.submitted_at

    @property
    def prefill_tok_s(self) -> float:
        if self.first_token_at is None or self.prefill_started_at is None:
            return 0.0
        dt = self.first_token_at - self.prefill_started_at
        return self.effective_prompt_tokens / dt if dt > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_times) - 1
        if n < 1:
            return 0.0
        dt = self.token_times[-1] - self.token_times[0]
        return n / dt if dt > 0 else 0.0

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class _Live:
    """An admitted or waiting request's engine-side state: sampling, stream, timing."""

    def __init__(self, rid, prompt_ids, params: SamplingParams, index: int, submitted_at: float,
                 compression: CompressedPrompt | None = None):
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.compression = compression
        self.effective_ids = list(compression.kept_ids) if compression is not None else self.prompt_ids
        self.params = params
        self.index = index  # a seeded token at position t draws from token_generator(seed, index, t)
        self.submitted_at = submitted_at
        self.prefill_started_at: float | None = None
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.logits: list = []
        self.result: GenerationResult | None = None


class _Contexts(Mapping):
    """Request id -> its prompt and output so far, for the given decoding requests, each list
    built only when read: the speculator reads those its guard lets draft (a step that drafts
    nothing copies no context)."""

    def __init__(self, live: dict, rids: Sequence[Hashable]):
        self._live, self._rids = live, rids

    def __getitem__(self, rid):
        if rid not in self._rids:
            raise KeyError(rid)
        live = self._live[rid]
        return live.effective_ids + live.token_ids

    def __iter__(self):
        return iter(self._rids)

    def __len__(self):
        return len(self._rids)


@dataclass
class _Flight:
    """A pipelined half's step in flight: its plan, step id, half, slot -> request id, the
    runner's launches (one per forward), when its planning began, CUDA graphs it captured."""

    plan: object
    step_id: int
    half: int
    running: dict
    launched: list
    t0: float
    captures: int
    first: bool = False  # the first of a run of halves (its time holds the other half's planning)


class RequestHandle:
    """A submitted request: iterate its tokens or text as they come, cancel it, or wait."""

    def __init__(self, engine: "Engine", rid: Hashable):
        self.engine = engine
        self.request_id = rid

    def tokens(self) -> Iterator[int]:
        seen = 0
        while True:
            live = self.engine._live[self.request_id]
            while seen < len(live.token_ids):
                seen += 1
                yield live.token_ids[seen - 1]
            if live.result is not None:
                return
            self.engine.step()

    def text_stream(self) -> Iterator[str]:
        dec = self.engine.model.tokenizer.stream(skip_special=True)
        for tok in self.tokens():
            piece = dec.push(tok)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)

    @property
    def done(self) -> bool:
        return self.engine._live[self.request_id].result is not None

    def result(self) -> GenerationResult:
        while not self.done:
            self.engine.step()
        return self.engine._live[self.request_id].result


class Engine:
    def __init__(self, model: Model, config: EngineConfig | None = None, *, keep_logits: bool = False,
                 proposer: Proposer | None = None):
        """keep_logits: keep every sampled row's float32 logits on the result (for exactness
        checks and analysis; costs vocab*4 bytes per token). proposer: with speculation on, a
        draft proposer (workbench.spec.Proposer) instead of the config's named one."""
        self.model = model
        self.keep_logits = keep_logits
        self.config = config = config or EngineConfig()
        if config.dtype is not None and config.dtype != model.dtype_name:
            # The precision is a property of the loaded weights; say so rather than silently differ.
            raise WorkbenchError(
                f"EngineConfig.dtype={config.dtype!r} but the model was loaded as {model.dtype_name!r}: "
                f"load_model(..., dtype={config.dtype!r}) or set EngineConfig(dtype={model.dtype_name!r})"
            )
        if config.backend == "triton":
            from .runners.triton_runner import TritonRunner

            self.runner = TritonRunner(model, config.max_context or model.config.context_length, config.triton,
                                       qsa=config.qsa)
        else:
            self.runner = TorchRunner(model, config.max_context or model.config.context_length, qsa=config.qsa)
        budget = config.memory_budget_bytes or self._machine_budget()
        self.scheduler = Scheduler(config, self.runner, budget_bytes=budget)
        if self.scheduler.paged:
            self.runner.init_kv_pool(self.scheduler.kv_pool_pages)
            if config.eviction == "scored":
                self.runner.track_page_mass()
            if self.scheduler.kv_host_pages:
                self.runner.init_host_store(self.scheduler.kv_host_pages)
        # prompt compression (PFlash): the scorer is loaded once, on the CPU or, by default with
        # the Triton backend, on the GPU (CompressionOptions.device, workbench/compression.py)
        self.compressor = (None if config.prompt_compression == "off"
                           else PromptCompressor(model, config.prompt_compression, config.compression, config.backend))
        if proposer is not None and config.speculation is None:
            raise WorkbenchError("a proposer was given but speculation is off: allowed with "
                                 "EngineConfig(speculation=SpecConfig(...)) only")
        self.speculator = None if config.speculation is None else Speculator(
            config.speculation, proposer, model=model, runner=self.runner)
        if hasattr(self.runner, "expect_steps"):  # (CUDA graphs: captured per segment bucket at once)
            self.runner.expect_steps(config.max_concurrency, verify=self.speculator is not None)
        self.telemetry = Telemetry()
        self._live: dict[Hashable, _Live] = {}
        self._ids = itertools.count()
        self._step_index = 0
        self._proc = psutil.Process(os.getpid())
        self._t_origin = time.perf_counter()  # (steps' start_s are seconds since)
        self._last_done = self._t_origin  # when the latest step finished (a pipelined step's start_s)
        # the pipeline (SpecConfig.pipeline): the two halves of the slots while it runs (None
        # otherwise), their steps in flight (oldest first), and whether it is winding down
        self._halves: list[set[int]] | None = None
        self._flights: deque[_Flight] = deque()
        self._leaving = False
        self.stop_ids = tuple(sorted(model.tokenizer.eos_ids))

    def _machine_budget(self) -> int:
        # Weights are already resident; the budget is what they take plus most of what is free
        # where the KV lives (the runner's device memory, else the host's).
        device = getattr(self.runner, "memory_available", lambda: None)()
        free = device if device is not None else psutil.virtual_memory().available
        return int(self.runner.fixed_bytes + 0.8 * free)

    # -- requests ------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
        index: int = 0,
        request_id: Hashable | None = None,
        ignore_eos: bool = False,
    ) -> RequestHandle:
        if isinstance(prompt, str) and not prompt.strip():
            raise WorkbenchError("the prompt is empty: give some text to continue")
        if not isinstance(prompt, str) and len(prompt) == 0:
            raise WorkbenchError("the prompt has no token ids: give at least one")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = self.model.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise WorkbenchError(f"prompt token ids must lie in 0..{vocab - 1}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._live:
            raise WorkbenchError(f"request {rid!r} already exists")
        submitted_at = time.perf_counter()  # (a compressed request's TTFT includes its scoring)
        # prepared once, before the scheduler sees it: the scheduler admits the effective prompt
        compressed = self.compressor.compress(ids) if self.compressor is not None else None
        admitted = compressed.kept_ids if compressed is not None else tuple(ids)
        req = Request(rid, admitted, max_tokens, params, () if ignore_eos else self.stop_ids)
        self.scheduler.add(req)
        self._live[rid] = _Live(rid, ids, params, index, submitted_at, compressed)
        if self.speculator is not None:
            self.speculator.start(rid, admitted)
        return RequestHandle(self, rid)

    def cancel(self, request_id: Hashable) -> None:
        while self._flights:  # (the pipeline's steps in flight land first: a plan is never dropped mid-flight)
            self._finish_flight()
        for ev in self.scheduler.cancel(request_id):
            self._finish(ev)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[GenerationResult]:
        """Run the prompts concurrently; one result per prompt, in order. Request i samples
        from a generator seeded by (seed, i)."""
        handles = [
            self.submit(p, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, index=i, ignore_eos=ignore_eos)
            for i, p in enumerate(prompts)
        ]
        self.run_until_done()
        return [h.result() for h in handles]

    def run_until_done(self) -> None:
        while self.scheduler.has_work():
            self.step()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list:
        """One step: plan, run, commit (module docstring); the finished and cancelled requests'
        events. While the pipeline runs (`SpecConfig.pipeline`) a call either launches one
        half's step or finishes the older one in flight."""
        if self._flights:
            return self._pipeline_step()
        t0 = time.perf_counter()
        captures = getattr(self.runner, "num_captures", 0)
        ahead_used = getattr(self.runner, "num_ahead_used", 0)
        drafts = self._drafts()
        if drafts and not self.speculator.whole and self._enter_pipeline(drafts):
            return []
        branches = self.speculator.branches if self.speculator is not None else None
        plan = self.scheduler.schedule(self._step_index, drafts, branches)  # plan
        if plan is None and self.scheduler.has_work() and getattr(self.runner, "ahead_in_flight", False):
            # nothing could be admitted, perhaps for pages still fenced by a step launched ahead
            # for requests that have since finished: wait for it, release them, plan again
            self.runner.drain()
            self.scheduler.retire(self._step_index - 1)
            plan = self.scheduler.schedule(self._step_index, drafts, branches)
        if plan is None:
            return []
        moves = self.scheduler.page_moves(plan)
        if moves:  # host backing: page-outs, then page-ins, before anything reads the pages
            self.runner.move_pages(moves)
        forwards = self.scheduler.forwards(plan)
        max_ctx = self.scheduler.max_contexts()
        for slot, paths in plan.branches.items():  # token trees: each path runs under an id of its own
            for b in range(1, len(paths) + 1):
                max_ctx[branch_slot(slot, b)] = max_ctx[slot]
        running = self.scheduler.running_ids()
        argmax = self._argmax(running, plan)
        # a greedy steady state: the runner may start the next step before returning this one's
        # (with speculation: when the guard lets no slot draft in that next step, decided now)
        ahead = (bool(argmax) and self.scheduler.repeats_after(plan) and set(plan.slot_ids()) <= argmax
                 and (self.speculator is None
                      or self.speculator.plain_next(list(running.values()), split=self._pipeline_possible())))
        outs = []
        for fwd in forwards:  # run
            for seg in fwd:
                live = self._live[seg.request_id]
                if live.prefill_started_at is None:
                    live.prefill_started_at = t0
            outs.append(self.runner.run(fwd, max_ctx, argmax=argmax, ahead=ahead))
        events, num_kept, num_out = self._settle(plan, running, outs)  # sample, verify, commit
        # the device is done with this step, unless the runner launched the next one ahead: that
        # launch may still write pages released by this commit, so they stay fenced a step more
        ahead_in_flight = getattr(self.runner, "ahead_in_flight", False)
        if self._step_index - ahead_in_flight >= 0:
            self.scheduler.retire(self._step_index - ahead_in_flight)
        for ev in events:
            self._finish(ev)
        # the step's wall time ends after its bookkeeping (with run-ahead the device keeps
        # working meanwhile); bench's decode time takes each step to the next one's start_s
        self._record_step(plan, self._step_index, len(forwards), t0, time.perf_counter(), num_kept, num_out,
                          getattr(self.runner, "num_captures", 0) - captures,
                          getattr(self.runner, "num_ahead_used", 0) > ahead_used)
        self._step_index += 1
        self._last_done = time.perf_counter()
        return events

    def _argmax(self, running: Mapping[int, Hashable], plan) -> frozenset[int]:
        """Greedy rows whose logits nobody keeps: the runner may answer them with the token
        itself (argmax where the logits are, e.g. on the GPU: no logits transfer)."""
        if self.keep_logits:
            return frozenset()
        argmax = frozenset(slot for slot, rid in running.items() if self._live[rid].params.greedy)
        for slot, paths in plan.branches.items():  # token trees: each path's rows too
            if slot in argmax:
                argmax = argmax | {branch_slot(slot, b) for b in range(1, len(paths) + 1)}
        return argmax

    def _settle(self, plan, running: Mapping[int, Hashable], outs: Sequence[Mapping]) -> tuple[list, int, int]:
        """A step's answers (`outs`: one per forward, the runner's) sampled, its drafts
        verified, its tokens appended and committed: (the scheduler's events, draft tokens
        kept, tokens emitted)."""
        logits = {}
        sampled = {}
        verified = {}  # slot -> its verify rows' logits [1 + k, vocab], or their greedy tokens
        on_paths = {}  # token trees: branch_slot id -> its path's rows, as verified's
        for out in outs:
            for slot, row in out.items():
                if slot < 0:
                    on_paths[slot] = row
                elif slot in plan.drafts:
                    verified[slot] = row
                elif isinstance(row, int):
                    sampled[slot] = row
                else:
                    logits[slot] = row
        # greedy rows: one argmax over the stacked rows and one host transfer (rows may live on
        # a GPU); argmax is per row, so this equals sampling each row alone
        greedy = [slot for slot in logits if self._live[running[slot]].params.greedy]
        if greedy:
            picks = torch.stack([logits[slot] for slot in greedy]).argmax(-1).tolist()
            sampled.update(zip(greedy, picks))
        for slot, row in logits.items():
            live = self._live[running[slot]]
            if slot not in sampled:
                t = len(live.token_ids)
                sampled[slot] = sample(row.float().cpu(), live.params, token_generator(live.params.seed, live.index, t))
            if self.keep_logits:
                live.logits.append(row.detach().to("cpu", torch.float32, copy=True))
        num_kept = 0
        bursts = {}
        chosen = {}  # token trees: slot -> the path its burst followed
        for slot, out in verified.items():  # speculation: each verify's burst
            live = self._live[running[slot]]
            draft = plan.drafts[slot]
            burst, rows = self._verify(live, draft, out)
            kept = main_kept = num_accepted(draft, burst)
            alts = plan.branches.get(slot, ())
            for b, path in enumerate(alts, 1):  # the path that keeps the most wins (the first of equals)
                got, got_rows = self._verify(live, path, on_paths[branch_slot(slot, b)])
                got_kept = num_accepted(path, got)
                if got_kept > kept:
                    draft, burst, rows, kept, chosen[slot] = path, got, got_rows, got_kept, b
            burst = burst[: self.scheduler.num_taken(slot, burst)]  # (a stop token mid-burst ends it)
            self.speculator.observe(live.rid, len(draft), kept, len(burst), alternatives=len(alts),
                                    alternative_tokens=sum(map(len, alts)), won=slot in chosen,
                                    main_kept=main_kept)
            num_kept += kept
            bursts[slot] = burst
            if self.keep_logits:
                live.logits += list(rows[: len(burst)].clone())
        now = time.perf_counter()
        for slot, tok in sampled.items():
            live = self._live[running[slot]]
            live.token_ids.append(tok)
            live.token_times.append(now)
        for slot, burst in bursts.items():
            live = self._live[running[slot]]
            live.token_ids += burst
            live.token_times += [now] * len(burst)
        sampled.update(bursts)
        events = self.scheduler.commit(plan, sampled, chosen)  # commit
        num_out = sum(len(t) if isinstance(t, list) else 1 for t in sampled.values())
        return events, num_kept, num_out

    # -- the pipeline ----------------------------------------------------------------------
    # With SpecConfig(pipeline=N), from N decoding slots on, a step that drafts splits the slots
    # into two halves whose steps alternate: the runner launches one half's forward and the host
    # goes on to accept, commit, record and draft the other half's step and launch it behind
    # (TritonRunner.launch: the device runs them in launch order), so a verify step's host work
    # (~2 ms at 16 slots, H100 runs 102-106) hides under the other half's forward instead of
    # adding to its own. Each row's bits are its own whatever shares its forward, so every
    # token and logit is what one step of all slots gives. It runs only in a steady state:
    # every request resident and decoding, none admissible; a finished request with others
    # waiting, a half whose guard drafts nothing, or a half whose rows do not fit its pages
    # winds it down (what is in flight lands, then whole steps), and a cancel lands it first.

    def _pipeline_possible(self) -> bool:
        """Whether the slots are as the pipeline runs them (the speculator then weighs a whole
        step's drafts as its two halves: spec/guard.py)."""
        spec = self.config.speculation
        n = 0 if spec is None else spec.pipeline_slots(getattr(self.runner, "asynchronous", False))
        return n > 0 and self.scheduler.num_running >= n and self.scheduler.steady()

    def _pipeline_ready(self) -> bool:
        return self._pipeline_possible() and not getattr(self.runner, "ahead_in_flight", False)

    def _enter_pipeline(self, drafts: Mapping[Hashable, tuple[int, ...]]) -> bool:
        """A step whose slots draft, as the pipeline's first two half steps (each half with its
        own of `drafts`, both drafting now); False, nothing launched, where it cannot start."""
        if not self._pipeline_ready():
            return False
        running = self.scheduler.running_ids()
        slots = list(running)
        halves = [slots[: (len(slots) + 1) // 2], slots[(len(slots) + 1) // 2 :]]
        parts = [{running[s]: drafts[running[s]] for s in half if running[s] in drafts} for half in halves]
        if not all(parts):  # (a half without drafts would be a plain step of half the rows)
            return False
        self._halves = [set(h) for h in halves]
        if not self._launch_half(0, parts[0]):
            self._halves = None
            return False
        self._flights[-1].first = True
        if not self._launch_half(1, parts[1]):
            self._leaving = True
        return True

    def _pipeline_step(self) -> list:
        """Launch the half not in flight while the state stays steady, else land the older
        step in flight (its events)."""
        if not self._leaving and len(self._flights) == 1:
            h = 1 - self._flights[0].half
            if self._halves[h] and self._pipeline_ready() and self._plan_half(h):
                return []
            self._leaving = True
        return self._finish_flight()

    def _plan_half(self, h: int) -> bool:
        """Draft and launch half h's step; False where its guard drafts nothing or its rows do
        not fit (the pipeline then winds down)."""
        running = self.scheduler.running_ids()
        rids = [running[s] for s in sorted(self._halves[h])]
        n = len(running)
        if self.speculator.plain_next(rids, of=n):  # (its lengths stay pinned for the whole step next)
            return False
        drafts = self.speculator.drafts(_Contexts(self._live, rids), of=n, tick=h == 1)
        return bool(drafts) and self._launch_half(h, drafts)

    def _launch_half(self, h: int, drafts: Mapping[Hashable, tuple[int, ...]]) -> bool:
        t0 = time.perf_counter()
        captures = getattr(self.runner, "num_captures", 0)
        plan = self.scheduler.schedule(self._step_index, drafts, slots=self._halves[h])
        if plan is None:
            return False
        forwards = self.scheduler.forwards(plan)
        max_ctx = self.scheduler.max_contexts()
        running = {slot: rid for slot, rid in self.scheduler.running_ids().items() if slot in self._halves[h]}
        argmax = self._argmax(running, plan)
        launched = [self.runner.launch(fwd, max_ctx, argmax=argmax) for fwd in forwards]
        self._flights.append(_Flight(plan, self._step_index, h, running, launched, t0,
                                     getattr(self.runner, "num_captures", 0) - captures))
        self._step_index += 1
        return True

    def _finish_flight(self) -> list:
        """Land the oldest step in flight: wait for its answers, settle it, retire it, record it
        (its wall time runs from the previous step's end or its own planning, the later: in a
        steady pipeline, the time it added)."""
        fl = self._flights.popleft()
        events, num_kept, num_out = self._settle(fl.plan, fl.running, [l.result() for l in fl.launched])
        self.scheduler.retire(fl.step_id)  # (launches complete in order: every earlier step is done too)
        for ev in events:
            self._finish(ev)
            for half in self._halves:
                half.discard(ev.slot_id)
        t1 = time.perf_counter()
        self._record_step(fl.plan, fl.step_id, len(fl.launched), max(fl.t0, self._last_done), t1, num_kept,
                          num_out, fl.captures, pipelined=True, steady=not fl.first)
        self._last_done = time.perf_counter()
        if not self._flights:
            self._halves, self._leaving = None, False
        return events

    def _drafts(self) -> dict:
        """Speculation: each decoding request's draft for the next step (the scheduler cuts each
        to what its request may still emit, and to the pages there are); {} when off."""
        if self.speculator is None:
            return {}
        # (a request re-prefilling after a preemption gets it ignored)
        rids = [rid for rid in self.scheduler.running_ids().values() if self._live[rid].token_ids]
        if not rids:
            return {}
        return self.speculator.drafts(_Contexts(self._live, rids), split=self._pipeline_possible())

    def _verify(self, live: _Live, draft: tuple[int, ...], out) -> tuple[list[int], torch.Tensor | None]:
        """The tokens a verify emits (spec/verify.py's rule) and its rows' logits (None when the
        runner answered with greedy tokens)."""
        if isinstance(out, tuple):  # greedy tokens picked where the logits are
            return accept_exact(draft, out.__getitem__), None
        rows = out.float().cpu()
        p, t = live.params, len(live.token_ids)
        if p.greedy:
            picks = rows.argmax(-1).tolist()
            return accept_exact(draft, picks.__getitem__), rows
        if self.config.speculation.verify == "exact":
            # row i is position t + i: its sample is the one speculation-off would draw there
            return accept_exact(draft, lambda i: sample(rows[i], p, token_generator(p.seed, live.index, t + i))), rows
        return accept_rejection(draft, lambda i: probabilities(rows[i], p), token_generator(p.seed, live.index, t)), rows

    def _finish(self, ev) -> None:
        if ev.slot_id is not None:
            self.runner.reset(ev.slot_id)
        live = self._live[ev.request_id]
        now = time.perf_counter()
        spec = None
        if self.speculator is not None:
            spec = self.speculator.finish(ev.request_id, live.effective_ids + live.token_ids, len(live.effective_ids))
        live.result = GenerationResult(
            request_id=ev.request_id,
            prompt_ids=live.prompt_ids,
            token_ids=list(live.token_ids),
            text=self.model.tokenizer.decode(live.token_ids, skip_special=True),
            finish_reason=ev.reason,
            submitted_at=live.submitted_at,
            first_token_at=live.token_times[0] if live.token_times else None,
            finished_at=now,
            token_times=list(live.token_times),
            prefill_started_at=live.prefill_started_at,
            logits=torch.stack(live.logits) if live.logits else None,
            cached_tokens=ev.cached_tokens,
            num_preemptions=ev.num_preemptions,
            recomputed_tokens=ev.recomputed_tokens,
            num_swaps=ev.num_swaps,
            max_wait_steps=ev.max_wait_steps,
            effective_prompt_ids=live.effective_ids,
            compression=live.compression,
            spec=spec,
        )
        r = live.result
        cp = r.compression
        itl = r.inter_token_s
        self.telemetry.record_request({
            "request_id": str(r.request_id),
            "finish_reason": r.finish_reason,
            "prompt_tokens": r.num_prompt_tokens,
            "generated_tokens": r.num_generated_tokens,
            "queue_s": r.queue_s,
            "ttft_s": r.ttft_s,
            "prefill_tok_s": r.prefill_tok_s,
            "decode_tok_s": r.decode_tok_s,
            "itl_p50_ms": None if not itl else 1e3 * percentile(itl, 50),
            "itl_p90_ms": None if not itl else 1e3 * percentile(itl, 90),
            "itl_p99_ms": None if not itl else 1e3 * percentile(itl, 99),
            "itl_max_ms": None if not itl else 1e3 * max(itl),
            "total_s": r.finished_at - r.submitted_at,
            "cached_tokens": r.cached_tokens,
            "num_preemptions": r.num_preemptions,
            "recomputed_tokens": r.recomputed_tokens,
            "num_swaps": r.num_swaps,
            "max_wait_steps": r.max_wait_steps,
            # prompt compression: what was asked, whether it compressed (a request that asked
            # and shows compressed=False was left whole: below the threshold, or too short)
            "raw_prompt_tokens": r.raw_prompt_tokens,
            "effective_prompt_tokens": r.effective_prompt_tokens,
            "prompt_compression": "off" if cp is None else cp.asked,
            "compressed": cp is not None and cp.compressed,
            "compress_s": None if cp is None or cp.scores is None else cp.scores.scorer_s,
            "compress_device": None if cp is None or cp.scores is None else cp.scores.device,
            # speculation (None when off): verify steps, draft tokens verified and kept, the
            # tokens those steps emitted, the guard's skips, the acceptance-length histogram
            "spec_verify_steps": None if spec is None else spec.verify_steps,
            "spec_drafted": None if spec is None else spec.drafted,
            "spec_accepted": None if spec is None else spec.accepted,
            "spec_emitted": None if spec is None else spec.emitted,
            "spec_guard_skips": None if spec is None else spec.guard_skips,
            "spec_empty": None if spec is None else spec.empty,
            "spec_vetoed": None if spec is None else spec.vetoed,
            # shadow drafts (n-gram, suffix): drafts checked against plain decoding's tokens at
            # k = 0, and the tokens of them a verify would have kept
            "spec_shadows": None if spec is None else spec.shadows,
            "spec_shadow_drafted": None if spec is None else spec.shadow_drafted,
            "spec_shadow_accepted": None if spec is None else spec.shadow_accepted,
            "draft_yield": None if spec is None else spec.draft_yield,
            "spec_hist": None if spec is None else list(spec.hist),
            "spec_position_accepted": None if spec is None else list(spec.position_accepted),
            "spec_position_drafted": None if spec is None else list(spec.position_drafted),
            # token trees: alternative paths verified beside the main draft, their draft tokens,
            # and the verifies an alternative won (0 with chains)
            "spec_tree_paths": None if spec is None else spec.tree_paths,
            "spec_tree_tokens": None if spec is None else spec.tree_tokens,
            "spec_tree_wins": None if spec is None else spec.tree_wins,
        })

    def _record_step(self, plan, step_id: int, num_forwards: int, t0: float, t1: float, num_kept: int = 0,
                     num_out: int = 0, captures: int = 0, ran_ahead: bool = False, pipelined: bool = False,
                     steady: bool = True) -> None:
        """One step's telemetry row, and its time to the speculator's cost fits unless it says
        nothing of its rows' steady cost: it captured a CUDA graph, or it is the first half of
        a pipeline run (`steady` False: its time also holds the planning of the other half,
        which later halves do under a forward; the fits price a half in a run of them)."""
        solo = [g for g in plan.decode_groups if not g.batched]
        phase = "mixed" if plan.num_decode_rows and plan.num_prefill_rows else "decode" if plan.num_decode_rows else "prefill"
        self.telemetry.record_step({
            "step": step_id,
            "phase": phase,
            "num_slots": len(plan.slot_ids()),
            "rows": plan.num_decode_rows + plan.num_prefill_rows,
            "decode_rows": plan.num_decode_rows,
            "prefill_rows": plan.num_prefill_rows,
            "num_forwards": num_forwards,
            "num_batched_groups": sum(1 for g in plan.decode_groups if g.batched),
            "num_solo": plan.num_solo_fallback,
            "solo_reasons": ";".join(sorted({g.reason for g in solo})),
            "decode_mode": ",".join(f"{'batched' if g.batched else 'solo'}:{g.reason}" for g in plan.decode_groups),
            "chunk_size": plan.chunk_size,
            "chunk_reason": plan.chunk_reason,
            "policy": plan.policy,
            "fused": plan.fused,
            "wall_ms": 1e3 * (t1 - t0),
            "start_s": t0 - self._t_origin,
            "graph_captures": captures,  # CUDA graphs captured inside the step (their time is in wall_ms)
            "ran_ahead": ran_ahead,  # its forward was launched during the previous step (run-ahead)
            "pipelined": pipelined,  # a half's step in the pipeline (SpecConfig.pipeline; engine.py)
            "kv_bytes": self.scheduler.kv_bytes_in_use if self.scheduler.paged else self.runner.kv_bytes,
            "rss_bytes": self._proc.memory_info().rss,
            # host backing: resident requests the plan left out (paged-out ones wait too), and the
            # seconds the runner's page moves took that finished since the previous step
            "deferred_seqs": self.scheduler.num_running - len(plan.slot_ids()),
            "transfer_ms": 1e3 * self.runner.read_transfer_s() if self.scheduler.kv_host_pages else None,
            **self.scheduler.step_stats(),
            # speculation (None when off): slots that verified a draft, draft tokens verified
            # and kept, and the guard's measured cost of a verify row (spec/guard.py)
            "tokens_out": num_out,  # tokens the step's requests took (a verify: its burst)
            "verify_slots": None if self.speculator is None else len(plan.drafts),
            "draft_tokens": None if self.speculator is None else plan.num_draft_tokens,
            "accepted_tokens": None if self.speculator is None else num_kept,
            "tree_paths": None if self.speculator is None else sum(map(len, plan.branches.values())),
            "tree_rows": None if self.speculator is None else plan.num_branch_rows,
            "row_cost": None if self.speculator is None else self.speculator.decided_row_cost,
            # QSA (None when off): row-layers that attended sparsely past the boundary and densely
            # below it, and the blocks those sparse rows scored and kept (summed over KV heads)
            **_qsa_columns(self.runner.read_qsa_stats() if self.config.qsa is not None else None),
        })
        if self.speculator is not None and plan.num_decode_rows and not plan.num_prefill_rows:
            if captures or not steady:  # (the guard's cost model learns what rows cost, not what a capture did)
                self.speculator.skip_step()
            else:
                self.speculator.record_step(plan.num_decode_rows, 1e3 * (t1 - t0), verify=bool(plan.drafts),
                                            ahead=ran_ahead, pipelined=pipelined)

    # -- results ---------------------------------------------------------------------------
    @property
    def peak_memory_bytes(self) -> int:
        return self.telemetry.peak_rss_bytes


def _qsa_columns(stats: dict[str, int] | None) -> dict[str, int | None]:
    from .sparse_attention import STAT_KEYS

    return {f"qsa_{k}": None if stats is None else stats[k] for k in STAT_KEYS}
