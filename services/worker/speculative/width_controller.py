"""Which block width K to verify each round (DESIGN §5): the fixed width, the paper's schedule
by concurrency, or the online policy (eq. 13 on measured round times and acceptance), with the
measuring the online policy needs. Plain Python: tests drive it with synthetic traces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.worker.speculative.width_policy import (
    WIDTH_POLICIES,
    OnlinePolicy,
    WidthSchedule,
    load_bucket,
)


class WidthController:
    """The online policy first measures each candidate width for ``explore_steps`` rounds at
    each load bucket, width 0 first and the widths taking turns round by round: the host
    alternates between slow and fast phases a few to a dozen steps long (``python -m bench
    profile-step --series``), and widths measured one after the other would each see a
    different phase; taking turns, a phase weighs on all of them alike. Each width's first
    round of such a burst does not count for its round time: it pays one-off costs (kernel
    compilation, cold caches) that would bias the average against that width for a long time.
    At a load bucket next to one already measured, a width that served less than ``1 -
    prune`` of the best there is not explored (every round spent measuring a bad width is lost
    throughput, and load buckets change as requests come and go); width 0, the baseline of
    eq. 13, always is.

    Acceptance is measured by draft position in every speculative round, so any round at width
    K tells the acceptance of every width up to K. Round times are recorded from measuring
    rounds only (bursts in turns, where a host phase weighs on each width alike): a round of
    the current width alone would compare a phase of now against the others' averages. Those
    rounds are watched instead: when the mean of the last ``window`` of them strays from their
    level (a slow average of them) by more than ``drift`` (relative), the next rounds
    re-measure width 0 and the runner-up in turns with the current width.

    Estimates of widths not running go stale, so every ``period`` decisions the controller
    probes a width in turns with the current one, there and back ``probe_steps`` times (w, c,
    c, w): the width measured longest ago (the widest on a tie: it measures most positions).
    A probe's rounds are paired: the ratio of a width's round times to the current width's in
    the same probe (both saw the same host phases) moves its ratio to the current width's
    estimate halfway (one probe is little evidence; the estimate itself stays, so the widths
    left out keep their ratios). A probe that leaves its width clearly behind (by more than
    the policy's margin) doubles the period, up to ``refresh_every * max_backoff``: a width
    that keeps losing costs ever less to watch. A probe that finds a close contender probes it
    again after ``refresh_every``, until the policy decides; a change of the current width
    starts the period afresh at ``refresh_every``. A rise of acceptance while speculating narrower than K_max probes K_max at once."""

    def __init__(
        self,
        policy: str,
        k_max: int,
        sessions: Mapping[int, int],
        explore_steps: int = 4,
        refresh_every: int = 48,
        max_backoff: int = 16,
        probe_steps: int = 1,
        prune: float = 0.2,
        window: int = 8,
        drift: float = 0.4,
    ) -> None:
        """``sessions[K]``: the sessions the worker keeps at width K, for every candidate
        width (0, the widths 4, 6, 8 within ``k_max``, and ``k_max``)."""
        if policy not in WIDTH_POLICIES:
            raise ValueError(f"unknown width policy {policy!r}; choose from {WIDTH_POLICIES}")
        self.policy = policy
        self.k_max = k_max
        self.schedule = WidthSchedule()
        widths = tuple(sorted({0, *(w for w in (4, 6, 8) if w <= k_max), k_max}))
        missing = [w for w in widths if w not in sessions]
        if missing:
            raise ValueError(f"no session count for widths {missing}")
        self.online = OnlinePolicy(widths=widths)
        self.sessions = {w: sessions[w] for w in widths}
        self.explore_steps = explore_steps
        self.refresh_every = refresh_every
        self.max_backoff = max_backoff
        self.probe_steps = probe_steps
        self.prune = prune
        self.window = window
        self.drift = drift
        self.period = refresh_every
        self._explore: list[int] = []  # the burst's widths still to run, last first
        self._skip: set[int] = set()  # widths whose coming round time is not recorded
        self._anchor: int | None = None  # a probe's current width (None: exploring)
        self._paired: dict[int, list[float]] = {}  # a probe's round times by width
        self._measuring = False  # the last width given was a measuring round's
        self._decisions = 0
        self._since_probe = 0
        self._next: int | None = None  # the width the next probe measures (None: the stalest)
        self._measured_at: dict[tuple[int, int], int] = {}  # (bucket, width) -> decision no.
        self._watch: list[float] = []  # the current width's last decided round times
        self._watched: tuple[int, int] | None = None  # (bucket, width) of ``_watch``
        self._level: float | None = None  # the slow average of ``_watch``'s rounds
        self._remeasure = False
        self._rounds: dict[int, int] = {}  # rounds given per width
        self._cold = 0  # rounds observed cold (not timed)

    def estimates(self) -> dict:
        """What the policy chose from, for a benchmark to record: the rounds run at each width,
        the online policy's current width, its round-time estimates (ms by ``"bucket/width"``)
        and the tokens a session emits per round at each candidate width (None: not yet
        measured); ``cold_rounds``: rounds it did not time (a graph captured or a pass run
        eagerly)."""
        out: dict = {"policy": self.policy, "rounds": dict(sorted(self._rounds.items()))}
        if self.policy == "online":
            out["current"] = self.online.current
            out["cold_rounds"] = self._cold
            out["round_ms"] = {
                f"{b}/{w}": s * 1e3 for (b, w), s in sorted(self.online.round_times().items())
            }
            out["tokens_per_round"] = {
                w: self.online.acceptance.length(w) for w in self.online.widths
            }
        return out

    def width(self, load: int, memory_waits: int = 0) -> int:
        """The width of the coming round at ``load`` sessions; ``memory_waits``: admissions
        waiting because memory binds (the online policy then turns speculation off where that
        frees memory: ``OnlinePolicy.decide``)."""
        k = self._choose(load, memory_waits)
        self._rounds[k] = self._rounds.get(k, 0) + 1
        return k

    def _choose(self, load: int, memory_waits: int) -> int:
        if self.policy == "fixed":
            return self.k_max
        if self.policy == "paper":
            return min(self.k_max, self.schedule.width(load))
        self._measuring = False
        if memory_waits > 0 and any(n < self.sessions[0] for n in self.sessions.values()):
            self._explore.clear()
            return self.online.decide(load, self.sessions, memory_waits)
        if not self._explore:
            ws, skip = self._to_measure(load)
            if ws:
                # a probe runs its widths there and back (ABBA), so a host phase that begins
                # or ends within it weighs on each width alike
                turns = (
                    ws * (self.explore_steps + 1) if skip else (ws + ws[::-1]) * self.probe_steps
                )
                self._explore = list(reversed(turns))
                self._skip = set(ws) if skip else set()
                self._anchor = None if skip else self.online.current
                self._paired, self._watch = {}, []
        if self._explore:
            self._measuring = True
            return self._explore.pop()
        self._decisions += 1
        self._since_probe += 1
        before = self.online.current
        k = self.online.decide(load, self.sessions)
        if before is not None and self.online.current != before:
            self.period, self._next, self._since_probe = self.refresh_every, None, 0
        return k

    def _to_measure(self, load: int) -> tuple[list[int], bool]:
        """Widths to measure now, in turns, and whether their first rounds are skipped: those
        not yet measured in this load's bucket (skipped), else, once per period, the width
        measured longest ago other than the current, with the current."""
        unmeasured = [w for w in self.online.widths if not self.online.measured(w, load)]
        near = self.online.neighbour(load)
        if unmeasured and near is not None:  # skip widths clearly worse next door
            prior = self.online.scores(near, self.sessions)
            floor = (1.0 - self.prune) * max(prior.values())
            unmeasured = [w for w in unmeasured if w == 0 or prior.get(w, 0.0) >= floor]
        if unmeasured:
            return unmeasured, True
        current = self.online.current
        if self._remeasure and current is not None:
            self._remeasure = False
            scores = self.online.scores(load, self.sessions)
            others = sorted((w for w in scores if w != current), key=lambda w: -scores[w])
            return sorted({0, current, *others[:1]}), False
        if self.refresh_every <= 0 or current is None or self._since_probe < self.period:
            return [], False
        self._since_probe = 0
        b = load_bucket(load)
        others = [w for w in self.online.widths if w != current]
        stale = min(others, key=lambda w: (self._measured_at.get((b, w), -1), -w))
        probe = self._next if self._next in others else stale
        return [probe, current], False

    def observe(
        self,
        width: int,
        load: int,
        round_s: float,
        accepted: Sequence[int] = (),
        proposed: Sequence[int] = (),
        cold: bool = False,
    ) -> None:
        """A round at ``width`` (0: a plain decode pass) for ``load`` requests took
        ``round_s``; request r verified ``proposed[r]`` proposals and accepted the first
        ``accepted[r]`` (both empty at width 0). ``cold``: the round captured a CUDA graph or
        ran a pass eagerly (a key met for the first times), so its time is not its width's:
        its acceptance counts, its time does not, and a measuring round's turn is run again."""
        if self.policy != "online":
            return
        if width <= 1:  # acceptance measured before weighs less after every round off
            self.online.acceptance.age()
        else:
            before = self.online.acceptance.length(self.k_max)
            if self.online.observe_acceptance(accepted, proposed):
                after = self.online.acceptance.length(self.k_max)
                rose = before is not None and after is not None and after > before
                if rose and self.online.current != self.k_max:
                    self.period, self._next = self.refresh_every, self.k_max
                    self._since_probe = self.period
        key = (load_bucket(load), width)
        if cold:
            self._cold += 1
            self._skip.discard(width)  # the one-off costs a burst's first round is skipped for
            if self._measuring and len(self._explore) < 4 * len(self.online.widths):
                self._explore.append(width)  # the turn again, once its graphs are captured
            return
        if not self._measuring:
            self._watch_round(key, round_s)
            return
        if width in self._skip:
            self._skip.discard(width)
            return
        self._measured_at[key] = self._decisions
        if self._anchor is None:
            self.online.observe_round(width, load, round_s)
            return
        self._paired.setdefault(width, []).append(round_s)
        if not self._explore and self._anchor in self._paired:
            self._end_probe(load)

    def _end_probe(self, load: int) -> None:
        """Applies a probe's paired ratios, and sets when and what the next probe measures."""
        anchor = self._paired.pop(self._anchor)
        for w, ts in self._paired.items():
            self.online.observe_ratio(w, self._anchor, load, sum(ts) / sum(anchor))
        scores = self.online.scores(load, self.sessions)
        bar = (1.0 - self.online.margin) * scores.get(self._anchor, 0.0)
        close = [w for w in self._paired if w in scores and scores[w] >= bar]
        if close:
            self.period, self._next = self.refresh_every, max(close, key=lambda w: scores[w])
        else:
            self.period = min(2 * self.period, self.refresh_every * self.max_backoff)
            self._next = None
        self._paired = {}

    def _watch_round(self, key: tuple[int, int], round_s: float) -> None:
        """A decided round of the current width: re-measure when its last ``window`` rounds
        stray from its level (a slow average of its decided rounds, host phases and all)."""
        if key != self._watched:
            self._watch, self._watched, self._level = [], key, None
        self._watch = [*self._watch[-(self.window - 1) :], round_s]
        if len(self._watch) < self.window:
            return
        mean = sum(self._watch) / self.window
        if self._level is None:
            self._level = mean
        elif abs(mean / self._level - 1.0) > self.drift:
            self._remeasure, self._watch, self._level = True, [], mean
        else:
            self._level += (round_s - self._level) / (4 * self.window)
