"""How long a request would wait in an admission queue, from the queue's measured service: each
request that runs holds its seat for the measured service time (an average over completed
requests), then the seat takes the next request in line. With ``running`` seats that is
``running / service time`` requests per second, in waves: a request's expected wait is the time
the seat it will take frees up, found by stepping the seats forward (``expected_admissions``).

The policy (``MemoryAdmission``): a request whose expected wait is longer than it may wait is
refused at once, 429 with ``Retry-After`` = that wait rounded up, instead of being held until
its deadline to be told no; one expected within its deadline waits. Until a request has
completed, the service time is unknown and requests wait (their deadline bounds them)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable

from services.gateway.routing import Lease

# Weight of the newest completion in the service time's moving average.
SERVICE_TIME_WEIGHT = 0.2


class ServiceTime:
    """The seconds a request holds its seat, from admission to release: an exponentially
    weighted moving average over completed requests (None before the first)."""

    def __init__(self, weight: float = SERVICE_TIME_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.mean_s: float | None = None

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if self.mean_s is None:
            self.mean_s = seconds
        else:
            self.mean_s += self.weight * (seconds - self.mean_s)


def expected_admissions(ages: Iterable[float], service_s: float, waiting: int) -> list[float]:
    """Seconds from now until each of the first ``waiting`` requests in line is admitted: the
    running requests (``ages``: how long each has held its seat) free their seats
    ``service_s`` after their own admission (at once when already past it), and each freed
    seat takes the next request in line, which holds it ``service_s``. Empty when nothing
    runs (no seat to wait for)."""
    seats = [max(0.0, service_s - age) for age in ages]
    if not seats:
        return []
    heapq.heapify(seats)
    out = []
    for _ in range(waiting):
        free = heapq.heappop(seats)
        out.append(free)
        heapq.heappush(seats, free + service_s)
    return out


def retry_after_s(expected_wait_s: float) -> int:
    """The ``Retry-After`` for a request refused with ``expected_wait_s`` to go: whole
    seconds, rounded up, at least 1."""
    return max(1, math.ceil(expected_wait_s))


class TimedLease:
    """A lease that, released, tells admission how long its request held it."""

    def __init__(self, lease: Lease, on_release: Callable[[], None]) -> None:
        self._lease = lease
        self._on_release: Callable[[], None] | None = on_release

    @property
    def worker(self) -> str:
        return self._lease.worker

    @property
    def rank(self) -> int | None:
        return self._lease.rank

    def settle(self, shared_tokens: int) -> None:
        self._lease.settle(shared_tokens)

    def release(self) -> None:
        if self._on_release is not None:
            on_release, self._on_release = self._on_release, None
            on_release()
        self._lease.release()


class ModelService:
    """One model's measured service: its requests' service time, when each running one was
    admitted, and the seats released and not yet taken again (each free now); the expected
    admission times of its queue, recomputed when they change."""

    REFRESH_S = 0.25  # overdue seats count as freeing now: refresh that now this often

    def __init__(self) -> None:
        self.time = ServiceTime()
        self._running: dict[int, float] = {}  # lease serial -> admitted at (monotonic)
        self._free_seats = 0
        self._serial = 0
        self._version = 0  # bumped by every admission and release
        self._plan: tuple[int, float, list[float]] = (-1, 0.0, [])

    def admitted(self, now: float) -> int:
        """Records an admission (it takes a free seat, if any); its serial for ``released``."""
        self._serial += 1
        self._running[self._serial] = now
        self._free_seats = max(0, self._free_seats - 1)
        self._version += 1
        return self._serial

    def released(self, serial: int, now: float) -> None:
        """Records the end of admission ``serial``: its service time, and a seat free now."""
        admitted = self._running.pop(serial, None)
        if admitted is None:
            return
        self.time.observe(now - admitted)
        self._free_seats += 1
        self._version += 1

    def admission_at(self, position: int, now: float, waiting: int) -> float | None:
        """When the request at ``position`` (1: the head) of a queue of ``waiting`` requests
        is expected to be admitted (monotonic seconds); None while unknown (no completion
        measured, or no seat here). One plan of ``waiting`` entries serves every position."""
        service_s = self.time.mean_s
        if service_s is None or not (self._running or self._free_seats):
            return None
        version, at, plan = self._plan
        if version != self._version or now - at > self.REFRESH_S or len(plan) < position:
            ages = [now - t for t in self._running.values()] + [service_s] * self._free_seats
            waits = expected_admissions(ages, service_s, max(position, waiting))
            plan = [now + w for w in waits]
            self._plan = (self._version, now, plan)
        return plan[position - 1]
