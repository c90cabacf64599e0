"""Memory-based admission (DESIGN §1): a request runs only once a worker's KV capacity can hold
its whole budget, as recorded in the capacity ledger (``ledger``); until then it waits in a
bounded FIFO per model.

- **Sizing:** the capacity model's bytes for prompt + max tokens on each worker (``sizing``).
- **Routing:** workers that could ever hold the request, ranked by the router (least admitted
  share first); the ledger admits on the first with room, atomically.
- **Waiting:** only the head of a queue tries; it retries every ``poll_s`` (another replica's
  release is seen no sooner) and at once when this gateway releases a lease or polls the
  workers. Queue full → 429 ``queue-full`` (``no-capacity`` when queueing is off), deadline →
  503 ``deadline``, a request larger than every worker → 400 ``too-large``. Cancelling a waiter
  (client gone) takes it out of the queue.
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
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.gateway.ledger import Admitted, Candidate, Ledger, LedgerUnavailable, WorkerUsage
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import (
    AdmissionJob,
    AdmissionRejected,
    LeastLoadedRouter,
    NoWorkerAvailable,
    Router,
    WorkerStatus,
)
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


class LedgerLease:
    """A lease in the ledger; ``release`` is idempotent and returns at once (the ledger write
    runs in the background)."""

    def __init__(self, owner: MemoryAdmission, worker: str, lease_id: str, need: int) -> None:
        self._owner = owner
        self._worker = worker
        self.lease_id = lease_id
        self.need_bytes = need

    @property
    def worker(self) -> str:
        return self._worker

    def release(self) -> None:
        self._owner._release(self)


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
    ) -> None:
        self.ledger = ledger
        self.cfg = config or AdmissionConfig()
        self.sizer = sizer or SessionSizer()
        self.router = router or LeastLoadedRouter()
        self.metrics = metrics
        self.served_model_name = served_model_name
        self._queues: dict[str, deque[_Waiter]] = {}
        self._live: dict[str, LedgerLease] = {}  # this gateway's leases, by id
        self._usage: dict[str, WorkerUsage] = {}  # the ledger's view, as last seen
        self._unhealthy_since: dict[str, float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None

    # ---- admission ------------------------------------------------------------------------
    async def acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> LedgerLease:
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
        deadline = start + self.cfg.queue_deadline_s
        try:
            while True:
                waiter.turn.clear()
                head = queue[0] is waiter
                if head and not tried:
                    lease = await self._try(job, workers, exclude)
                    if lease is not None:
                        return self._admitted(job, lease, start)
                tried = False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._reject(
                        job,
                        503,
                        "deadline",
                        f"No capacity for the request within {self.cfg.queue_deadline_s:g}s",
                    )
                timeout = min(self.cfg.poll_s, remaining) if head else remaining
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.turn.wait(), timeout)
        finally:
            was_head = bool(queue) and queue[0] is waiter
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            if was_head:
                self._kick(job.model)
            self._set_depth(job.model)

    async def _try(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str],
    ) -> LedgerLease | None:
        """One attempt: a lease on the best worker with room, or None when none has room now.
        Raises when no worker could serve it at all (none healthy, or none large enough)."""
        healthy = [w for w in workers() if w.healthy and w.address not in exclude]
        sized: list[tuple[WorkerStatus, int]] = []
        for w in healthy:
            need = self.sizer.required_bytes(w, job.context_tokens)
            if need is not None and w.kv_capacity_bytes > 0:
                sized.append((w, need))
        if not sized:
            what = "has reported its capacity yet" if healthy else "is available"
            raise self._no_worker(job, f"no healthy worker {what}")
        fits = {w.address: need for w, need in sized if need <= w.kv_capacity_bytes}
        if not fits:
            raise self._too_large(job, sized)
        known = [
            replace(w, admitted_bytes=self._usage[w.address].admitted_bytes)
            if w.address in self._usage
            else w
            for w, _ in sized
            if w.address in fits
        ]
        order = self.router.rank(known, exclude)
        candidates = [Candidate(a, fits[a]) for a in order if a in fits]
        lease_id = uuid.uuid4().hex
        admitted = await self._ledger_acquire(job, lease_id, candidates)
        if admitted is None:
            return None
        self._usage[admitted.worker] = admitted.usage
        lease = LedgerLease(self, admitted.worker, lease_id, fits[admitted.worker])
        self._live[lease_id] = lease
        return lease

    async def _ledger_acquire(
        self, job: AdmissionJob, lease_id: str, candidates: Sequence[Candidate]
    ) -> Admitted | None:
        """The ledger call, shielded: if the caller is cancelled after the ledger recorded the
        lease, the lease is released rather than leaked until its TTL."""
        task = asyncio.ensure_future(
            self.ledger.acquire(lease_id, candidates, self.cfg.lease_ttl_s)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._undo_acquire(lease_id))
            raise
        except LedgerUnavailable as e:
            log.warning("admission ledger unavailable: %s", e)
            raise self._reject(
                job, 503, "ledger-unavailable", "The admission ledger is unavailable"
            ) from e

    def _undo_acquire(self, lease_id: str) -> Callable[[asyncio.Future[Admitted | None]], None]:
        def undo(task: asyncio.Future[Admitted | None]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            admitted = task.result()
            if admitted is not None:
                self._spawn(self._release_in_ledger(admitted.worker, lease_id, 0))

        return undo

    def _admitted(self, job: AdmissionJob, lease: LedgerLease, start: float) -> LedgerLease:
        if self.metrics is not None:
            self.metrics.allocation_wait.labels(job.model).observe(time.monotonic() - start)
        return lease

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
        the longest context the largest worker's memory holds."""
        self._count(job, "too-large", 400)
        largest = max((w for w, _ in sized), key=lambda w: w.kv_capacity_bytes)
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
            if need is not None and need <= worker.kv_capacity_bytes:
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

    # ---- leases -----------------------------------------------------------------------------
    def _release(self, lease: LedgerLease) -> None:
        if self._live.pop(lease.lease_id, None) is None:
            return
        self._spawn(self._release_in_ledger(lease.worker, lease.lease_id, lease.need_bytes))

    async def _release_in_ledger(self, worker: str, lease_id: str, need: int) -> None:
        try:
            await self.ledger.release(worker, lease_id)
        except LedgerUnavailable as e:
            log.warning(
                "lease %s on %s not released (%s); it expires with its TTL", lease_id, worker, e
            )
            return
        usage = self._usage.get(worker)
        if usage is not None:
            self._usage[worker] = replace(
                usage,
                admitted_bytes=max(0, usage.admitted_bytes - need),
                sessions=max(0, usage.sessions - 1),
            )
        self._kick_all()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (shutting down): the lease expires with its TTL
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def live_leases(self) -> int:
        return len(self._live)

    async def renew_all(self) -> None:
        """Extends every lease this gateway holds by a TTL."""
        by_worker: dict[str, list[str]] = {}
        for lease in list(self._live.values()):
            by_worker.setdefault(lease.worker, []).append(lease.lease_id)

        async def renew(worker: str, ids: list[str]) -> None:
            try:
                lost = await self.ledger.renew(worker, ids, self.cfg.lease_ttl_s)
            except LedgerUnavailable as e:
                log.warning("could not renew %d leases on %s: %s", len(ids), worker, e)
                return
            for lease_id in lost:
                if self._live.pop(lease_id, None) is not None:
                    log.warning(
                        "lease %s on %s expired while its request runs (renewal came too late)",
                        lease_id,
                        worker,
                    )

        await asyncio.gather(*(renew(w, ids) for w, ids in by_worker.items()))

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_ttl_s / 3)
            try:
                await self.renew_all()
            except Exception:
                log.exception("lease renewal failed")

    # ---- lifecycle and worker updates -------------------------------------------------------
    async def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever(), name="lease-renewer")

    async def observe(self, workers: Sequence[WorkerStatus]) -> None:
        """Registers the healthy workers' capacity (which also reclaims their expired leases),
        releases the leases of workers dead past the grace period, refreshes the gauges and
        lets the queue heads try again."""
        now = time.monotonic()
        healthy = [w for w in workers if w.healthy and w.kv_capacity_bytes > 0]
        for w in healthy:
            self._unhealthy_since.pop(w.address, None)
        results = await asyncio.gather(
            *(
                self.ledger.register(w.address, w.kv_capacity_bytes, w.max_num_seqs)
                for w in healthy
            ),
            return_exceptions=True,
        )
        for w, result in zip(healthy, results, strict=True):
            if isinstance(result, WorkerUsage):
                self._usage[w.address] = result
            else:
                log.warning("could not register worker %s in the ledger: %s", w.address, result)
        down = [w.address for w in workers if not w.healthy]
        for address in down:
            since = self._unhealthy_since.setdefault(address, now)
            if now - since >= self.cfg.worker_dead_after_s:
                await self._release_dead(address)
        with contextlib.suppress(LedgerUnavailable):
            self._usage.update(await self.ledger.usage(down))
        self._export(workers)
        self._kick_all()

    async def _release_dead(self, address: str) -> None:
        try:
            n = await self.ledger.release_dead_worker(address, self.cfg.worker_dead_after_s)
        except LedgerUnavailable as e:
            log.warning("could not release the leases of dead worker %s: %s", address, e)
            return
        if n is None:
            return  # another gateway saw it healthy recently
        for lease_id, lease in list(self._live.items()):
            if lease.worker == address:
                del self._live[lease_id]
        if n:
            log.warning(
                "worker %s unreachable for over %gs: released its %d leases",
                address,
                self.cfg.worker_dead_after_s,
                n,
            )

    def _export(self, workers: Sequence[WorkerStatus]) -> None:
        if self.metrics is None:
            return
        m = self.metrics
        for w in workers:
            usage = self._usage.get(w.address)
            if usage is None:
                continue
            model = self.served_model_name or w.model_name
            m.admitted_sessions.labels(model, w.address).set(usage.sessions)
            m.admitted_bytes.labels(model, w.address).set(usage.admitted_bytes)
            m.free_capacity.labels(model, w.address).set(usage.free_bytes)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        for lease in list(self._live.values()):
            lease.release()
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)
        await self.ledger.close()
