"""The gateway's side of the worker gRPC API: the pool of workers (each a ``WorkerClient``,
polled for health and load) and ``generate`` with admission, routing, retry and re-attach.

Contract of ``WorkerPool.generate``: the returned async iterator yields the worker's deltas for
one request. A worker that fails *before its first token* is retried on another healthy worker
(at most ``max_retries`` times), under an id of the retry's own (``retry_of``). A worker with durable sessions whose process dies *after* the
first token has its stream moved to a live peer of its node with room (``peer_adoption``), which
adopts the session from the host store; when none does, the worker is waited for
(``resume_deadline``: ``resume_deadline_s``, longer for a worker that was slow to start) and the
stream re-attached to its successor (``reattach``), which resumed the session from the host
store; failing that — or at once for a worker without durable sessions (resident mode) — the
stream ends with an ``APIError``.
The admission lease stays held until the stream ends, whichever way. Closing or cancelling the
iterator cancels the gRPC call, which makes the worker abort the request and free its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import grpc
import grpc.aio

from services.gateway import convert
from services.gateway.affinity import PrefixAffinity
from services.gateway.convert import ModelInfo
from services.gateway.errors import (
    REASON_HEADER,
    APIError,
    admission_error,
    bad_request,
    service_unavailable,
)
from services.gateway.generation import GenerationDelta, GenerationInput
from services.gateway.metrics import GatewayMetrics
from services.gateway.peer_adoption import Broke, Origin, move_to_peer
from services.gateway.prefix_keys import PromptPrefix
from services.gateway.reattach import WORKER_GONE, TakeFrom, reattach
from services.gateway.routing import (
    Admission,
    AdmissionJob,
    AdmissionRejected,
    ImmediateAdmission,
    Lease,
    NoWorkerAvailable,
    WorkerStatus,
)
from services.gateway.worker_conn import WorkerClient, describe

log = logging.getLogger(__name__)

# A stream waits for a restarted worker at least this many times its predecessor's measured
# start-up (ModelInfo.startup_s), plus the restart delay of whatever restarts it.
RESTART_FACTOR = 2.0
RESTART_SLACK_S = 10.0

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


def retry_of(
    inp: GenerationInput, job: AdmissionJob, tries: int
) -> tuple[GenerationInput, AdmissionJob]:
    """The request as the attempt after ``tries`` failed ones sends it (0: as it came). A retry
    has an id of its own (``{id}~{tries}``): a worker that died before the first token leaves
    host regions under the first id, which the node's store keeps for it until its lease
    lapses, and a peer of that node would be refused them."""
    if tries == 0:
        return inp, job
    rid = f"{inp.request_id}~{tries}"
    return replace(inp, request_id=rid), replace(job, request_id=rid)


class WorkerPool:
    """All configured workers, polled every ``poll_interval_s``; ``health_misses`` polls
    missed in a row mark a worker unhealthy."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        admission: Admission | None = None,
        poll_interval_s: float = 1.0,
        health_misses: int = 3,
        max_retries: int = 2,
        resume_deadline_s: float = 60.0,
        metrics: GatewayMetrics | None = None,
        affinity: PrefixAffinity | None = None,
    ) -> None:
        """``affinity``: the prefix-affinity index that the admission's router reads
        (``affinity.PrefixAffinityRouter``); the pool records in it where each request went
        and what it left behind. None: no affinity."""
        self.workers = {a: WorkerClient(a, health_misses) for a in addresses}
        self.admission: Admission = admission or ImmediateAdmission()
        self.poll_interval_s = poll_interval_s
        self.max_retries = max_retries
        self.resume_deadline_s = resume_deadline_s  # 0: a worker dying mid-stream ends it
        self.metrics = metrics
        self.affinity = affinity
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

    def _why_down(self) -> str:
        """What the unhealthy workers last said, e.g. that their host KV store is gone."""
        why = [f"{w.address}: {w.last_error}" for w in self.workers.values() if w.last_error]
        return f" ({'; '.join(why)})" if why else ""

    def resume_deadline(self, startup_s: float) -> float:
        """How long a stream waits for its worker's successor: ``resume_deadline_s``, or for a
        worker that reported a slower start (``startup_s`` > 0: a group loading hundreds of GB)
        ``RESTART_FACTOR`` times its start-up plus ``RESTART_SLACK_S`` (the restart delay):
        the successor loads what its predecessor loaded."""
        if startup_s <= 0:
            return self.resume_deadline_s
        return max(self.resume_deadline_s, RESTART_FACTOR * startup_s + RESTART_SLACK_S)

    async def _reattach(
        self, worker: WorkerClient, inp: GenerationInput, received: int, startup_s: float,
        take_from: TakeFrom | None = None,
    ) -> AsyncIterator[GenerationDelta]:  # fmt: skip
        outcome = "failed"
        deadline_s = self.resume_deadline(startup_s)
        try:
            async for delta in reattach(
                worker.stub, worker.address, inp.request_id, received, deadline_s,
                take_from=take_from,
            ):  # fmt: skip
                outcome = "resumed"
                yield delta
        finally:
            if self.metrics is not None:
                self.metrics.streams_resumed.labels(inp.model, outcome).inc()

    async def _recover(
        self, worker: WorkerClient, origin: Origin | None, lease: Lease, job: AdmissionJob,
        inp: GenerationInput, received: int, startup_s: float,
    ) -> AsyncIterator[GenerationDelta]:  # fmt: skip
        """The rest of a stream whose ``worker`` died after ``received`` tokens: from live peers
        of its node while one adopts it (again when that one dies, also inside ``Adopt``: then
        the session is looked for at that peer), else from its successor.
        ``origin`` is the worker as the gateway knew it when the stream started there: by the
        time the break is handled, polls may have forgotten the dead worker's model."""
        # died in this recovery (address: generation): not asked before a poll hears another
        gone = {worker.address: _generation(worker, origin)}
        # the worker that last held the session at the store (and its stub): whom a successor
        # adopts it from after a peer died adopting it
        holder, holder_stub = origin, worker.stub
        while origin is not None:
            broke = time.monotonic()
            workers = list(self.workers.values())
            moved = await move_to_peer(
                workers, self.admission, job, origin, worker.stub, received, gone
            )
            if isinstance(moved, Broke):  # the session may be the broken peer's by now
                log.warning("peer %s died adopting %s: looking for it there",
                            moved.worker.address, inp.request_id)  # fmt: skip
                worker, origin = moved.worker, Origin.of(moved.worker, moved.rank)
                gone[worker.address] = worker.generation
                startup_s = worker.model.startup_s if worker.model is not None else startup_s
                continue
            if moved is None:
                break
            lease.release()  # the dead worker's share: the peer holds a lease of its own
            if self.metrics is not None:
                self.metrics.adoptions.labels(inp.model, "adopted").inc()
                self.metrics.adoption_latency.labels(inp.model).observe(time.monotonic() - broke)
            worker, lease = moved.worker, moved.lease
            origin = Origin.of(worker, lease.rank)  # the peer, alive: the origin if it dies
            holder, holder_stub = origin, worker.stub
            startup_s = worker.model.startup_s if worker.model is not None else startup_s
            worker.in_flight += 1
            died = False  # the peer died too: its lease stays held while the stream moves on
            try:
                resp = moved.first
                while resp is not grpc.aio.EOF:
                    delta = convert.generation_delta(resp)
                    received += len(delta.token_ids)
                    yield delta
                    resp = await moved.call.read()
                return
            except grpc.aio.AioRpcError as e:
                if e.code() not in WORKER_GONE:
                    raise
                log.warning("peer %s failed mid-generation of %s (%s): moving it again",
                            worker.address, inp.request_id, describe(e))  # fmt: skip
                died = True
                gone[worker.address] = _generation(worker, origin)
            finally:
                moved.call.cancel()
                worker.in_flight -= 1
                if not died:
                    lease.release()
        if self.metrics is not None:
            self.metrics.adoptions.labels(inp.model, "no_peer").inc()
            self.metrics.waiting_restart.labels(inp.model).inc()
        try:
            take_from = None
            if holder is not None and holder.address != worker.address:
                take_from = TakeFrom(holder.owner, holder.owner_generation, holder_stub)
            async for delta in self._reattach(worker, inp, received, startup_s, take_from):
                yield delta
        finally:
            lease.release()
            if self.metrics is not None:
                self.metrics.waiting_restart.labels(inp.model).dec()

    def _routed(
        self, model: str, prefix: PromptPrefix, worker: WorkerClient, exclude: Sequence[str]
    ) -> None:
        """Counts why admission chose ``worker`` among the healthy workers outside
        ``exclude``."""
        assert self.affinity is not None
        if self.metrics is None:
            return
        candidates = [s for s in self.statuses() if s.healthy and s.address not in exclude]
        routed = self.affinity.routed(prefix, worker.address, candidates)
        self.metrics.routing_decisions.labels(model, routed.reason).inc()
        self.metrics.predicted_tokens.labels(model).inc(routed.predicted_tokens)

    def _left(
        self, model: str, prefix: PromptPrefix, worker: WorkerClient, output: Sequence[int]
    ) -> None:
        """Records the pages a finished request left in its node's store: the prompt and its
        output but the last token (sampled, never computed). Only then: a worker leaves a
        request's pages when it ends, so a request running now predicts no hit for another."""
        assert self.affinity is not None
        status = worker.status()
        if status.prefix_cache:
            page = self.affinity.page_size(status)
            self.affinity.record(prefix.continued(page, output[:-1]), status)
            if self.metrics is not None:
                self.metrics.affinity_pages.labels(model).set(len(self.affinity.index))

    async def generate(self, inp: GenerationInput) -> AsyncIterator[GenerationDelta]:
        """The deltas of ``inp`` from a worker chosen by admission (see the module docstring
        for retries and cancellation). Raises ``APIError``: 400 when the worker refuses the
        parameters, 503 (with Retry-After) when no worker can take it, 429/503 from admission."""
        prefix = self.affinity.prefix(inp.prompt_token_ids) if self.affinity else None
        job = AdmissionJob(
            inp.request_id, len(inp.prompt_token_ids), inp.sampling.max_tokens, inp.model, prefix
        )
        if self.metrics is not None:
            self.metrics.export_zeros(inp.model)
        tried: list[str] = []
        last_error: str | None = None
        while True:
            try:
                lease = await self.admission.acquire(job, self.statuses, exclude=tried)
            except AdmissionRejected as e:
                raise admission_error(e) from e
            except NoWorkerAvailable as e:
                detail = f" (last failure: {last_error})" if last_error else self._why_down()
                err = service_unavailable(f"No healthy worker is available{detail}", 1)
                err.headers[REASON_HEADER] = "no-worker"
                raise err from e
            worker = self.workers[lease.worker]
            if prefix is not None:
                self._routed(inp.model, prefix, worker, tried)
            attempt, work = retry_of(inp, job, len(tried))
            tried.append(worker.address)
            worker.in_flight += 1
            # Re-attach only to a worker whose sessions outlive it (what it said while alive).
            durable = worker.model is not None and worker.model.durable_sessions
            origin = Origin.of(worker, lease.rank)  # where its sessions may move, were it to die
            startup_s = worker.model.startup_s if worker.model is not None else 0.0
            # the rank whose share the lease holds runs it (a data-parallel group)
            call = worker.stub.Generate(convert.generate_request(attempt, lease.rank))
            started, cached = False, 0  # cached: the prompt tokens this worker imported
            output: list[int] = []  # the tokens received
            try:
                try:
                    async for resp in call:
                        delta = convert.generation_delta(resp)
                        if not started:
                            started, cached = True, delta.cached_prompt_tokens
                            lease.settle(delta.shared_prompt_tokens)
                        output.extend(delta.token_ids)
                        yield delta
                    if prefix is not None:
                        self._left(inp.model, prefix, worker, output)
                    return
                except grpc.aio.AioRpcError as e:
                    gone = started and durable and e.code() in WORKER_GONE
                    if not (gone and self.resume_deadline_s > 0):
                        raise
                    log.warning(
                        "worker %s failed mid-generation of %s (%s): re-attaching",
                        worker.address, inp.request_id, describe(e),
                    )  # fmt: skip
                async for delta in self._recover(
                    worker, origin, lease, work, attempt, len(output), startup_s
                ):
                    # a peer or the successor resumed the whole session; the prompt was this
                    # worker's
                    yield replace(delta, cached_prompt_tokens=cached)
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in _CLIENT_ERRORS:
                    raise bad_request(e.details() or code.name) from e
                if started:
                    status = 503 if code == grpc.StatusCode.UNAVAILABLE else 500
                    raise APIError(
                        status, f"worker {worker.address} failed mid-generation: {describe(e)}"
                    ) from e
                if code == grpc.StatusCode.UNAVAILABLE:
                    worker.healthy = False  # until the next poll says otherwise
                last_error = f"{worker.address}: {describe(e)}"
                if code not in _RETRYABLE:
                    raise APIError(500, f"worker {last_error}") from e
                log.warning(
                    "request %s failed before its first token on %s", attempt.request_id, last_error
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


def _generation(worker: WorkerClient, origin: Origin | None) -> int:
    """The generation ``worker`` had when the stream ran on it: its origin's (taken while it
    lived), else its last poll's."""
    return origin.generation if origin is not None else worker.generation
