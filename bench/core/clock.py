"""Clocks of the benchmarks: wall time for a run alone, a run's own time in lockstep, and
device time of a launch measured with CUDA events."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WallClock:
    """Time as the engine sees it: for a run alone."""

    def now(self) -> float:
        return time.monotonic()

    def timed(self, step: Callable[[], T]) -> T:
        return step()

    def stamp(self, engine_time: float, own_time: float) -> float:
        """The time of an event the engine stamped (arrival, admission)."""
        return engine_time


class OwnClock:
    """A run's own time in lockstep: it advances only while the run's engine steps, so the
    other runs' steps in between count against none of its latencies. An event the engine
    stamps (an arrival, an admission) takes the run's time when it was seen: an admission,
    the start of the step that made it."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def timed(self, step: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        out = step()
        self.t += time.perf_counter() - t0
        return out

    def stamp(self, engine_time: float, own_time: float) -> float:
        return own_time


def cuda_ms(
    fn: Callable[[], object], iters: int, setup: Callable[[], None] | None = None
) -> list[float]:
    """Milliseconds of device time per call of ``fn`` (CUDA events around it), ``iters``
    calls after one warm-up; ``setup`` runs before each call, outside the timed span."""
    import torch

    out = []
    for i in range(iters + 1):
        if setup:
            setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i:
            out.append(a.elapsed_time(b))
    return out
