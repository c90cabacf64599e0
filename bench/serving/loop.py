"""The engine-level closed loop: C clients over an in-process ``Engine`` driven by
``add_request`` + ``step()``, time-stamping every request's arrival, admission, first token and
finish, and every step's work, with the engine's counters read at the window's edges."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.worker.engine.engine import Engine
from services.worker.engine.request import Request, SamplingParams

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


@dataclass(frozen=True)
class Counters:
    """The engine's cumulative counters at one instant (None where the engine has none)."""

    census: tuple[int, int, int, int] | None  # rows direct, hot, host; rows copied from host
    spec: tuple[int, int, int] | None  # drafts, draft tokens, accepted
    residency: tuple[int, int, int, int, int] | None  # events, pages, repopulated, waited, #lat

    @staticmethod
    def read(eng: Engine) -> Counters:
        c = eng.kv.census()
        census = None if c is None else (c.direct, c.hot, c.host, c.copied)
        sp = eng.speculator
        spec = None if sp is None else (sp.counters.drafts, sp.counters.draft_tokens,
                                        sp.counters.accepted)  # fmt: skip
        res = getattr(eng.kv.payload, "residency", None)
        resid = None
        if res is not None:
            st = res.stats
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


def closed_loop(
    eng: Engine, prefixes: list[list[int]], concurrency: int, load: Load, tag: str
) -> LoopResult:
    """Runs ``concurrency`` closed-loop clients on ``eng`` (idle on entry, idle on return)."""
    t_start = time.monotonic()
    if load.duration_s is not None:
        w0, w1 = t_start + load.warmup_s, t_start + load.warmup_s + load.duration_s
    else:
        w0, w1 = t_start, float("inf")
    live: dict[str, RequestRecord] = {}
    requests: dict[str, Request] = {}
    records: list[RequestRecord] = []
    issued = [0] * concurrency

    def submit(client: int) -> None:
        j = issued[client]
        issued[client] += 1
        prefix = (client + j * concurrency) % len(prefixes)
        params = SamplingParams(
            temperature=load.temperature, max_tokens=load.output_len, ignore_eos=True,
            seed=load.request_seed(client, j),
        )  # fmt: skip
        req = eng.add_request(f"{tag}-c{client}-r{j}", prefixes[prefix], params)
        rec = RequestRecord(client, j, prefix, req.arrival, output_ids=req.output_ids)
        live[req.request_id] = rec
        requests[req.request_id] = req
        records.append(rec)

    def more(client: int, now: float) -> bool:
        if load.requests_per_client is not None:
            return issued[client] < load.requests_per_client
        return now < w1

    for c in range(concurrency):
        submit(c)
    steps: list[StepRecord] = []
    start: Counters | None = None
    peak = 0
    opt_peak: int | None = None
    last_progress = time.monotonic()
    st = eng.stats
    while live:
        now = time.monotonic()
        if start is None and now >= w0:
            start = Counters.read(eng)
        if now >= w1:
            break
        before = (st.decode_s, st.decode_tokens, st.prefill_s, st.prefill_tokens_computed)
        outs = eng.step()
        t = time.monotonic()
        decode = prefill = tokens = 0
        for o in outs:
            rec = live.get(o.request_id)
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
            if rec.admitted is None:
                rec.admitted = requests[o.request_id].admitted_time
            if o.finished:
                rec.finish, rec.finish_reason = t, o.finish_reason.value  # type: ignore[union-attr]
                rec.error = o.error.message if o.error else None
                del live[o.request_id], requests[o.request_id]
                if more(rec.client, t):
                    submit(rec.client)
        if outs:
            last_progress = t
        elif t - last_progress > STALL_S:
            raise RuntimeError(f"{tag}: no output for {STALL_S:.0f} s with {len(live)} live")
        spec = eng.speculator
        steps.append(StepRecord(
            t, decode, prefill, tokens, st.decode_s - before[0], st.decode_tokens - before[1],
            st.prefill_s - before[2], st.prefill_tokens_computed - before[3], eng.num_running,
            eng.num_waiting, spec.counters.width if spec is not None else 0,
        ))  # fmt: skip
        peak = max(peak, decode + prefill, eng.num_running)
        if len(steps) % 8 == 0 and eng.kv.mode == "adaptive":
            opt_peak = max(opt_peak or 0, eng.kv.memory().optional)
    start = start or Counters.read(eng)
    end = Counters.read(eng)
    w1 = min(w1, time.monotonic())
    res = getattr(eng.kv.payload, "residency", None)
    lats = list(res.stats.reclaim_latency[start.residency[4] :]) if res and start.residency else []
    for rid, rec in live.items():  # the run ended with these in flight: abort them
        rec.admitted = rec.admitted or requests[rid].admitted_time
        rec.finish_reason = "end"
        eng.abort(rid)
    return LoopResult(concurrency, (w0, w1), records, steps, start, end, lats, peak, opt_peak)
