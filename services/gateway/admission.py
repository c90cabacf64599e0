"""Memory-based admission (DESIGN §1): a request runs only once a worker's KV capacity can hold
its whole budget, as recorded in the capacity ledger (``ledger``); until then it waits in a
bounded FIFO per model.

- **Sizing:** the capacity model's bytes for prompt + max tokens on each worker (``sizing``).
- **Routing:** workers that could ever hold the request (within one serving rank's share of
  the capacity: a data-parallel group runs each request on one rank), ranked by the router
  (least admitted share first); the ledger admits on the first account with room, atomically:
  a worker's whole capacity and seats, or the least admitted of a data-parallel group's ranks
  with room (each its share of the group's), and the lease names that rank (``accounts``).
- **Waiting:** only the head of a queue tries; it retries every ``poll_s`` (another replica's
  release is seen no sooner) and at once when this gateway releases a lease or polls the
  workers. A request is served or refused at once: one whose expected wait, from the queue's
  measured service (``queue_wait``), is longer than its deadline gets 429 ``expected-wait``
  with ``Retry-After`` = that wait, on arrival or as soon as a completion changes the estimate
  (until a first request has completed, requests wait). Queue full → 429 ``queue-full``
  (``no-capacity`` when queueing is off), deadline (an estimate that was too hopeful) → 503
  ``deadline``, a request larger than every worker → 400 ``too-large``. Cancelling a waiter
  (client gone) takes it out of the queue.
- **Shared pages:** the leading pages a request will likely share on a worker with other
  requests there (``shared_pages``) are offered as blocks the ledger counts once among the live
  leases naming them; the worker's report of what it shared settles the lease.
- **Leases:** renewed every TTL/3 while their request runs; released when it ends. A worker no
  gateway has seen healthy for ``worker_dead_after_s`` has all its leases released.
- **Allocation wait:** from the attempt to the lease, observed for every admitted request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from services.gateway.leases import LeaseKeeper, Offer, SharedLead
from services.gateway.ledger import Ledger, LedgerUnavailable
from services.gateway.metrics import GatewayMetrics
from services.gateway.queue_wait import ModelService, TimedLease, retry_after_s
from services.gateway.routing import (
    AdmissionJob,
    AdmissionRejected,
    Lease,
    LeastLoadedRouter,
    NoWorkerAvailable,
    Router,
    WorkerStatus,
)
from services.gateway.shared_pages import SharedPages
from services.gateway.sizing import SessionSizer

log = logging.getLogger(__name__)

# Seconds a rejected client is told to wait. Admission cannot predict when capacity frees up;
# a short hint keeps clients with backoff (the openai client honours it) from hammering.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue: int = 256  # waiting requests per model in this gateway
    queue_deadline_s: float = 30.0
    lease_ttl_s: float = 10.0
    poll_s: float = 0.025
    worker_dead_after_s: float = 15.0


class _Waiter:
    __slots__ = ("turn",)

    def __init__(self) -> None:
        self.turn = asyncio.Event()  # set: something changed, try again


class MemoryAdmission:
    def __init__(
        self,
        ledger: Ledger,
        config: AdmissionConfig | None = None,
        *,
        sizer: SessionSizer | None = None,
        router: Router | None = None,
        metrics: GatewayMetrics | None = None,
        served_model_name: str | None = None,
        shared_pages: SharedPages | None = None,
    ) -> None:
        """``shared_pages``: which of a request's pages a worker shares with others (None: a
        lease counts all its bytes as its own)."""
        self.cfg = config or AdmissionConfig()
        self.sizer = sizer or SessionSizer()
        self.router = router or LeastLoadedRouter()
        self.shared_pages = shared_pages
        self.metrics = metrics
        self.leases = LeaseKeeper(
            ledger,
            lease_ttl_s=self.cfg.lease_ttl_s,
            worker_dead_after_s=self.cfg.worker_dead_after_s,
            on_release=self._kick_all,
            metrics=metrics,
            served_model_name=served_model_name,
        )
        self._queues: dict[str, deque[_Waiter]] = {}
        self._service: dict[str, ModelService] = {}

    @property
    def ledger(self) -> Ledger:
        return self.leases.ledger

    @property
    def live_leases(self) -> int:
        return self.leases.live_leases

    # ---- admission ------------------------------------------------------------------------
    async def acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease:
        start = time.monotonic()
        queue = self._queue(job.model)
        # A retry (its first worker failed) was admitted once already: it goes first.
        retry = bool(exclude)
        tried = False
        if retry or not queue:
            lease = await self._try(job, workers, exclude)
            if lease is not None:
                return self._admitted(job, lease, start)
            tried = True
        deadline = start + self.cfg.queue_deadline_s
        if not retry:
            self._refuse_a_long_wait(job, len(queue) + 1, deadline, time.monotonic())
        if not retry and len(queue) >= self.cfg.max_queue:
            if self.cfg.max_queue == 0:
                raise self._reject(
                    job, 429, "no-capacity", "No worker has capacity for the request now"
                )
            raise self._reject(
                job,
                429,
                "queue-full",
                f"The admission queue is full ({self.cfg.max_queue} waiting)",
            )
        waiter = _Waiter()
        if retry:
            queue.appendleft(waiter)
        else:
            queue.append(waiter)
        self._set_depth(job.model)
        waited_out = False  # the last wait ran to the deadline (a timer may fire a hair early)
        try:
            while True:
                waiter.turn.clear()
                head = queue[0] is waiter
                if head and not tried:
                    lease = await self._try(job, workers, exclude)
                    if lease is not None:
                        return self._admitted(job, lease, start)
                tried = False
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0 or waited_out:
                    raise self._reject(
                        job,
                        503,
                        "deadline",
                        f"No capacity for the request within {self.cfg.queue_deadline_s:g}s",
                    )
                self._refuse_a_long_wait(job, queue.index(waiter) + 1, deadline, now)
                timeout = min(self.cfg.poll_s, remaining) if head else remaining
                try:
                    await asyncio.wait_for(waiter.turn.wait(), timeout)
                except TimeoutError:
                    waited_out = timeout >= remaining
        finally:
            was_head = bool(queue) and queue[0] is waiter
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            if was_head:
                self._kick(job.model)
            self._set_depth(job.model)

    async def try_acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease | None:
        """One attempt, no queue: a lease on the best of ``workers`` outside ``exclude`` with
        room for ``job`` now, or None. For a session admitted once already that moves to
        another worker (its own died or drains): it neither waits behind new requests nor
        counts as an admission or a rejection."""
        try:  # it resumes its session from the store: no page is seated from a record
            return await self._try(job, workers, exclude, judge=False, share=False)
        except AdmissionRejected:  # the ledger did not answer
            return None

    async def _try(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str],
        *,
        judge: bool = True,
        share: bool = True,
    ) -> Lease | None:
        """One attempt: a lease on the best worker with room, or None when none has room now.
        Raises (``judge``; else None) when no worker could serve it at all (none healthy, or
        none large enough). ``share``: offer the pages it likely shares there as blocks."""
        healthy = [w for w in workers() if w.healthy and w.address not in exclude]
        sized: list[tuple[WorkerStatus, int]] = []
        for w in healthy:
            need = self.sizer.required_bytes(w, job.context_tokens)
            if need is not None and w.kv_capacity_bytes > 0:
                sized.append((w, need))
        if not sized:
            if not judge:
                return None
            what = "has reported its capacity yet" if healthy else "is available"
            raise self._no_worker(job, f"no healthy worker {what}")
        # one request runs on one rank of a data-parallel group: it must fit that rank's pool
        fits = {w.address: need for w, need in sized if need <= w.request_capacity_bytes}
        if not fits:
            if not judge:
                return None
            raise self._too_large(job, sized)
        # The router weighs what the ledger holds on each worker (every replica's leases).
        known = [self._with_usage(w) for w, _ in sized if w.address in fits]
        order = self.router.rank(known, exclude, job)
        shared = {}
        if share and self.shared_pages is not None:
            shared = self.shared_pages.blocks(job, known)
        offers = [
            Offer(account, fits[address], shared.get(address, SharedLead()))
            for address in order
            if address in fits
            for account in self.leases.accounts(address)
        ]
        try:
            return await self.leases.acquire(uuid.uuid4().hex, offers)
        except LedgerUnavailable as e:
            log.warning("admission ledger unavailable: %s", e)
            raise self._reject(
                job, 503, "ledger-unavailable", "The admission ledger is unavailable"
            ) from e

    def _with_usage(self, w: WorkerStatus) -> WorkerStatus:
        usage = self.leases.usage(w.address)
        return replace(w, admitted_bytes=usage.admitted_bytes) if usage is not None else w

    def _admitted(self, job: AdmissionJob, lease: Lease, start: float) -> Lease:
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.allocation_wait.labels(job.model).observe(now - start)
        service = self._service.setdefault(job.model, ModelService())
        serial = service.admitted(now)

        def released() -> None:
            service.released(serial, time.monotonic())
            self._reassess(job.model)

        return TimedLease(lease, released)

    def _refuse_a_long_wait(
        self, job: AdmissionJob, position: int, deadline: float, now: float
    ) -> None:
        """Raises 429 ``expected-wait`` when the request at ``position`` of its queue is
        expected to be admitted after ``deadline`` (``queue_wait``), as of ``now``: the time
        its caller found the deadline ahead, so that a wait expected to end at once is never
        refused for a deadline that passed in between (that one is the caller's 503)."""
        service = self._service.get(job.model)
        if service is None:
            return
        waiting = len(self._queues.get(job.model, ())) + 1
        at = service.admission_at(position, now, waiting)
        if at is None or at <= deadline:
            return
        wait = at - now
        self._count(job, "expected-wait", 429)
        raise AdmissionRejected(
            429,
            f"The admission queue is expected to reach this request in {wait:.1f}s, past its "
            f"{self.cfg.queue_deadline_s:g}s deadline: retry later",
            reason="expected-wait",
            retry_after_s=retry_after_s(wait),
        )

    def _reassess(self, model: str) -> None:
        """Wakes every waiter of ``model``: the expected waits changed."""
        for waiter in self._queues.get(model, ()):
            waiter.turn.set()

    # ---- rejections -------------------------------------------------------------------------
    def _count(self, job: AdmissionJob, reason: str, status: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(job.model, reason, str(status)).inc()

    def _reject(
        self, job: AdmissionJob, status: int, reason: str, message: str
    ) -> AdmissionRejected:
        self._count(job, reason, status)
        return AdmissionRejected(status, message, reason=reason, retry_after_s=RETRY_AFTER_S)

    def _no_worker(self, job: AdmissionJob, message: str) -> NoWorkerAvailable:
        self._count(job, "no-worker", 503)
        return NoWorkerAvailable(message)

    def _too_large(
        self, job: AdmissionJob, sized: Sequence[tuple[WorkerStatus, int]]
    ) -> AdmissionRejected:
        """400 in the shape of vLLM's context-length error (clients match on it to trim), with
        the longest context the largest worker's memory holds for one request (one rank's)."""
        self._count(job, "too-large", 400)
        largest = max((w for w, _ in sized), key=lambda w: w.request_capacity_bytes)
        longest = self._longest_context(largest, job.context_tokens)
        message = (
            f"This model's maximum context length is {longest} tokens on the KV memory of "
            f"the available workers. However, you requested {job.context_tokens} tokens "
            f"({job.prompt_tokens} in the messages, {job.max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
        return AdmissionRejected(400, message, reason="too-large")

    def _longest_context(self, worker: WorkerStatus, upper: int) -> int:
        lo, hi = 0, upper  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            need = self.sizer.required_bytes(worker, mid)
            if need is not None and need <= worker.request_capacity_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    # ---- queues -----------------------------------------------------------------------------
    def _queue(self, model: str) -> deque[_Waiter]:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = deque()
            if self.metrics is not None:  # the series exist before the first rejection
                self.metrics.rejected.labels(model, "queue-full", "429")
                self.metrics.rejected.labels(model, "expected-wait", "429")
                self.metrics.rejected.labels(model, "deadline", "503")
                self._set_depth(model)
        return queue

    def _set_depth(self, model: str) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.labels(model).set(len(self._queues.get(model, ())))

    def _kick(self, model: str) -> None:
        """Lets the head of ``model``'s queue try again now."""
        queue = self._queues.get(model)
        if queue:
            queue[0].turn.set()

    def _kick_all(self) -> None:
        for model in self._queues:
            self._kick(model)

    def queue_depth(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    # ---- lifecycle and worker updates -------------------------------------------------------
    async def start(self) -> None:
        await self.leases.start()

    async def observe(self, workers: Sequence[WorkerStatus]) -> None:
        """Takes in a poll of the workers (see ``LeaseKeeper.observe``), then lets the queue
        heads try again: capacity may have changed."""
        await self.leases.observe(workers)
        self._kick_all()

    async def close(self) -> None:
        await self.leases.close()
