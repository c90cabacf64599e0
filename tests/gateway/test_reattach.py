"""A worker that dies mid-stream: the gateway keeps the stream, waits for the worker to come
back, re-attaches with the number of tokens received and continues seamlessly; when the session
is gone (NOT_FOUND) or the worker stays away past the deadline the stream fails with a 503. The
admission lease is held while waiting and released exactly once either way. A fake worker
(in-process gRPC) plays the dying and restarted process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence

import grpc
import grpc.aio
import pytest

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.gateway.errors import APIError
from services.gateway.generation import GenerationInput, SamplingSpec
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import AdmissionJob, WorkerStatus
from services.gateway.worker_client import RESTART_FACTOR, RESTART_SLACK_S, WorkerPool

TOKENS = list(range(100, 130))


class FakeWorker(pb_grpc.WorkerServicer):
    """Streams TOKENS one per response; dies (the stream breaks) after ``die_after``, is down
    for ``down_s`` and comes back holding the session (``resume``: ok / not_found)."""

    def __init__(
        self, die_after: int, down_s: float, resume: str = "ok", durable: bool = True,
        startup_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.durable = durable
        self.startup_s = startup_s
        self.die_after = die_after
        self.down_s = down_s
        self.resume = resume
        self.down_until = 0.0
        self.resumed_from: list[int] = []
        self.cached_at_gateway: set[int] = set()  # the deltas' cached prompt tokens (``run``)

    def _resp(
        self, tokens: list[int], done: int, finish: bool, cached: int = 0
    ) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            request_id="r", token_ids=tokens, text="".join(chr(t) for t in tokens),
            finish_reason=pb.FINISH_REASON_LENGTH if finish else pb.FINISH_REASON_UNSPECIFIED,
            prompt_tokens=3, completion_tokens=done, cached_prompt_tokens=cached,
        )  # fmt: skip

    async def Generate(self, request, context):
        for i in range(self.die_after):
            yield self._resp([TOKENS[i]], i + 1, False)
        self.down_until = asyncio.get_running_loop().time() + self.down_s
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")

    async def Resume(self, request, context):
        self.resumed_from.append(request.tokens_received)
        if self.resume == "not_found":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no resumed session 'r'")
        n = request.tokens_received
        # a resumed session computed none of its prompt here: it reports it all cached
        yield self._resp(TOKENS[n : n + 5], n + 5, False, cached=3)  # the catch-up
        for i in range(n + 5, len(TOKENS)):
            yield self._resp([TOKENS[i]], i + 1, i + 1 == len(TOKENS), cached=3)

    async def Health(self, request, context):
        if asyncio.get_running_loop().time() < self.down_until:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return pb.HealthResponse(ok=True, status="serving")

    async def GetLoad(self, request, context):
        return pb.LoadResponse(worker_id="w", max_num_seqs=4, kv_capacity_bytes=1 << 30)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(
            model_name="fake", max_model_len=1024, vocab_size=300, mode="hisparse",
            durable_sessions=self.durable, startup_s=self.startup_s,
        )  # fmt: skip


class CountingAdmission:
    """Admits at once and counts lease releases; its leases hold room on data-parallel rank
    ``rank`` (None: the whole worker)."""

    def __init__(self, rank: int | None = None) -> None:
        self.released = 0
        self.held = 0
        self.rank = rank

    async def acquire(
        self, job: AdmissionJob, workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ):  # fmt: skip
        admission = self

        class Lease:
            worker = workers()[0].address
            rank = admission.rank
            done = False

            def settle(self, shared_tokens: int) -> None:
                pass

            def release(self) -> None:
                if not self.done:
                    self.done = True
                    admission.held -= 1
                    admission.released += 1

        self.held += 1
        return Lease()

    async def start(self) -> None: ...
    async def observe(self, workers) -> None: ...
    async def close(self) -> None: ...


async def run(worker: FakeWorker, deadline_s: float = 10.0):
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    admission, metrics = CountingAdmission(), GatewayMetrics()
    pool = WorkerPool(
        [f"127.0.0.1:{port}"], admission=admission, poll_interval_s=0.1,
        resume_deadline_s=deadline_s, metrics=metrics,
    )  # fmt: skip
    await pool.start()
    got: list[int] = []
    error = None
    try:
        inp = GenerationInput("r", (1, 2, 3), SamplingSpec(max_tokens=len(TOKENS)))
        async for delta in pool.generate(inp):
            got.extend(delta.token_ids)
            worker.cached_at_gateway.add(delta.cached_prompt_tokens)
            assert admission.held == 1  # held all along, while waiting too
    except APIError as e:
        error = e
    finally:
        await pool.close()
        await server.stop(0)
    outcome = {o: metrics.streams_resumed.labels("", o)._value.get() for o in ("resumed", "failed")}
    return got, error, admission, outcome


async def test_the_stream_is_reattached_seamlessly() -> None:
    worker = FakeWorker(die_after=7, down_s=0.4)
    got, error, admission, outcome = await run(worker)
    assert error is None
    assert got == TOKENS  # nothing lost, nothing twice
    assert worker.resumed_from == [7]
    assert worker.cached_at_gateway == {0}  # the first worker computed the prompt: usage says so
    assert (admission.held, admission.released) == (0, 1)
    assert outcome == {"resumed": 1, "failed": 0}


async def test_a_lost_session_ends_the_stream_with_a_503() -> None:
    got, error, admission, outcome = await run(FakeWorker(7, 0.2, resume="not_found"))
    assert got == TOKENS[:7]
    assert error is not None and error.status == 503
    assert "could not be resumed" in str(error.body()) and "no resumed session" in str(error.body())
    assert (admission.held, admission.released) == (0, 1)
    assert outcome == {"resumed": 0, "failed": 1}


async def test_a_worker_that_stays_away_ends_the_stream_at_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got, error, admission, _ = await run(FakeWorker(3, down_s=60), deadline_s=0.6)
    assert got == TOKENS[:3]
    assert error is not None and error.status == 503 and "did not come back" in str(error.body())
    assert "mid-generation" in str(error.body())
    assert loop.time() - t0 < 5
    assert (admission.held, admission.released) == (0, 1)


async def test_a_worker_slow_to_start_is_waited_for_past_the_deadline() -> None:
    """A worker that took longer to start than ``resume_deadline_s`` (a group loading a large
    model) gets its measured start-up's worth (``WorkerPool.resume_deadline``)."""
    worker = FakeWorker(5, down_s=1.5, startup_s=0.6)
    got, error, _, outcome = await run(worker, deadline_s=0.3)
    assert error is None and got == TOKENS and outcome == {"resumed": 1, "failed": 0}
    pool = WorkerPool(["127.0.0.1:1"], resume_deadline_s=60.0)
    assert pool.resume_deadline(0.0) == 60.0  # not reported: as configured
    assert pool.resume_deadline(5.0) == 60.0
    assert pool.resume_deadline(300.0) == RESTART_FACTOR * 300.0 + RESTART_SLACK_S


@pytest.mark.parametrize("durable,deadline_s", [(True, 0.0), (False, 10.0)])
async def test_no_reattach_when_off_or_not_durable(durable: bool, deadline_s: float) -> None:
    worker = FakeWorker(3, 0.1, durable=durable)
    got, error, admission, outcome = await run(worker, deadline_s=deadline_s)
    assert got == TOKENS[:3] and error is not None and error.status == 503
    assert "failed mid-generation" in str(error.body())
    assert admission.released == 1 and outcome == {"resumed": 0, "failed": 0}
    assert worker.resumed_from == []
