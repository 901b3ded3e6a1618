"""Steps as CUDA graphs: a decode step per (row bucket, attention-segment bucket), with the greedy
tokens fed back on the device and the next step launched ahead; and a short prefill chunk or
mixed step (prefill rows beside decode rows) per (row bucket, sampled-row bucket, segment bucket),
where an eager forward is bound by its ~150 launches rather than by the device.

* Rows are padded to a bucket (1, 2, 4, ..., 64); a padded row reads token 0 at position 0
  through the scratch block-table row, whose every entry is its group's scratch page (no
  sequence owns it). The graph's inputs are device buffers the runner fills before a replay:
  (token, position, table row) per row, and per KV group a block table [64 + 1, W] (W: pages of
  a full slot), row i the i-th segment's pages. A step copies only the table rows that changed
  since the last fill (a row crosses into a new page every 256 positions), so in steady decode
  the tables cost no copy at all.
* The graph ends with the argmax of every row (its first stage kept by the head's programs where
  the head form allows, `LayerLoop.head_best_partials`), which also writes each row's token and
  position + 1 as the next step's inputs and keeps the token in a per-row record by position
  (`decode_loop` reads the record once per `graph_history` steps).
* Run-ahead: in a greedy steady state the next step's graph is launched before this one's
  tokens are returned, where every row's next position lies in a page it already holds (the
  launch reads the tables as they are); the next call uses that launch only if its segments are
  exactly the ones launched and need no page copy, otherwise the stream order makes it
  overwrite whatever the early launch wrote. (A live logical page never changes its page id
  without a copy, so equal (slot, position, token) rows read the same pages; entries that did
  change are a sliding window's dropped pages, which no later row reads.) Pages released while
  a launch ahead is in flight stay fenced until it is done (`TritonRunner.ahead_in_flight`).
* Chunk graphs (`chunk`): any forward of at most ``chunk_rows`` rows in at most 64 segments
  that is not a decode step. Rows pad to a bucket of CHUNK_BUCKETS (steps of 1.5x / 2x: a
  padded row costs little where launches bound the forward), padded rows as in decode; the
  sampled rows' indices are a graph input (a fourth input row), padded to a power of two with
  row 0, and the graph ends with their argmax. The same kernels as the eager forward on the same
  rows, with every shape fixed by the weights and not by the row count, so each row's logits
  are bitwise the eager ones (tests/test_chunk_graphs.py). On an H200, a 64-row chunk took
  11-18 ms eager against 1.07 ms on the device (session 14, run 73): the prefix-hit TTFT.
* Verify families (``verify_family``): a speculative verify scores every row, and its row count
  moves with each slot's draft length, so an adaptive guard keeps meeting new (row bucket,
  sampled bucket) keys. The first all-scored forward at a segment bucket captures every key a
  verify of at least as many segments can take at that bucket (rows from its segment count up to
  the scored-row cap: about ten graphs), so captures happen once, up front, not inside the
  steps a benchmark times (H200 run 84: essays at 16 slots captured 1-6 graphs in every timed
  pass, about 40 ms each, and ran at 0.85-0.92x plain decoding with a draft yield of 4.4-6.9).
* Captured together (``expect``): an engine says its steps up front (decode rows up to its
  concurrency; verifies with speculation on), and the first graph a segment bucket needs
  brings every such graph of that bucket with it. A graph is otherwise captured where a step
  first needs it, and a benchmark's timed pass met row counts its warm-up had not (H100 run 90:
  8-9 captures of ~40 ms in a timed pass of essays at 16 slots, whose guard probed other
  slots at other steps than the warm-up's), and the guard's cost model learnt from them.
* "emulate": the same paths replayed eagerly, so that the CPU tests cover buckets, padding, the
  scratch table row, the sampled-row input and the device-fed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from ..kernels.sampling import argmax, argmax_from_partials
from ..scheduler import Segment
from .triton_kv import forward_rows
from .triton_options import CHUNK_BUCKETS

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows per captured graph (and most segments of a chunk graph)
# the most scored rows a chunk graph returns (its logits buffer's rows, 128 MiB at Gemma 3's vocabulary):
# a speculative verify scores every row, 16 slots of a 4-token draft are 80 (H200 run 78: past 64 they ran
# eagerly, 12 ms a step against 1.2 ms for the 16 plain rows)
SCORED_ROWS = 128


class _Eager:
    """Stands in for a CUDA graph: replay() runs the captured body eagerly."""

    def __init__(self, body):
        self._body = body
        self.launches = 0

    def replay(self) -> None:
        self.launches = self._body()


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph, or _Eager
    bucket: int
    nseg: int
    launches: int = 0  # kernel launches of one replay (counted at capture; _Eager: at each replay)

    def replay(self) -> None:
        self.graph.replay()
        if isinstance(self.graph, _Eager):
            self.launches = self.graph.launches


def pow2_at_least(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


class StepGraphs:
    """The graphs of one runner over its layer loop and KV pages (`triton_kv.DevicePages`, the
    pools the graphs were captured on: a new pool makes new graphs); ``width``: entries of a
    block table row (pages of a full slot); ``chunk_rows``: the most rows a chunk graph takes
    (0: none, `TritonOptions.chunk_graph_rows`)."""

    def __init__(self, loop, kv, device: torch.device, *, emulate: bool, share_pool: bool, segment: int,
                 history: int, width: int, chunk_rows: int = 0, verify_family: bool = False):
        self.loop, self.kv, self.device = loop, kv, device
        self.width = width
        self.positions = width * kv.page_size  # the most positions a row's table can address
        self.emulate = emulate
        self.share_pool = share_pool  # (cuBLAS, the comparison variant, tripped the allocator with a shared pool)
        self.segment = segment
        self.history = history
        self.chunk_rows = chunk_rows
        self.verify_family = verify_family
        self._family_floor: dict[int, int] = {}  # per segment bucket: the fewest rows its verify family covers
        # the steps an engine will run (`expect`): at the first graph a segment bucket needs, the
        # decode graphs of every row bucket up to `family_rows` and, with `expect_verify`, the
        # verify family from one segment up are captured at once (module docstring)
        self.family_rows = 0
        self.expect_verify = False
        self._met: set[int] = set()  # segment buckets whose graphs were captured at once
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._chunk_graphs: dict[tuple[int, int, int], _Graph] = {}  # (row bucket, sampled bucket, segments)
        self._pool = None
        # int32 [4, max(B, chunk_rows)]: token, position, table row per graph row; sampled rows (chunks)
        self.inputs: torch.Tensor | None = None
        self.tables: list[torch.Tensor] = []  # per KV group int32 [B + 1, width]; row B: the scratch row
        self._mirror: list[list[tuple | None]] = []  # per group, per row: the table on the device
        self.tokens: torch.Tensor | None = None  # int64 [B]: each row's greedy token
        self.logits: torch.Tensor | None = None  # float32 [B, vocab]
        self.record: torch.Tensor | None = None  # int64 [B, history]: each row's token by position % history
        self._tok_host: torch.Tensor | None = None
        self.ahead: tuple | None = None  # the (slot, position, token) rows of a step launched early
        self.ahead_launched = 0  # steps launched early, and of those used by the next call
        self.ahead_used = 0
        self.launches = 0  # kernel launches of the last replay
        self.captured = 0  # graphs captured so far (a capture inside a step is time no steady state pays)

    @staticmethod
    def takes(forward: Sequence[Segment]) -> bool:
        """Whether this forward is a decode step a graph runs (one sampled token per row, at most
        the largest bucket of rows)."""
        return len(forward) <= BUCKETS[-1] and all(len(s.token_ids) == 1 and s.samples for s in forward)

    def takes_chunk(self, forward: Sequence[Segment]) -> bool:
        """Whether a chunk graph runs this forward (not a decode step: ``takes`` first)."""
        return (len(forward) <= BUCKETS[-1] and 0 < self.chunk_rows
                and sum(len(s.token_ids) for s in forward) <= self.chunk_rows
                # (the logits buffer's rows: more scored rows, a wider verify, run eagerly)
                and sum(s.num_scored for s in forward) <= SCORED_ROWS)

    @property
    def keys(self) -> list[tuple[int, int]]:
        """The decode graphs captured: (row bucket, attention segments)."""
        return sorted(self._graphs)

    @property
    def chunk_keys(self) -> list[tuple[int, int, int]]:
        """The chunk graphs captured: (row bucket, sampled-row bucket, attention segments)."""
        return sorted(self._chunk_graphs)

    # -- one step -------------------------------------------------------------------------------
    def step(self, forward: Sequence[Segment], max_context: dict[int, int], argmax_slots: frozenset[int],
             ahead: bool, launched: tuple | None) -> list[int] | None:
        """Replay (or find already launched) the graph of this decode step. Returns the greedy
        tokens where the next step was launched ahead (every row greedy, ``ahead`` set, room
        left), else None (the step's tokens and logits are in ``tokens`` / ``logits``)."""
        n = len(forward)
        max_pos = max(s.start_pos for s in forward)
        key = tuple((s.slot_id, s.start_pos, s.token_ids[0]) for s in forward)
        if launched is not None and launched == key and not any(s.copies for s in forward):
            self.ahead_used += 1
        else:
            g = self.graph_for(n, max_pos)
            self.fill(forward, g.bucket)
            g.replay()
            self.launches = g.launches
        P = self.kv.page_size
        if ahead and all(s.slot_id in argmax_slots and s.start_pos + 2 <= max_context[s.slot_id]
                         and (s.start_pos + 1) % P for s in forward) and max_pos + 1 < self.positions:
            toks = self._tokens_then_next(n, max_pos + 1)
            self.ahead = tuple((sl, p + 1, t) for (sl, p, _), t in zip(key, toks))
            self.ahead_launched += 1
            return toks
        return None

    def _tokens_then_next(self, n: int, next_max_pos: int) -> list[int]:
        """This step's n greedy tokens, copied to the host before the next step's graph (whose
        inputs the graph has written) is launched; returns them once the copy is done."""
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if self._tok_host is None:
            self._tok_host = torch.empty(BUCKETS[-1], dtype=torch.int64, pin_memory=done is not None)
        self._tok_host[:n].copy_(self.tokens[:n], non_blocking=True)
        if done is not None:
            done.record()
        self.graph_for(n, next_max_pos).replay()  # (a first capture synchronizes; the inputs are kept)
        if done is not None:
            done.synchronize()
        return self._tok_host[:n].tolist()

    def chunk(self, forward: Sequence[Segment]) -> int:
        """Replay the chunk graph of this forward (``takes_chunk``); returns how many rows it
        sampled: their logits and greedy tokens are ``logits[:n]`` / ``tokens[:n]``, in order."""
        rows = sum(len(s.token_ids) for s in forward)
        sampled = sum(s.num_scored for s in forward)
        max_pos = max(s.start_pos + len(s.token_ids) - 1 for s in forward)
        if self.verify_family and sampled == rows:
            self.capture_verify_family(len(forward), max_pos)
        g = self.chunk_graph_for(rows, sampled, max_pos)
        self.fill_chunk(forward, g.bucket)
        g.replay()
        self.launches = g.launches
        return sampled

    # -- the benchmark fast path ------------------------------------------------------------------
    def decode_loop(self, segs: Sequence[Segment], steps: int) -> torch.Tensor:
        """Greedy decode ``steps`` tokens for ``segs`` (one token each, already prefilled) by
        chained replays, the tokens fed back on the device. int64 [steps, len(segs)]."""
        n = len(segs)
        g = self.graph_for(n, max(s.start_pos for s in segs) + steps - 1)
        self.fill(segs, g.bucket)
        # the graph's argmax keeps each row's token at record[row, pos % H]: replays back to back,
        # no copy between them, in chunks of at most H steps
        out = torch.empty((steps, n), dtype=torch.int64, device=self.device)
        H = self.record.shape[1]
        start = torch.tensor([s.start_pos for s in segs], dtype=torch.int64, device=self.device)
        for t0 in range(0, steps, H):
            k = min(H, steps - t0)
            for _ in range(k):
                g.replay()
            at = (start[:, None] + t0 + torch.arange(k, device=self.device)[None, :]) % H
            out[t0 : t0 + k] = torch.gather(self.record[:n], 1, at).T
        self.launches = g.launches
        return out

    # -- capture --------------------------------------------------------------------------------
    def _nseg(self, max_pos: int) -> int:
        seg = self.segment
        return min(pow2_at_least(-(-(max_pos + 1) // seg), 1), self.positions // seg)

    def expect(self, max_rows: int, verify: bool) -> None:
        """The engine's steps: decode steps of up to `max_rows` rows, and speculative verifies
        when `verify`. Each segment bucket's graphs for them are then captured together, the
        first time a step there needs one: the passes of a run meet the same buckets, so a pass
        after the first captures nothing, whatever mix of rows its guard chooses."""
        self.family_rows = max_rows
        self.expect_verify = verify

    def _meet(self, nseg: int) -> None:
        if nseg in self._met or not (self.family_rows or self.expect_verify):
            return
        self._met.add(nseg)
        max_pos = nseg * self.segment - 1
        for b in BUCKETS:
            if b > self.family_rows:
                break
            self.graph_for(b, max_pos)
        if self.expect_verify and self.verify_family:
            self.capture_verify_family(1, max_pos)

    def graph_for(self, rows: int, max_pos: int) -> _Graph:
        bucket = next(b for b in BUCKETS if b >= rows)
        nseg = self._nseg(max_pos)
        g = self._graphs.get((bucket, nseg))
        if g is None:
            self._meet(nseg)
            g = self._graphs.get((bucket, nseg))
        if g is None:
            body = lambda: self._body(bucket, nseg * self.segment - 1)
            g = self._graphs[(bucket, nseg)] = self._capture(body, lambda: self._pad(bucket), bucket, nseg)
        return g

    def chunk_graph_for(self, rows: int, sampled: int, max_pos: int) -> _Graph:
        bucket = next(b for b in CHUNK_BUCKETS if b >= rows)
        sel = pow2_at_least(sampled, 1)  # (the head runs on one row where none is sampled, as eagerly)
        nseg = self._nseg(max_pos)
        key = (bucket, sel, nseg)
        g = self._chunk_graphs.get(key)
        if g is None:
            self._meet(nseg)
            g = self._chunk_graphs.get(key)
        if g is None:
            body = lambda: self._chunk_body(bucket, sel, nseg * self.segment - 1)
            g = self._chunk_graphs[key] = self._capture(body, lambda: self._pad(max(bucket, sel)), bucket, nseg)
        return g

    def capture_verify_family(self, segments: int, max_pos: int) -> int:
        """Capture the chunk graphs an all-scored forward of at least ``segments`` segments may
        take at ``max_pos``'s segment bucket: one per distinct (row bucket, sampled bucket) of
        ``segments`` + 1 .. the scored-row cap rows (module docstring; one row a segment is a
        decode step, a decode graph's). Returns how many it captured."""
        nseg = self._nseg(max_pos)
        floor = self._family_floor.get(nseg)
        low, top = segments + 1, min(SCORED_ROWS, self.chunk_rows)
        if floor is not None and floor <= low or low > top:
            return 0
        before = len(self._chunk_graphs)
        for rows in range(low, top + 1 if floor is None else floor):
            self.chunk_graph_for(rows, rows, max_pos)
        self._family_floor[nseg] = low
        return len(self._chunk_graphs) - before

    def _capture(self, body, pad, bucket: int, nseg: int) -> _Graph:
        """A graph of ``body`` (its launch count its return), captured on padded inputs (every row
        the scratch table row: the warm-up and the capture write only scratch pages); the inputs
        as they were before, after."""
        self._buffers()
        self.captured += 1
        if self.emulate:
            return _Graph(_Eager(body), bucket, nseg)
        torch.cuda.synchronize()
        saved = self.inputs.clone()
        pad()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            body()
        torch.cuda.current_stream().wait_stream(side)
        pad()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool if self.share_pool else None):
            launches = body()
        torch.cuda.synchronize()
        self.inputs.copy_(saved)
        return _Graph(graph, bucket, nseg, launches)

    def _body(self, bucket: int, max_pos: int) -> int:
        """One decode step of ``bucket`` rows into the graph's buffers; its launch count."""
        loop = self.loop
        loop.launches = 0
        ids, pos, seq = self.inputs[0, :bucket], self.inputs[1, :bucket], self.inputs[2, :bucket]
        best = loop.head_best_partials(bucket)
        loop.forward(ids, pos, seq, bucket, max_pos, self.kv, self.tables, logits_out=self.logits[:bucket],
                     decode_graph=True, head_best=best)
        # greedy fast path: the next step's inputs (token, position + 1) written on the device by
        # the argmax's last launch (the engine overwrites them where it feeds other inputs)
        record = self.record[:bucket]
        if best is not None:  # (the head's programs kept the first stage)
            argmax_from_partials(*best, out=self.tokens[:bucket], feed=(ids, pos), hist=record)
        else:
            argmax(self.logits[:bucket], out=self.tokens[:bucket], feed=(ids, pos), hist=record)
        return loop.launches + (1 if best is not None else 2)

    def _chunk_body(self, bucket: int, sel: int, max_pos: int) -> int:
        """One chunk forward of ``bucket`` rows, ``sel`` of them sampled (input row 3), and their
        argmax; its launch count."""
        loop = self.loop
        loop.launches = 0
        ids, pos, seq = self.inputs[0, :bucket], self.inputs[1, :bucket], self.inputs[2, :bucket]
        loop.forward(ids, pos, seq, bucket, max_pos, self.kv, self.tables, sel=self.inputs[3, :sel],
                     logits_out=self.logits[:sel])
        argmax(self.logits[:sel], out=self.tokens[:sel])
        return loop.launches + 3  # (the sampled rows' gather, the argmax's two launches)

    def _buffers(self) -> None:
        if self.inputs is None:
            B = BUCKETS[-1]
            self.inputs = torch.zeros((4, max(B, self.chunk_rows, SCORED_ROWS)), dtype=torch.int32, device=self.device)
            self.tokens = torch.zeros(SCORED_ROWS, dtype=torch.int64, device=self.device)
            self.record = torch.zeros((B, self.history), dtype=torch.int64, device=self.device)
            self.logits = torch.zeros((SCORED_ROWS, self.loop.vocab), dtype=torch.float32, device=self.device)
            self._pool = None if self.emulate else torch.cuda.graph_pool_handle()
            self.tables = [torch.full((B + 1, self.width), self.kv.scratch(g), dtype=torch.int32, device=self.device)
                           for g in self.kv.groups]
            self._mirror = [[None] * B for _ in self.kv.groups]

    def _pad(self, width: int) -> None:
        self.inputs[:, :width] = 0
        self.inputs[2, :width] = BUCKETS[-1]  # (the scratch table row)

    def fill(self, forward: Sequence[Segment], bucket: int) -> None:
        """The graph's inputs for these decode rows (padded rows: the scratch table row), and the
        block-table rows that differ from what the device holds."""
        self._buffers()
        host = torch.zeros((3, bucket), dtype=torch.int32)
        host[2, :] = BUCKETS[-1]
        for i, s in enumerate(forward):
            host[0, i], host[1, i], host[2, i] = s.token_ids[0], s.start_pos, i
        self.inputs[:3, :bucket].copy_(host)
        self._fill_tables(forward)

    def fill_chunk(self, forward: Sequence[Segment], bucket: int) -> None:
        """A chunk graph's inputs: the rows (padded: the scratch table row), the sampled rows
        (each sampled segment's last row; padded: row 0) and the changed block-table rows."""
        self._buffers()
        ids, pos, row, sel = forward_rows(forward)
        # (as wide as the graph reads: its row bucket, and its sampled rows' bucket, up to
        # SCORED_ROWS, which may exceed it: row 3 past the sampled rows must be padding, not
        # a wider call's indices; H200 run 79 read those and index_select failed)
        pin = self._pinned
        host = torch.zeros((4, max(bucket, BUCKETS[-1], SCORED_ROWS)), dtype=torch.int32, pin_memory=pin)
        host[2, :] = BUCKETS[-1]
        host[:3, : len(ids)] = torch.tensor([ids, pos, row], dtype=torch.int32)
        host[3, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
        self.inputs[:, : host.shape[1]].copy_(host, non_blocking=pin)
        self._fill_tables(forward)

    @property
    def _pinned(self) -> bool:
        """Whether inputs go up from pinned memory without the host waiting: on a GPU, so a
        forward is enqueued behind one still running (the engine's pipeline) rather than after
        it ends (a pageable copy synchronizes the stream); the stream order keeps the running
        forward's inputs until it is done with them."""
        return self.device.type == "cuda"

    def _fill_tables(self, forward: Sequence[Segment]) -> None:
        """Segment i's block tables into table row i, per group: the rows that differ from what
        the device holds (one copy per group, of rows 0 up to the last that changed)."""
        for gi, g in enumerate(self.kv.groups):
            mirror = self._mirror[gi]
            rows = [s.block_tables[g] for s in forward]
            last = max((i for i, t in enumerate(rows) if mirror[i] != t), default=-1)
            if last < 0:
                continue
            if max(len(t) for t in rows[: last + 1]) > self.width:
                raise RuntimeError(f"a block table of more than {self.width} pages (the slot capacity)")
            stage = torch.full((last + 1, self.width), -1, dtype=torch.int32, pin_memory=self._pinned)
            for i, t in enumerate(rows[: last + 1]):
                stage[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
                mirror[i] = t
            self.tables[gi][: last + 1].copy_(stage, non_blocking=self._pinned)
