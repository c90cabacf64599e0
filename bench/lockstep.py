"""Comparisons that a noisy host cannot bias: run every side in lockstep.

The H200 host alternates between slow and fast phases that last from a few steps to a few
seconds (``bench/profile_step.py --series``), whatever the serving mode. Measured one after the
other, two configurations land in different phases and their ratio moves by tens of percent
from run to run. Stepped in turn — one engine step of each side per pass, the starting side
rotating — every phase falls on all sides alike, and each side's rate is still its own: it
counts only the time spent in its own steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")


class Stepped(Protocol):
    @property
    def active(self) -> bool: ...

    def step(self) -> None: ...


def lockstep(runs: Sequence[Stepped]) -> None:
    """Steps each active run once per pass, rotating which goes first, until none is active."""
    active = [r for r in runs if r.active]
    turn = 0
    while active:
        k = turn % len(active)
        for run in active[k:] + active[:k]:
            run.step()
        active = [r for r in active if r.active]
        turn += 1


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
