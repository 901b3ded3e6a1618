"""Driving an engine through arrivals and cancels, step by step (the soak tests of
test_engine.py, test_paged_engine.py and test_paged_triton.py share it)."""

from __future__ import annotations

from typing import Callable, Sequence


def serve_arrivals(engine, submit: Callable[[int], object], arrive: Sequence[int],
                   cancel_at: Sequence[int | None], max_steps: int,
                   after_cancel: Callable[[], None] | None = None) -> dict:
    """At step ``arrive[i]`` request i is submitted (``submit(i)``: its handle, or None where the
    test saw it refused); at step ``cancel_at[i]`` it is cancelled if it is not done (then
    ``after_cancel()``). Steps until every request has arrived and none is left (at most
    ``max_steps``), then runs to the end. Returns request index -> handle."""
    handles = {}
    for step in range(max_steps):
        for i in range(len(arrive)):
            if arrive[i] == step:
                h = submit(i)
                if h is not None:
                    handles[i] = h
            if cancel_at[i] == step and i in handles and not handles[i].done:
                handles[i].cancel()
                if after_cancel is not None:
                    after_cancel()
        engine.step()
        if step > max(arrive) and not engine.scheduler.has_work():
            break
    engine.run_until_done()
    return handles
