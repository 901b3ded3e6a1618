"""The GPU scripts' CUDA-graph timing loop (torch only, so a bare device call can import it)."""

from __future__ import annotations

import torch


def graph_replay_us(fn, replays: int, warm: int = 1) -> list[float]:
    """Microseconds of each of ``replays`` timed replays of a CUDA graph of ``fn``, sorted: fn is
    run once, once more on a side stream (as capture wants), captured, and the graph replayed
    ``warm`` times before the timed replays (each between two events, synchronized)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warm):
        g.replay()
    torch.cuda.synchronize()
    return replay_us(g, replays)


def replay_us(g, replays: int) -> list[float]:
    """Microseconds of each of ``replays`` replays of the captured graph ``g`` (anything with
    ``replay()``: a runner's graphs too), each between two events, synchronized; sorted."""
    ts = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)
