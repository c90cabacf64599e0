"""Verification width by load (DESIGN §5): which block width K to speculate with, 0 = off.

Two policies, plain Python so tests drive them without a GPU (``width_controller`` runs them):

- ``WidthSchedule``: the paper's fixed schedule (8 up to C32, 6 at C64, 4 from C128) as a
  table of (concurrency, width) points. Between points concurrency doubles, so the width is
  interpolated linearly in log2(C) and rounded to the nearest integer, ties to the narrower
  width (C45 -> 7, C91 -> 5); below the first point and above the last it is flat.
- ``OnlinePolicy``: chooses the width from measurements. At width K a session emits ``tau_K``
  tokens per round (measured acceptance, ``AcceptanceRates``; tau_0 = 1) and a round takes
  ``T_K`` seconds (an exponential average per width and load bucket, powers of 2), so the
  width serves ``tau_K * min(load, N_K) / T_K`` tokens per second, ``N_K`` the sessions it
  keeps (its draft ring and staging cost slots). Speculating at width K pays while eq. 13
  holds, ``N_K/N_0 > TPOT_K/TPOT_0`` with ``TPOT_K = T_K / tau_K`` (``speculation_pays``);
  among the widths that pay it picks the one that serves most, with none 0. Width 0 is the
  baseline of eq. 13: until it is measured the policy runs it. While admissions wait because
  memory binds, the policy runs 0: the sessions a width keeps are what binds then.
  Hysteresis: a different width takes over only after it has been the best by more than
  ``margin`` (relative) for ``patience`` consecutive decisions, so noise does not flap it; a
  change of acceptance the detector of ``AcceptanceRates`` found waives it once, so a width
  that stops paying is left within a few rounds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dhisparse.capacity import speculation_pays
from services.worker.speculative.acceptance_rates import AcceptanceRates

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
    alpha: float = 0.3  # weight of a new round time in its average
    pair_weight: float = 0.5  # weight of a probe's paired ratio in the estimates' ratio
    current: int | None = None
    acceptance: AcceptanceRates = field(init=False)
    _round: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, width) -> s
    _challenger: int | None = None
    _streak: int = 0
    _urgent: bool = False  # a change of acceptance waives the patience of the next decision

    def __post_init__(self) -> None:
        if 0 not in self.widths:
            raise ValueError("the candidates must include 0 (speculation off)")
        self.acceptance = AcceptanceRates(positions=max(1, max(self.widths) - 1))

    def observe_round(self, width: int, load: int, round_s: float) -> None:
        """A round at ``width`` with ``load`` sessions took ``round_s`` seconds."""
        key = (load_bucket(load), width)
        old = self._round.get(key)
        self._round[key] = round_s if old is None else old + self.alpha * (round_s - old)

    def observe_ratio(self, width: int, anchor: int, load: int, ratio: float) -> None:
        """Rounds at ``width`` took ``ratio`` times those at ``anchor`` (measured in turns):
        the ratio of their estimates at this load moves ``pair_weight`` of the way to it (is
        set to it where ``width`` has none). ``anchor`` must have a round time."""
        t, old = self.round_time(anchor, load), self.round_time(width, load)
        if t is None:
            raise ValueError(f"width {anchor} has no round time to pair width {width} with")
        r = ratio if old is None else old / t + self.pair_weight * (ratio - old / t)
        self._round[(load_bucket(load), width)] = t * r

    def observe_acceptance(self, accepted: Sequence[int], proposed: Sequence[int]) -> bool:
        """A verify round's proposals (``proposed[r]``) and accepted prefixes (``accepted[r]``)
        per request; True when they show a change of acceptance."""
        shifted = self.acceptance.observe(accepted, proposed)
        self._urgent |= shifted
        return shifted

    def round_times(self) -> dict[tuple[int, int], float]:
        """The round-time estimates, seconds by (load bucket, width)."""
        return dict(self._round)

    def measured(self, width: int, load: int) -> bool:
        """Whether ``width``'s round time was measured in the load's own bucket."""
        return (load_bucket(load), width) in self._round

    def neighbour(self, load: int) -> int | None:
        """The nearest other load bucket where speculation off (width 0) was measured, in
        log2 distance (the lower on a tie); None if there is none."""
        b = load_bucket(load)
        seen = {bb for (bb, w) in self._round if w == 0 and bb != b}
        if not seen:
            return None
        return min(seen, key=lambda bb: (abs(math.log2(bb) - math.log2(b)), bb))

    def round_time(self, width: int, load: int) -> float | None:
        """Average round time of ``width`` in the load's bucket, else in the nearest bucket
        measured (in log2 distance, the lower bucket on a tie); None if never measured."""
        b = load_bucket(load)
        seen = [bb for (bb, w) in self._round if w == width]
        if not seen:
            return None
        near = min(seen, key=lambda bb: (abs(math.log2(bb) - math.log2(b)), bb))
        return self._round[(near, width)]

    def scores(self, load: int, sessions: Mapping[int, int]) -> dict[int, float]:
        """Tokens per second each measured width serves at ``load`` (``tau_K * min(load, N_K)
        / T_K``), for width 0 and the widths where speculation pays (eq. 13)."""
        base = self.round_time(0, load)
        if base is None:
            return {}
        out = {0: min(load, sessions[0]) / base}
        for w in self.widths:
            t = self.round_time(w, load)
            tau = self.acceptance.length(w)
            if w == 0 or t is None or tau is None:
                continue
            if speculation_pays(sessions[w], sessions[0], (t / tau) / base, load=load):
                out[w] = tau * min(load, sessions[w]) / t
        return out

    def decide(self, load: int, sessions: Mapping[int, int], memory_waits: int = 0) -> int:
        """The width to run at ``load`` concurrent sessions; ``sessions[K]``: sessions the
        capacity model admits at width K (``sessions[0]``: without speculation);
        ``memory_waits``: admissions waiting because memory binds: then 0, at once, where
        speculating keeps fewer sessions than not (its ring and staging hold memory that
        turning it off frees); where they are reserved whatever the width, it frees nothing
        and the choice goes on as usual."""
        if memory_waits > 0 and any(sessions[w] < sessions[0] for w in self.widths if w):
            self.current, self._challenger, self._streak, self._urgent = 0, None, 0, False
            return 0
        scores = self.scores(load, sessions)
        if not scores:  # the baseline first: no lasting choice before it is measured
            return 0
        best = max(scores, key=lambda w: (scores[w], -w))  # a tie: the narrower
        urgent, self._urgent = self._urgent, False
        if self.current is None or best == self.current:
            self.current, self._challenger, self._streak = best, None, 0
            return best
        cur = scores.get(self.current, 0.0)
        if scores[best] <= cur * (1.0 + self.margin):
            self._challenger, self._streak = None, 0
            return self.current
        self._streak = self._streak + 1 if best == self._challenger else 1
        self._challenger = best
        if urgent or self._streak >= self.patience:
            self.current, self._challenger, self._streak = best, None, 0
        return self.current


WIDTH_POLICIES = ("fixed", "paper", "online")
