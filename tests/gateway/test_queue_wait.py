"""Admission answers a burst at once: the expected wait of a queued request, from the measured
service time and the running requests (``queue_wait``); a request expected past its deadline
is refused with 429 and ``Retry-After`` on arrival, or, before any service was measured, as
soon as the first completion measures it; one expected in time waits and is served. Over the
in-process ledger, then over a real gateway app in front of an in-process worker that streams
at a set pace."""

from __future__ import annotations

import asyncio
import time

import httpx

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.gateway import GatewaySettings, create_app
from services.gateway.queue_wait import (
    ModelService,
    ServiceTime,
    expected_admissions,
    retry_after_s,
)
from services.gateway.routing import AdmissionRejected
from tests.gateway.conftest import gateway_client
from tests.gateway.test_admission import CONFIG_JSON, MODEL, job, make, sample, worker
from tests.gateway.test_worker_health import serving


def test_a_request_waits_for_the_seat_that_frees_first() -> None:
    # two seats: one frees in 0.5 s, one in 1 s; each next request holds a seat 1 s
    assert expected_admissions([0.5, 0.0], 1.0, 4) == [0.5, 1.0, 1.5, 2.0]
    assert expected_admissions([3.0], 1.0, 2) == [0.0, 1.0]  # overdue: frees now
    assert expected_admissions([], 1.0, 3) == []  # nothing runs: unknown
    t = ServiceTime(weight=0.5)
    assert t.mean_s is None
    t.observe(1.0)
    t.observe(2.0)
    assert t.mean_s == 1.5
    assert [retry_after_s(w) for w in (0.01, 1.0, 1.2, 7.9)] == [1, 1, 2, 8]


def test_the_plan_is_the_size_of_the_queue_however_often_it_changes() -> None:
    """Every admission and release changes the plan; each new one covers the queue, no more
    (a plan that grew with each change would take the gateway's memory and time)."""
    service = ModelService()
    t0 = time.monotonic()
    service.released(service.admitted(t0 - 1.0), t0)  # a service time of 1 s
    assert service.time.mean_s == 1.0
    start = time.monotonic()
    for _ in range(64):
        serial = service.admitted(t0)  # one seat, free in 1 s: the 10th waits 10 s
        assert service.admission_at(10, t0, waiting=10) == t0 + 10.0
        service.released(serial, t0 + 1.0)
    assert time.monotonic() - start < 1.0


SERVICE_S, DEADLINE_S = 0.3, 0.75  # waves of admissions at 0.3, 0.6 (in time), 0.9 (late)


async def _hold(lease, seconds: float) -> None:
    await asyncio.sleep(seconds)
    lease.release()


def _outcomes(tasks: list[asyncio.Task]) -> tuple[list[AdmissionRejected], list[asyncio.Task]]:
    """(the rejections among the finished ``tasks``, the tasks not refused)."""
    refused = [t for t in tasks if t.done() and t.exception() is not None]
    return [t.exception() for t in refused], [t for t in tasks if t not in refused]


async def _serve(tasks: list[asyncio.Task], holders: list[asyncio.Task]) -> None:
    """Each of ``tasks`` admitted (in order), then holding its seat ``SERVICE_S``."""
    for t in tasks:
        holders.append(asyncio.create_task(_hold(await t, SERVICE_S)))


async def test_a_burst_past_the_deadline_is_refused_at_once() -> None:
    admission, metrics, workers = make([worker("a", sessions=2)], queue_deadline_s=DEADLINE_S)
    await admission.observe(workers)
    # one completed request measures the service time
    await _hold(await admission.acquire(job("m"), lambda: workers), SERVICE_S)
    # two run; six more arrive together
    running = [await admission.acquire(job(f"r{i}"), lambda: workers) for i in range(2)]
    holders = [asyncio.create_task(_hold(lease, SERVICE_S)) for lease in running]
    start = time.monotonic()
    waiting = [asyncio.create_task(admission.acquire(job(f"w{i}"), lambda: workers))
               for i in range(6)]  # fmt: skip
    await asyncio.sleep(0.05)
    refused, served = _outcomes(waiting)
    # positions 5 and 6: the third wave of admissions comes past the deadline
    assert served == waiting[:4] and not any(t.done() for t in served)
    for e in refused:
        assert (e.status, e.reason) == (429, "expected-wait")
        assert e.retry_after_s == 1  # about 0.9 s away, rounded up
    await _serve(served, holders)
    assert time.monotonic() - start < DEADLINE_S
    await asyncio.gather(*holders)
    name = "dhisparse:requests_rejected_total"
    assert sample(metrics, name, model=MODEL, reason="expected-wait", status="429") == 2
    await admission.close()


async def test_before_any_completion_waiters_are_refused_at_the_first() -> None:
    admission, _, workers = make([worker("a", sessions=2)], queue_deadline_s=DEADLINE_S)
    await admission.observe(workers)
    running = [await admission.acquire(job(f"r{i}"), lambda: workers) for i in range(2)]
    start = time.monotonic()
    waiting = [asyncio.create_task(admission.acquire(job(f"w{i}"), lambda: workers))
               for i in range(6)]  # fmt: skip
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in waiting)  # no service measured yet: they wait
    await asyncio.sleep(SERVICE_S - 0.05)
    for lease in running:  # the first completions: a service time of SERVICE_S
        lease.release()
    await asyncio.sleep(0.05)
    refused, served = _outcomes(waiting)
    assert served == waiting[:4]  # told long before the deadline:
    assert [e.reason for e in refused] == ["expected-wait"] * 2
    holders: list[asyncio.Task] = []
    await _serve(served, holders)
    assert time.monotonic() - start < DEADLINE_S
    await asyncio.gather(*holders)
    await admission.close()


# --- over a real gateway -----------------------------------------------------------------------
SEATS, TOKENS, TOKEN_S = 4, 4, 0.1  # the paced worker: 4 requests at once, 0.4 s each
BURST, GATEWAY_DEADLINE_S = 30, 1.5  # waves at 0.4, 0.8, 1.2 are in time; 1.6 is late


class PacedWorker(pb_grpc.WorkerServicer):
    """A worker of ``SEATS`` seats that streams each request's tokens ``TOKEN_S`` apart."""

    async def Generate(self, request, context):
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(TOKEN_S)
            done = i + 1 == n
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[97], text="a",
                finish_reason=pb.FINISH_REASON_LENGTH if done else pb.FINISH_REASON_UNSPECIFIED,
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
            )  # fmt: skip

    async def Health(self, request, context):
        return pb.HealthResponse(ok=True, status="serving")

    async def GetLoad(self, request, context):
        return pb.LoadResponse(worker_id="paced", max_num_seqs=SEATS, kv_capacity_bytes=1 << 30,
                               kv_free_bytes=1 << 30, mode="resident", serving_ranks=1)  # fmt: skip

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name=MODEL, max_model_len=1024, vocab_size=264,
                            mode="resident", config_json=CONFIG_JSON)  # fmt: skip


async def _burst(client: httpx.AsyncClient, n: int) -> list[tuple[httpx.Response, float]]:
    """``n`` completions at once; each response with its seconds from the burst's start."""
    start = time.monotonic()

    async def one(i: int) -> tuple[httpx.Response, float]:
        body = {"prompt": "ab", "max_tokens": TOKENS, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        return r, time.monotonic() - start

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_a_burst_beyond_capacity_is_served_or_refused_at_once_by_the_gateway() -> None:
    async with serving(PacedWorker()) as address:
        settings = GatewaySettings(workers=[address], model=MODEL, health_interval_s=0.2,
                                   queue_deadline_s=GATEWAY_DEADLINE_S)  # fmt: skip
        async with gateway_client(create_app(settings)) as client:
            # cold: nothing measured yet, so the queue waits until the first completions
            # measure the service; then who cannot make it is told at once
            cold = await _burst(client, BURST)
            warm = await _burst(client, BURST)  # the service is known on arrival
    # times relative to the burst's own waves (a loaded host stretches them all alike): cold,
    # refused before the second wave is served; warm, before the first is
    for results, wave in ((cold, 1), (warm, 0)):
        statuses = [r.status_code for r, _ in results]
        assert set(statuses) <= {200, 429}, statuses  # no one waited out the deadline
        refused = [(r, t) for r, t in results if r.status_code == 429]
        assert len(refused) >= BURST // 3 and statuses.count(200) >= 3 * SEATS
        served_by = sorted(t for r, t in results if r.status_code == 200)[wave * SEATS]
        for r, t in refused:
            assert r.headers["x-dhisparse-reason"] == "expected-wait"
            assert int(r.headers["Retry-After"]) >= 1
            assert t < served_by, (t, served_by)
