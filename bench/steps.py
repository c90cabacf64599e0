"""Decode rates that hold up on a noisy host: the median over decode steps.

Measured on the H200 host (``bench/profile_step.py --series``): the same configuration's steps
alternate between phases of ~13-16 ms and ~20-24 ms, independent of the serving mode, so a rate
taken as total tokens / total time over a short run moves by tens of percent from run to run.
The median of the per-step rates (tokens a decode step emitted / its time) ignores those phases
while they last fewer than half of the steps; benchmarks report it next to the aggregate."""

from __future__ import annotations

import statistics


class StepRates:
    """Watches an engine's decode counters across ``step()`` calls."""

    def __init__(self, engine) -> None:
        self.stats = engine.stats
        self.rates: list[float] = []  # tokens/s of each decode step
        self._last = (self.stats.decode_s, self.stats.decode_tokens)

    def record(self) -> None:
        """Call after each ``engine.step()``."""
        s, t = self.stats.decode_s, self.stats.decode_tokens
        ds, dt = s - self._last[0], t - self._last[1]
        self._last = (s, t)
        if dt > 0 and ds > 0:
            self.rates.append(dt / ds)

    @property
    def median(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0
