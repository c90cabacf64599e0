"""The gateway's side of the worker gRPC API: one channel per worker, health/load polling, and
``generate`` with admission, routing and retry.

Contract of ``WorkerPool.generate``: the returned async iterator yields the worker's deltas for
one request. A worker that fails *before its first token* is retried on another healthy worker
(at most ``max_retries`` times); after the first token a failure ends the stream with an
``APIError``. Closing or cancelling the iterator cancels the gRPC call, which makes the worker
abort the request and free its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
import grpc.aio

from dhisparse.rpc import worker_pb2, worker_pb2_grpc
from services.gateway import convert
from services.gateway.convert import ModelInfo, WorkerLoad
from services.gateway.errors import (
    REASON_HEADER,
    APIError,
    admission_error,
    bad_request,
    service_unavailable,
)
from services.gateway.generation import GenerationDelta, GenerationInput
from services.gateway.routing import (
    Admission,
    AdmissionJob,
    AdmissionRejected,
    ImmediateAdmission,
    NoWorkerAvailable,
    WorkerStatus,
)

log = logging.getLogger(__name__)

# Failures before the first token that another worker may not share.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# The worker judged the request itself bad: the client's mistake, not the worker's.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


def _describe(e: grpc.aio.AioRpcError) -> str:
    return f"{e.code().name}: {e.details() or 'no details'}"


class WorkerClient:
    """One worker: its channel and what the last poll learned."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self.healthy = False
        self.model: ModelInfo | None = None
        self.load: WorkerLoad | None = None
        self.in_flight = 0
        self.in_flight_at_poll = 0
        self.last_error: str | None = None

    def open(self) -> None:
        """Creates the channel; must run on the event loop that will use it (grpc.aio binds a
        channel to the loop it was created on), hence not in ``__init__``."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        if self._stub is None:
            raise RuntimeError(f"worker client {self.address} is not open")
        return self._stub

    async def poll(self, timeout_s: float) -> None:
        """Health, then load; model info until it is known. Never raises."""
        was_healthy = self.healthy
        try:
            if self.model is None:
                info = await self.stub.GetModelInfo(
                    worker_pb2.ModelInfoRequest(), timeout=timeout_s
                )
                self.model = convert.model_info(info)
            health = await self.stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s)
            if not health.ok:
                self.healthy, self.last_error = False, f"unhealthy: {health.status}"
            else:
                load = await self.stub.GetLoad(worker_pb2.LoadRequest(), timeout=timeout_s)
                self.load = convert.worker_load(load)
                self.in_flight_at_poll = self.in_flight
                self.healthy, self.last_error = True, None
        except grpc.aio.AioRpcError as e:
            self.healthy, self.last_error = False, _describe(e)
            # A worker that comes back may be a restarted process serving another model.
            self.model = None
        if was_healthy != self.healthy:
            log.info(
                "worker %s is %s%s",
                self.address,
                "healthy" if self.healthy else "unhealthy",
                f" ({self.last_error})" if self.last_error else "",
            )

    def status(self) -> WorkerStatus:
        load, model = self.load, self.model
        return WorkerStatus(
            address=self.address,
            healthy=self.healthy,
            num_running=load.num_running if load else 0,
            num_waiting=load.num_waiting if load else 0,
            max_num_seqs=load.max_num_seqs if load else 0,
            kv_capacity_bytes=load.kv_capacity_bytes if load else 0,
            kv_free_bytes=load.kv_free_bytes if load else 0,
            in_flight=self.in_flight,
            in_flight_at_poll=self.in_flight_at_poll,
            model_name=model.model_name if model else "",
            mode=model.mode if model else "",
            config_json=model.config_json if model else "",
            kv_layout_json=model.kv_layout_json if model else "",
        )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class WorkerPool:
    """All configured workers, polled every ``poll_interval_s``."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        admission: Admission | None = None,
        poll_interval_s: float = 1.0,
        max_retries: int = 2,
    ) -> None:
        self.workers = {a: WorkerClient(a) for a in addresses}
        self.admission: Admission = admission or ImmediateAdmission()
        self.poll_interval_s = poll_interval_s
        self.max_retries = max_retries
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Starts admission, opens the channels, polls once (so the gateway starts knowing who
        is up) and keeps polling."""
        await self.admission.start()
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_forever(), name="worker-poller")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.admission.close()
        await asyncio.gather(*(w.close() for w in self.workers.values()))

    async def poll_all(self) -> None:
        for w in self.workers.values():
            w.open()
        timeout = max(0.5, self.poll_interval_s)
        await asyncio.gather(*(w.poll(timeout) for w in self.workers.values()))
        try:
            await self.admission.observe(self.statuses())
        except Exception:
            log.exception("admission could not take in the workers' state")

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_all()

    def statuses(self) -> list[WorkerStatus]:
        return [w.status() for w in self.workers.values()]

    @property
    def any_healthy(self) -> bool:
        return any(w.healthy for w in self.workers.values())

    def model_info(self) -> ModelInfo | None:
        """The model of the healthy workers (any worker's when none is healthy)."""
        known = [w for w in self.workers.values() if w.model is not None]
        known.sort(key=lambda w: not w.healthy)
        return known[0].model if known else None

    def max_model_len(self) -> int | None:
        """The smallest context limit among the workers that reported one."""
        lens = [w.model.max_model_len for w in self.workers.values() if w.model]
        return min(lens) if lens else None

    async def generate(self, inp: GenerationInput) -> AsyncIterator[GenerationDelta]:
        """The deltas of ``inp`` from a worker chosen by admission (see the module docstring
        for retries and cancellation). Raises ``APIError``: 400 when the worker refuses the
        parameters, 503 (with Retry-After) when no worker can take it, 429/503 from admission."""
        job = AdmissionJob(
            inp.request_id, len(inp.prompt_token_ids), inp.sampling.max_tokens, inp.model
        )
        request = convert.generate_request(inp)
        tried: list[str] = []
        last_error: str | None = None
        while True:
            try:
                lease = await self.admission.acquire(job, self.statuses, exclude=tried)
            except AdmissionRejected as e:
                raise admission_error(e) from e
            except NoWorkerAvailable as e:
                detail = f" (last failure: {last_error})" if last_error else ""
                err = service_unavailable(f"No healthy worker is available{detail}", 1)
                err.headers[REASON_HEADER] = "no-worker"
                raise err from e
            worker = self.workers[lease.worker]
            tried.append(worker.address)
            worker.in_flight += 1
            call = worker.stub.Generate(request)
            started = False
            try:
                async for resp in call:
                    started = True
                    yield convert.generation_delta(resp)
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in _CLIENT_ERRORS:
                    raise bad_request(e.details() or code.name) from e
                if started:
                    status = 503 if code == grpc.StatusCode.UNAVAILABLE else 500
                    raise APIError(
                        status, f"worker {worker.address} failed mid-generation: {_describe(e)}"
                    ) from e
                if code == grpc.StatusCode.UNAVAILABLE:
                    worker.healthy = False  # until the next poll says otherwise
                last_error = f"{worker.address}: {_describe(e)}"
                if code not in _RETRYABLE:
                    raise APIError(500, f"worker {last_error}") from e
                log.warning(
                    "request %s failed before its first token on %s", inp.request_id, last_error
                )
                if len(tried) > self.max_retries:
                    raise service_unavailable(
                        f"Every worker tried failed before the first token; last {last_error}", 1
                    ) from e
            finally:
                # A no-op when the call completed; otherwise the worker aborts the request.
                call.cancel()
                worker.in_flight -= 1
                lease.release()
