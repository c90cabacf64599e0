"""Verification width by load (DESIGN §5): which block width K to speculate with, 0 = off.

Two policies, plain Python so tests drive them without a GPU:

- ``WidthSchedule``: the paper's fixed schedule (8 up to C32, 6 at C64, 4 from C128) as a
  table of (concurrency, width) points. Between points concurrency doubles, so the width is
  interpolated linearly in log2(C) and rounded to the nearest integer, ties to the narrower
  width (C45 -> 7, C91 -> 5); below the first point and above the last it is flat.
- ``OnlinePolicy``: chooses the width from measurements. Speculating at width K pays while
  eq. 13 holds, ``N_K/N_0 > TPOT_K/TPOT_0`` at the current load (``speculation_pays``), i.e.
  while the tokens per second it serves, ``min(load, N_K)/TPOT_K``, beat those without it.
  Among the widths that pay it picks the one that serves most; with none, 0. ``N_K`` are the
  sessions the capacity model admits at width K (its draft ring and staging grow with K), and
  TPOT_K is an exponential average of measured TPOT per width and load bucket (powers of 2).
  Hysteresis: a different width takes over only after it has been the best by more than
  ``margin`` (relative) for ``patience`` consecutive decisions, so noise does not flap it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from dhisparse.capacity import speculation_pays

PAPER_SCHEDULE: tuple[tuple[int, int], ...] = ((32, 8), (64, 6), (128, 4))


@dataclass(frozen=True)
class WidthSchedule:
    points: tuple[tuple[int, int], ...] = PAPER_SCHEDULE  # (concurrency, width), C increasing

    def __post_init__(self) -> None:
        cs = [c for c, _ in self.points]
        if not cs or cs != sorted(set(cs)) or cs[0] < 1:
            raise ValueError("schedule points need increasing concurrencies >= 1")
        if any(w < 0 for _, w in self.points):
            raise ValueError("widths must be >= 0")

    def width(self, concurrency: int) -> int:
        pts = self.points
        if concurrency <= pts[0][0]:
            return pts[0][1]
        if concurrency >= pts[-1][0]:
            return pts[-1][1]
        for (c0, w0), (c1, w1) in itertools.pairwise(pts):
            if concurrency <= c1:
                f = (math.log2(concurrency) - math.log2(c0)) / (math.log2(c1) - math.log2(c0))
                w = w0 + (w1 - w0) * f
                lo, hi = math.floor(w), math.ceil(w)
                # nearest integer; a tie goes to the narrower width
                return lo if w - lo <= hi - w else hi
        raise AssertionError("unreachable")


def load_bucket(load: int) -> int:
    """Loads are compared within powers of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(0, math.ceil(math.log2(max(load, 1))))


@dataclass
class OnlinePolicy:
    widths: tuple[int, ...] = (0, 4, 6, 8)  # candidates; 0 = speculation off
    margin: float = 0.05
    patience: int = 3
    alpha: float = 0.3  # weight of a new TPOT measurement in its average
    fallback: WidthSchedule = field(default_factory=WidthSchedule)
    current: int | None = None
    _tpot: dict[tuple[int, int], float] = field(default_factory=dict)
    _challenger: int | None = None
    _streak: int = 0

    def __post_init__(self) -> None:
        if 0 not in self.widths:
            raise ValueError("the candidates must include 0 (speculation off)")

    def observe(self, width: int, load: int, tpot_s: float) -> None:
        """A TPOT measured while running ``width`` at ``load`` concurrent sessions."""
        key = (load_bucket(load), width)
        old = self._tpot.get(key)
        self._tpot[key] = tpot_s if old is None else old + self.alpha * (tpot_s - old)

    def measured(self, width: int, load: int) -> bool:
        """Whether ``width`` has a measurement in the load's own bucket."""
        return (load_bucket(load), width) in self._tpot

    def neighbour(self, load: int) -> int | None:
        """The nearest other load bucket where speculation off (width 0) was measured, in
        log2 distance (the lower on a tie); None if there is none."""
        b = load_bucket(load)
        seen = {bb for (bb, w) in self._tpot if w == 0 and bb != b}
        if not seen:
            return None
        return min(seen, key=lambda bb: (abs(math.log2(bb) - math.log2(b)), bb))

    def tpot(self, width: int, load: int) -> float | None:
        """Average TPOT of ``width`` in the load's bucket, else in the nearest bucket
        measured (in log2 distance, the lower bucket on a tie); None if never measured."""
        b = load_bucket(load)
        seen = [bb for (bb, w) in self._tpot if w == width]
        if not seen:
            return None
        near = min(seen, key=lambda bb: (abs(math.log2(bb) - math.log2(b)), bb))
        return self._tpot[(near, width)]

    def scores(self, load: int, sessions: Mapping[int, int]) -> dict[int, float]:
        """Tokens per second each measured width serves at ``load`` (``min(load, N_K) /
        TPOT_K``), for width 0 and the widths where speculation pays (eq. 13)."""
        base = self.tpot(0, load)
        if base is None:
            return {}
        out = {0: min(load, sessions[0]) / base}
        for w in self.widths:
            t = self.tpot(w, load)
            if w == 0 or t is None:
                continue
            if speculation_pays(sessions[w], sessions[0], t / base, load=load):
                out[w] = min(load, sessions[w]) / t
        return out

    def decide(self, load: int, sessions: Mapping[int, int]) -> int:
        """The width to run at ``load`` concurrent sessions; ``sessions[K]``: sessions the
        capacity model admits at width K (``sessions[0]``: without speculation).

        Until width 0 has been measured, the fixed schedule decides (restricted to the
        candidate widths, the nearest one)."""
        scores = self.scores(load, sessions)
        if not scores:
            want = self.fallback.width(load)
            best = min(self.widths, key=lambda w: (abs(w - want), w))
        else:
            best = max(scores, key=lambda w: (scores[w], -w))  # a tie: the narrower
        if self.current is None or best == self.current:
            self.current, self._challenger, self._streak = best, None, 0
            return best
        cur = scores.get(self.current, 0.0)
        if scores and scores[best] <= cur * (1.0 + self.margin):
            self._challenger, self._streak = None, 0
            return self.current
        self._streak = self._streak + 1 if best == self._challenger else 1
        self._challenger = best
        if self._streak >= self.patience:
            self.current, self._challenger, self._streak = best, None, 0
        return self.current


WIDTH_POLICIES = ("fixed", "paper", "online")


class WidthController:
    """Which block width K to verify this round: fixed, the paper's schedule by concurrency,
    or the online policy (eq. 13 on measured TPOT).

    The online policy first measures each candidate width for ``explore_steps`` rounds at
    each load bucket, the widths taking turns round by round: the host alternates between
    slow and fast phases a few to a dozen steps long (``python -m bench profile-step --series``), and
    widths measured one after the other would each see a different phase; taking turns, a
    phase weighs on all of them alike. Each width's first round of a burst is not recorded: it
    pays one-off costs (kernel compilation, cold caches) that would otherwise bias the average
    against that width for a long time. At a load bucket next to one already measured, a
    width that served less than ``1 - prune`` of the best there is not explored (every round
    spent measuring a bad width is lost throughput, and load buckets change as requests come
    and go); width 0, the baseline of eq. 13, always is. Every ``refresh_every`` decisions it
    re-measures the width whose measurement at this load is the oldest (one never measured
    here first), in turns with the current width, so an estimate that went stale or a width
    pruned wrongly is corrected rather than trusted forever."""

    def __init__(
        self,
        policy: str,
        k_max: int,
        max_sessions: int,
        explore_steps: int = 4,
        refresh_every: int = 48,
        prune: float = 0.2,
    ) -> None:
        if policy not in WIDTH_POLICIES:
            raise ValueError(f"unknown width policy {policy!r}; choose from {WIDTH_POLICIES}")
        self.policy = policy
        self.k_max = k_max
        self.schedule = WidthSchedule()
        widths = tuple(sorted({0, *(w for w in (4, 6, 8) if w <= k_max), k_max}))
        self.online = OnlinePolicy(widths=widths)
        self.sessions = dict.fromkeys(widths, max_sessions)  # drafter memory is reserved at start
        self.explore_steps = explore_steps
        self.refresh_every = refresh_every
        self.prune = prune
        self._explore: list[int] = []  # the burst's widths still to run, last first
        self._skip: set[int] = set()  # widths whose coming observation is not recorded
        self._decisions = 0
        self._measured_at: dict[tuple[int, int], int] = {}  # (bucket, width) -> decision no.

    def width(self, load: int) -> int:
        if self.policy == "fixed":
            return self.k_max
        if self.policy == "paper":
            return min(self.k_max, self.schedule.width(load))
        if not self._explore:
            ws = self._to_measure(load)
            if ws:
                self._explore = list(reversed(ws * (self.explore_steps + 1)))
                self._skip = set(ws)
        if self._explore:
            return self._explore.pop()
        self._decisions += 1
        return self.online.decide(load, self.sessions)

    def _to_measure(self, load: int) -> list[int]:
        """Widths to measure now, in turns: those not yet measured in this load's bucket, else
        (every ``refresh_every`` decisions) the one measured longest ago other than the
        current, with the current."""
        unmeasured = [w for w in self.online.widths if not self.online.measured(w, load)]
        near = self.online.neighbour(load)
        if unmeasured and near is not None:  # skip widths clearly worse next door
            prior = self.online.scores(near, self.sessions)
            floor = (1.0 - self.prune) * max(prior.values())
            unmeasured = [w for w in unmeasured if w == 0 or prior.get(w, 0.0) >= floor]
        if unmeasured:
            return unmeasured
        if self.refresh_every <= 0 or self._decisions == 0:
            return []
        if self._decisions % self.refresh_every:
            return []
        b = load_bucket(load)
        current = self.online.current
        others = [w for w in self.online.widths if w != current]
        if not others:
            return []
        self._decisions += 1  # one refresh per period
        stale = min(others, key=lambda w: self._measured_at.get((b, w), -1))
        return [stale] if current is None else [stale, current]

    def observe(self, width: int, load: int, step_s: float, tokens: int) -> None:
        """A decode step at ``width`` emitted ``tokens`` for ``load`` requests in ``step_s``."""
        if self.policy != "online" or not tokens:
            return
        if width in self._skip:
            self._skip.discard(width)
            return
        self.online.observe(width, load, step_s * load / tokens)
        self._measured_at[(load_bucket(load), width)] = self._decisions
