"""The engine-level closed loop: C clients over an in-process ``Engine`` driven by
``add_request`` + ``step()``, time-stamping every request's arrival, admission, first token and
finish, and every step's work, with the engine's counters read at the window's edges."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bench.core.clock import OwnClock, WallClock
from services.worker.engine.engine import Engine
from services.worker.request.request import Request, SamplingParams

from .config import Load

STALL_S = 120.0  # no output for this long while requests are live: the run is broken


@dataclass
class RequestRecord:
    client: int
    index: int  # the client's index-th request
    prefix: int  # which prepared prefix it sent
    arrival: float  # engine clock (time.monotonic) at add_request
    admitted: float | None = None  # first admission: allocation wait ends
    first: float | None = None  # the step that produced its first token returned
    last: float | None = None  # ... and its latest token
    finish: float | None = None
    tokens: int = 0
    finish_reason: str | None = None  # stop | length | abort | end (aborted when the run ended)
    error: str | None = None
    output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepRecord:
    t: float  # when step() returned
    decode_batch: int  # requests that decoded (or verified) this step
    prefills: int  # requests prefilled this step
    tokens: int  # tokens emitted (first tokens included)
    decode_s: float  # the engine's decode time in this step
    decode_tokens: int
    prefill_s: float
    prefill_tokens: int
    running: int  # requests running after the step
    waiting: int
    width: int  # verification width in use (0: no speculation)
    sending: bool  # when it began, some client still had a request to send


@dataclass(frozen=True)
class Counters:
    """The engine's cumulative counters at one instant (None where the engine has none)."""

    census: tuple[int, int, int, int] | None  # rows direct, hot, host; rows copied from host
    spec: tuple[int, int, int] | None  # drafts, draft tokens, accepted
    residency: tuple[int, int, int, int, int] | None  # events, pages, repopulated, waited, #lat

    @staticmethod
    def read(eng: Engine) -> Counters:
        c = eng.kv.payload.census
        census = None if c is None else (c.direct, c.hot, c.host, c.copied)
        sp = eng.speculator
        spec = None if sp is None else (sp.counters.drafts, sp.counters.draft_tokens,
                                        sp.counters.accepted)  # fmt: skip
        st = eng.kv.payload.residency.stats
        resid = None
        if st is not None:
            resid = (st.reclaim_events, st.reclaim_pages, st.repopulated_pages,
                     st.admissions_waited, len(st.reclaim_latency))  # fmt: skip
        return Counters(census, spec, resid)


@dataclass
class LoopResult:
    concurrency: int
    window: tuple[float, float]
    records: list[RequestRecord]
    steps: list[StepRecord]
    start: Counters
    end: Counters
    reclaim_latencies: list[float]  # seconds, reclaims that completed in the window
    peak_running: int
    mem_peak_optional: int | None  # bytes of optional history at its peak (adaptive)


class ClosedLoop:
    """``concurrency`` closed-loop clients on ``eng`` (idle at the start, idle once done),
    stepped by the caller: ``closed_loop`` runs one alone, ``bench/core/lockstep.py`` several in
    turn (each then on its own ``OwnClock``)."""

    def __init__(
        self,
        eng: Engine,
        prefixes: list[list[int]],
        concurrency: int,
        load: Load,
        tag: str,
        clock: WallClock | OwnClock | None = None,
    ) -> None:
        self.eng, self.prefixes, self.concurrency, self.load, self.tag = (
            eng, prefixes, concurrency, load, tag,
        )  # fmt: skip
        self.clock = clock or WallClock()
        t_start = self.clock.now()
        if load.duration_s is not None:
            self.w0 = t_start + load.warmup_s
            self.w1 = self.w0 + load.duration_s
        else:
            self.w0, self.w1 = t_start, float("inf")
        self.live: dict[str, RequestRecord] = {}
        self.requests: dict[str, Request] = {}
        self.records: list[RequestRecord] = []
        self.issued = [0] * concurrency
        self.steps: list[StepRecord] = []
        self.start: Counters | None = None
        self.peak = 0
        self.opt_peak: int | None = None
        self.last_progress = time.monotonic()  # wall time: a stall is a stall
        self.done = False
        for c in range(concurrency):
            self._submit(c)

    def _submit(self, client: int) -> None:
        load, j = self.load, self.issued[client]
        self.issued[client] += 1
        prefix = (client + j * self.concurrency) % len(self.prefixes)
        params = SamplingParams(
            temperature=load.temperature, max_tokens=load.output_len, ignore_eos=True,
            seed=load.request_seed(client, j),
        )  # fmt: skip
        req = self.eng.add_request(f"{self.tag}-c{client}-r{j}", self.prefixes[prefix], params)
        arrival = self.clock.stamp(req.arrival, self.clock.now())
        rec = RequestRecord(client, j, prefix, arrival, output_ids=req.output_ids)
        self.live[req.request_id] = rec
        self.requests[req.request_id] = req
        self.records.append(rec)

    def _sending(self, now: float) -> bool:
        """Whether some client still has a request to send: the batch is being kept full."""
        return any(self._more(c, now) for c in range(self.concurrency))

    def _more(self, client: int, now: float) -> bool:
        if self.load.requests_per_client is not None:
            return self.issued[client] < self.load.requests_per_client
        return now < self.w1

    @property
    def active(self) -> bool:
        return not self.done and bool(self.live)

    def step(self) -> None:
        eng, st, clock = self.eng, self.eng.stats, self.clock
        now = clock.now()
        if self.start is None and now >= self.w0:
            self.start = Counters.read(eng)
        if now >= self.w1:
            self.done = True
            return
        before = (st.decode_s, st.decode_tokens, st.prefill_s, st.prefill_tokens_computed)
        sending = self._sending(now)
        outs = clock.timed(eng.step)
        t = clock.now()
        for rid, rec in self.live.items():
            if rec.admitted is None and self.requests[rid].admitted_time is not None:
                rec.admitted = clock.stamp(self.requests[rid].admitted_time, now)
        decode = prefill = tokens = 0
        for o in outs:
            rec = self.live.get(o.request_id)
            if rec is None:
                continue
            n = len(o.new_token_ids)
            if n:
                if rec.first is None:
                    rec.first, prefill = t, prefill + 1
                else:
                    decode += 1
                rec.last = t
                rec.tokens += n
                tokens += n
            if o.finished:
                rec.finish, rec.finish_reason = t, o.finish_reason.value  # type: ignore[union-attr]
                rec.error = o.error.message if o.error else None
                del self.live[o.request_id], self.requests[o.request_id]
                if self._more(rec.client, t):
                    self._submit(rec.client)
        wall = time.monotonic()
        if outs:
            self.last_progress = wall
        elif wall - self.last_progress > STALL_S:
            raise RuntimeError(
                f"{self.tag}: no output for {STALL_S:.0f} s with {len(self.live)} live"
            )
        spec = eng.speculator
        self.steps.append(StepRecord(
            t, decode, prefill, tokens, st.decode_s - before[0], st.decode_tokens - before[1],
            st.prefill_s - before[2], st.prefill_tokens_computed - before[3], eng.num_running,
            eng.num_waiting, spec.counters.width if spec is not None else 0, sending,
        ))  # fmt: skip
        self.peak = max(self.peak, decode + prefill, eng.num_running)
        if len(self.steps) % 8 == 0 and eng.kv.payload.mode == "adaptive":
            self.opt_peak = max(self.opt_peak or 0, eng.kv.memory().optional)

    def result(self) -> LoopResult:
        """Ends the run (requests still in flight are aborted) and returns what it measured."""
        eng = self.eng
        start = self.start or Counters.read(eng)
        end = Counters.read(eng)
        w1 = min(self.w1, self.clock.now())
        res = eng.kv.payload.residency.stats
        lats = list(res.reclaim_latency[start.residency[4] :]) if res and start.residency else []
        for rid, rec in self.live.items():  # the run ended with these in flight: abort them
            if rec.admitted is None and self.requests[rid].admitted_time is not None:
                rec.admitted = self.clock.stamp(self.requests[rid].admitted_time, w1)
            rec.finish_reason = "end"
            eng.abort(rid)
        self.live.clear()
        return LoopResult(
            self.concurrency, (self.w0, w1), self.records, self.steps, start, end, lats,
            self.peak, self.opt_peak,
        )  # fmt: skip


def closed_loop(
    eng: Engine, prefixes: list[list[int]], concurrency: int, load: Load, tag: str
) -> LoopResult:
    """Runs ``concurrency`` closed-loop clients on ``eng`` alone (idle on entry and return)."""
    loop = ClosedLoop(eng, prefixes, concurrency, load, tag)
    while loop.active:
        loop.step()
    return loop.result()
