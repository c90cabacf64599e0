"""Which worker runs a request, and whether it may run now: pure policy, no I/O.

Two seams:
- ``Router`` ranks healthy workers (least loaded here; prefix- or KV-aware later).
- ``Admission`` decides *when* a request may start and on which worker, and hands out a ``Lease``
  that is released when the request ends. ``ImmediateAdmission`` admits at once through a
  router. The memory-based admission of DESIGN §1 (a Redis or in-process capacity ledger and a
  bounded wait queue ending in 429/503 + Retry-After) implements the same ``Admission``
  protocol: it may wait inside ``acquire`` and raises ``AdmissionRejected`` past its deadline.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WorkerStatus:
    """A snapshot of what the gateway knows about one worker."""

    address: str
    healthy: bool
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    kv_capacity_bytes: int = 0
    kv_free_bytes: int = 0
    in_flight: int = 0  # requests this gateway has open on the worker now
    in_flight_at_poll: int = 0  # ... when num_running/num_waiting were polled

    @property
    def estimated_load(self) -> int:
        """Running + waiting now. The polled count lags by up to a poll interval; what this
        gateway started or finished since the poll corrects it, so a burst of requests
        arriving between two polls does not all land on the same worker."""
        delta = self.in_flight - self.in_flight_at_poll
        return max(0, self.num_running + self.num_waiting + delta)


@dataclass(frozen=True)
class AdmissionJob:
    """What admission may weigh: the request's size in tokens (the capacity model turns it into
    required bytes)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int


class NoWorkerAvailable(Exception):
    """No healthy worker is left to try."""


class AdmissionRejected(Exception):
    """Admission gave up: ``status`` is 429 (saturated) or 503 (waited past the deadline)."""

    def __init__(self, status: int, reason: str, retry_after_s: int | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class Router(Protocol):
    def pick(self, workers: Sequence[WorkerStatus], exclude: Collection[str]) -> str | None:
        """The address of the worker to use among the healthy ones not in ``exclude``, or None
        when there is none."""
        ...


class Lease(Protocol):
    """A right to run one request on ``worker``. ``release`` is idempotent."""

    @property
    def worker(self) -> str: ...

    def release(self) -> None: ...


class Admission(Protocol):
    async def acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease:
        """Waits until ``job`` may run and returns a lease on the worker to run it on.

        ``workers`` returns a fresh snapshot on every call, so an implementation that waits can
        re-read it. Raises ``NoWorkerAvailable`` when no healthy worker outside ``exclude``
        exists, ``AdmissionRejected`` when the job cannot be admitted in time. Cancelling the
        call leaves nothing held.
        """
        ...


class LeastLoadedRouter:
    """The healthy worker with the smallest ``estimated_load``; ties rotate so that an idle
    cluster still spreads requests."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, workers: Sequence[WorkerStatus], exclude: Collection[str]) -> str | None:
        candidates = [w for w in workers if w.healthy and w.address not in exclude]
        if not candidates:
            return None
        turn = next(self._turn)
        n = len(candidates)
        best = min(range(n), key=lambda i: (candidates[i].estimated_load, (i - turn) % n))
        return candidates[best].address


@dataclass
class _PlainLease:
    worker: str

    def release(self) -> None:
        pass


class ImmediateAdmission:
    """Admits every request at once on the worker the router picks."""

    def __init__(self, router: Router | None = None) -> None:
        self.router = router or LeastLoadedRouter()

    async def acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease:
        address = self.router.pick(workers(), exclude)
        if address is None:
            raise NoWorkerAvailable("no healthy worker is available")
        return _PlainLease(address)
