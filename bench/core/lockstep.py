"""Comparisons that a noisy host cannot bias: run every side in lockstep.

The H200 host alternates between slow and fast phases that last from a few steps to a few
seconds (``python -m bench profile-step --series``), whatever the serving mode. Measured one
after the other, two configurations land in different phases and their ratio moves by tens of
percent from run to run. Stepped in turn — one engine step of each side per pass, the starting
side rotating — every phase falls on all sides alike, and each side's rate is still its own: it
counts only the time spent in its own steps (``clock.OwnClock``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol


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


def alternate(timers: Mapping[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each timer once per repeat, the first one rotating (the same reason as ``lockstep``):
    the samples of each, by name."""
    times: dict[str, list[float]] = {v: [] for v in timers}
    order = list(timers)
    for r in range(repeats):
        for v in order[r % len(order) :] + order[: r % len(order)]:
            times[v].append(timers[v]())
    return times
