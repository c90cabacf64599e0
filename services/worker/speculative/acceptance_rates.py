"""Measured acceptance by draft position, for the online width policy (DESIGN §5, eq. 13).

Position i (1-based) of a verify round is reached when proposals 1..i-1 were accepted and the
request verified at least i proposals; it is a hit when proposal i is accepted too. The
conditional rate ``c_i = hits_i / reached_i`` does not depend on the width the round ran at, so
a round at width K measures the acceptance of every width up to K at once, and the tokens a
session gains per round at width K are ``tau_K = 1 + sum_{j<K} prod_{i<=j} c_i``.

The estimate is a decayed count (each round's counts weigh ``decay`` times the previous
round's, and a round without speculation ages it alike), and a change detector compares the
last rounds (up to ``window``) against the estimate before them: when a position's recent hits
are less likely than ``alpha`` under it (a binomial tail; and the rates differ by more than
``slack``), the content changed, and the estimate of every position is replaced by the counts
of the rounds since the change (the estimate before weighing one trial, so a position those
rounds did not reach keeps a rate) rather than blended: the policy sees the new acceptance
within a few rounds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Round:
    hits: list[int]
    reached: list[int]
    weight: float = 1.0  # what the estimate weighs this round's counts by now


@dataclass
class AcceptanceRates:
    positions: int  # the deepest draft position measured (K_max - 1)
    decay: float = 0.95
    window: int = 8  # rounds of the recent counts the change detector reads
    alpha: float = 1e-6  # how unlikely the recent hits must be under the estimate
    slack: float = 0.05  # a smaller change of a rate is no change
    min_reached: int = 6  # recent trials of a position before it is tested (twice as many before)
    _hits: list[float] = field(default_factory=list)
    _reached: list[float] = field(default_factory=list)
    _recent: deque[_Round] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0 or self.window < 1:
            raise ValueError("decay must lie in (0, 1] and the window hold a round at least")
        self._hits = [0.0] * self.positions
        self._reached = [0.0] * self.positions

    def observe(self, accepted: Sequence[int], proposed: Sequence[int]) -> bool:
        """One verify round: request r verified ``proposed[r]`` proposals and accepted the first
        ``accepted[r]``. True when the window shows a change of acceptance (the estimate then
        holds the counts since the change)."""
        # requests whose hits (positions 1..a) and reached positions (those and a + 1, within
        # the n verified) end at each depth; a position's counts are those ending deeper
        hit_ends, reach_ends = [0] * (self.positions + 1), [0] * (self.positions + 1)
        for a, n in zip(accepted, proposed, strict=True):
            if not 0 <= a <= n <= self.positions:
                raise ValueError(f"accepted {a} of {n} proposals (positions: {self.positions})")
            hit_ends[a] += 1
            reach_ends[min(a + 1, n)] += 1
        hits, reached = [0] * self.positions, [0] * self.positions
        h = r = 0
        for i in range(self.positions - 1, -1, -1):
            h, r = h + hit_ends[i + 1], r + reach_ends[i + 1]
            hits[i], reached[i] = h, r
        self.age()
        for i in range(self.positions):
            self._hits[i] += hits[i]
            self._reached[i] += reached[i]
        self._recent.append(_Round(hits, reached))
        if len(self._recent) > self.window:
            self._recent.popleft()
        since = self._change()
        if since is None:
            return False
        new = list(self._recent)[-since:]
        for i in range(self.positions):  # the estimate before weighs one trial
            before = self.rate(i + 1)
            prior = (before, 1.0) if before is not None else (0.0, 0.0)
            self._hits[i] = sum(r.hits[i] for r in new) + prior[0]
            self._reached[i] = sum(r.reached[i] for r in new) + prior[1]
        self._recent.clear()
        return True

    def age(self) -> None:
        """What was measured before weighs ``decay`` less: at every round, with speculation
        (``observe``) or without (the width controller's call), so that a probe after a long
        time off reads the acceptance of now."""
        self._hits = [self.decay * h for h in self._hits]
        self._reached = [self.decay * n for n in self._reached]
        for r in self._recent:
            r.weight *= self.decay

    def _change(self) -> int | None:
        """The rounds since acceptance changed, if it did: of the window's last rounds at
        each position, those whose hits are least likely (below ``alpha``) under the
        estimate before them; None when none are."""
        best, since = math.log(self.alpha), None
        rounds = list(self._recent)
        for i in range(self.positions):
            n = h = 0
            wn = wh = 0.0
            for m, r in enumerate(reversed(rounds), start=1):
                n, h = n + r.reached[i], h + r.hits[i]
                wn, wh = wn + r.weight * r.reached[i], wh + r.weight * r.hits[i]
                old_n = self._reached[i] - wn
                if n < self.min_reached or old_n < 2 * self.min_reached:
                    continue
                old = (self._hits[i] - wh) / old_n
                if abs(h / n - old) <= self.slack:
                    continue
                tail = _log_tail(h, n, min(max(old, 0.02), 0.98), old_n)
                if tail < best:
                    best, since = tail, m
        return since

    def rate(self, position: int) -> float | None:
        """``c_i`` for position i (1-based); None while it was never reached."""
        n = self._reached[position - 1]
        return self._hits[position - 1] / n if n > 0 else None

    def length(self, width: int) -> float | None:
        """Expected tokens a session emits per round at ``width`` (anchor included; 0 and 1:
        one); None while a position below ``width`` was never reached."""
        total, reach = 1.0, 1.0
        for i in range(1, width):
            c = self.rate(i)
            if c is None:
                if reach < 1e-6:  # no round gets this deep: the width adds nothing here
                    return total
                return None
            reach *= c
            total += reach
        return total


def _log_tail(hits: int, n: int, p: float, n_before: float) -> float:
    """log P(as few hits as ``hits`` of ``n``, or as many, whichever side they lie on) for
    Binomial(n, p): exact for few trials, else the normal approximation with the variance of
    both rates (``p`` was measured over ``n_before`` trials). Within 3 standard deviations
    (a tail above 1e-3, far from any threshold) it answers that bound, without the sum."""
    z = abs(hits / n - p) / math.sqrt(p * (1 - p) * (1 / n + 1 / n_before))
    if z < 3.0:
        return math.log(1e-3)
    if n * min(p, 1 - p) < 15:
        ks = range(hits, n + 1) if hits > n * p else range(hits + 1)
        logs = [
            math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p)
            for k in ks
        ]  # fmt: skip
        top = max(logs)
        return top + math.log(sum(math.exp(x - top) for x in logs))
    return math.log(max(0.5 * math.erfc(z / math.sqrt(2)), 1e-300))
