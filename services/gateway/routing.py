"""Which worker runs a request, and whether it may run now: pure policy, no I/O.

Two seams:
- ``Router`` ranks healthy workers (least loaded here; by prefix affinity weighed against load
  in ``affinity``).
- ``Admission`` decides *when* a request may start and on which worker, and hands out a ``Lease``
  that is released when the request ends. ``ImmediateAdmission`` admits at once through a
  router; ``services.gateway.admission.MemoryAdmission`` admits by memory against a capacity
  ledger (DESIGN §1), may wait inside ``acquire`` and raises ``AdmissionRejected`` when it gives
  up (429 queue full, 503 deadline, 400 a request no worker could ever hold).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.gateway.prefix_keys import PromptPrefix


@dataclass(frozen=True)
class WorkerStatus:
    """A snapshot of what the gateway knows about one worker."""

    address: str
    healthy: bool
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    kv_capacity_bytes: int = 0  # admissible KV bytes (pool less fixed allocations)
    kv_free_bytes: int = 0
    in_flight: int = 0  # requests this gateway has open on the worker now
    in_flight_at_poll: int = 0  # ... when num_running/num_waiting were polled
    model_name: str = ""
    mode: str = ""  # resident | hisparse | adaptive
    config_json: str = ""  # the model config, for the capacity model
    kv_layout_json: str = ""  # the worker's KV geometry (dtype, pages, hot cache, tail)
    admitted_bytes: int = 0  # held by leases in the admission ledger (every gateway's)
    serving_ranks: int = 1  # ranks with their own requests and KV pool (data-parallel attention)
    page_size: int = 0  # tokens per KV page (0: not reported)
    prefix_cache: bool = False  # it imports cached prefixes of its node's host store
    kv_store_id: str = ""  # that store ("": none): workers with the same id share its prefixes

    @property
    def request_capacity_bytes(self) -> int:
        """The most KV bytes one request can ever hold here: one serving rank's share of the
        capacity (the whole of it on a one-rank or tensor-parallel worker)."""
        return self.kv_capacity_bytes // max(1, self.serving_ranks)

    @property
    def estimated_load(self) -> int:
        """Running + waiting now. The polled count lags by up to a poll interval; what this
        gateway started or finished since the poll corrects it, so a burst of requests
        arriving between two polls does not all land on the same worker."""
        delta = self.in_flight - self.in_flight_at_poll
        return max(0, self.num_running + self.num_waiting + delta)

    @property
    def admitted_share(self) -> float:
        """The share of the worker's capacity the ledger has handed out (0 without a ledger)."""
        if self.kv_capacity_bytes <= 0:
            return 0.0
        return self.admitted_bytes / self.kv_capacity_bytes


@dataclass(frozen=True)
class AdmissionJob:
    """What admission may weigh: the request's size in tokens (the capacity model turns it into
    required bytes) and the model whose queue it waits in."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    model: str = ""
    prefix: PromptPrefix | None = None  # its prompt, for prefix-affinity routing

    @property
    def context_tokens(self) -> int:
        """The most tokens the session can reach: its KV is reserved for all of them."""
        return self.prompt_tokens + self.max_tokens


class NoWorkerAvailable(Exception):
    """No healthy worker is left to try."""


class AdmissionRejected(Exception):
    """Admission gave up. ``status``: 429 (queue full), 503 (waited past the deadline) or 400
    (no worker could ever hold the request); ``reason`` is a short code for the
    ``x-dhisparse-reason`` header and the rejection metric."""

    def __init__(
        self, status: int, message: str, *, reason: str, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s


class Router(Protocol):
    def rank(
        self,
        workers: Sequence[WorkerStatus],
        exclude: Collection[str],
        job: AdmissionJob | None = None,
    ) -> list[str]:
        """The addresses of the healthy workers not in ``exclude``, best first for ``job``."""

    def pick(
        self,
        workers: Sequence[WorkerStatus],
        exclude: Collection[str],
        job: AdmissionJob | None = None,
    ) -> str | None:
        """The best of ``rank``, or None when there is none."""


class Lease(Protocol):
    """A right to run one request on ``worker`` (on its data-parallel rank ``rank``, when the
    lease holds room on one rank: ``accounts``). ``release`` is idempotent."""

    @property
    def worker(self) -> str: ...

    @property
    def rank(self) -> int | None: ...

    def settle(self, shared_tokens: int) -> None:
        """The worker shares the pages of the prompt's first ``shared_tokens`` tokens with
        other requests: the lease counts the rest of what it expected to share as its own
        (``ledger.Ledger.settle``)."""

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

    async def try_acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease | None:
        """One attempt, no waiting: a lease on a worker outside ``exclude`` with room for
        ``job`` now, or None. For a running session that moves to another worker."""

    async def start(self) -> None:
        """Starts background work (lease renewal); called once the event loop runs."""

    async def observe(self, workers: Sequence[WorkerStatus]) -> None:
        """Called after every poll of the workers (capacity and health may have changed)."""

    async def close(self) -> None:
        """Stops background work and gives back what is still held."""


class RankingRouter(ABC):
    """A ``Router`` whose ``pick`` is the first of its ``rank``."""

    @abstractmethod
    def rank(
        self,
        workers: Sequence[WorkerStatus],
        exclude: Collection[str],
        job: AdmissionJob | None = None,
    ) -> list[str]:
        """The addresses of the healthy workers not in ``exclude``, best first for ``job``."""

    def pick(
        self,
        workers: Sequence[WorkerStatus],
        exclude: Collection[str],
        job: AdmissionJob | None = None,
    ) -> str | None:
        ranked = self.rank(workers, exclude, job)
        return ranked[0] if ranked else None


class LeastLoadedRouter(RankingRouter):
    """Healthy workers by the share of their capacity the ledger has admitted, then by
    ``estimated_load``; ties rotate so that an idle cluster still spreads requests."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(
        self,
        workers: Sequence[WorkerStatus],
        exclude: Collection[str],
        job: AdmissionJob | None = None,
    ) -> list[str]:
        candidates = [w for w in workers if w.healthy and w.address not in exclude]
        turn = next(self._turn)
        n = len(candidates)
        order = sorted(
            range(n),
            key=lambda i: (
                candidates[i].admitted_share,
                candidates[i].estimated_load,
                (i - turn) % n,
            ),
        )
        return [candidates[i].address for i in order]


@dataclass
class _PlainLease:
    worker: str
    rank: int | None = None  # the worker places the request

    def settle(self, shared_tokens: int) -> None:
        pass  # it holds no bytes

    def release(self) -> None:
        pass


class ImmediateAdmission:
    """Admits every request at once on the worker the router picks (no memory accounting)."""

    def __init__(self, router: Router | None = None) -> None:
        self.router = router or LeastLoadedRouter()

    async def acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease:
        address = self.router.pick(workers(), exclude, job)
        if address is None:
            raise NoWorkerAvailable("no healthy worker is available")
        return _PlainLease(address)

    async def try_acquire(
        self,
        job: AdmissionJob,
        workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ) -> Lease | None:
        address = self.router.pick(workers(), exclude)
        return None if address is None else _PlainLease(address)

    async def start(self) -> None:
        pass

    async def observe(self, workers: Sequence[WorkerStatus]) -> None:
        pass

    async def close(self) -> None:
        pass
