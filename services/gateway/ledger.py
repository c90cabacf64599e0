"""The capacity ledger: which leases hold how many bytes of which worker's KV capacity.

Invariant (the one admission exists for): for every worker, the bytes of its live leases never
exceed its registered capacity, and their number never exceeds its session limit. Every
operation that could break it is atomic: ``acquire`` checks and records in one step.

A lease lives until it is released or its TTL passes without a renewal; an expired lease is
*reclaimed* (its bytes return) by the next operation that looks at its worker. So a gateway that
dies holding leases leaks nothing for longer than a TTL.

*Shared pages count once.* Requests that seat a cached prefix from a record on their worker's
device share its pages (resident rows and index keys; the hierarchy's index keys). A lease
names those pages as blocks (``SharedBlock``: the gateway's routing key of the page and its
bytes there) and holds the rest of its need privately. A worker's admitted bytes are its
leases' private bytes plus the bytes of every block some live lease names, once: a lease
naming a block that another live lease on the account names already needs nothing for it, and
the block's bytes return when the last lease naming it goes. Once the worker tells how much of
the prompt it really shared, ``settle`` moves the blocks it did not share into the lease's
private bytes, so the ledger counts what the device holds.

Two implementations: ``LocalLedger`` (this module) for a single gateway replica, and
``services.gateway.redis_ledger.RedisLedger`` shared by any number of replicas.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class LedgerUnavailable(Exception):
    """The ledger could not be reached (Redis down or too slow)."""


@dataclass(frozen=True)
class WorkerUsage:
    """One worker in the ledger. ``max_sessions`` 0 means no session limit; ``shared_bytes``:
    of ``admitted_bytes``, the shared blocks' (each counted once)."""

    capacity_bytes: int
    max_sessions: int
    admitted_bytes: int
    sessions: int
    shared_bytes: int = 0

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.admitted_bytes)


@dataclass(frozen=True)
class SharedBlock:
    """A leading page of a prompt that its worker holds once for every request sharing it:
    ``key`` names the page (equal keys, equal tokens from the first one on)
    and ``bytes`` is what it occupies on the worker."""

    key: str
    bytes: int

    def __post_init__(self) -> None:
        if not self.key or "," in self.key or ":" in self.key or "|" in self.key:
            raise ValueError(f"a shared block's key must be non-empty, without ',:|': {self.key!r}")
        if self.bytes < 0:
            raise ValueError(f"a shared block's bytes must be >= 0, got {self.bytes}")


@dataclass(frozen=True)
class Candidate:
    """A worker admission would use, and what the request needs there (workers may differ in
    model config and serving mode, hence in bytes per session): ``need_bytes`` in all, of which
    ``shared`` (distinct keys, their bytes within ``need_bytes``) are pages it expects to share
    with other requests there. Consecutive candidates of one non-empty ``group`` are one
    choice (the ranks of a data-parallel worker, ``accounts``): the ledger takes the one of
    them with room whose capacity is least admitted."""

    worker: str
    need_bytes: int
    group: str = ""
    shared: tuple[SharedBlock, ...] = ()

    def __post_init__(self) -> None:
        if len({b.key for b in self.shared}) != len(self.shared):
            raise ValueError("a candidate's shared blocks must have distinct keys")
        if self.private_bytes < 0:
            raise ValueError(f"shared blocks of {self.worker} exceed its need")

    @property
    def private_bytes(self) -> int:
        """What the lease holds alone: its need less its shared blocks."""
        return self.need_bytes - sum(b.bytes for b in self.shared)


@dataclass(frozen=True)
class Admitted:
    worker: str
    usage: WorkerUsage  # the worker right after the lease was recorded


def groups(candidates: Sequence[Candidate]) -> list[list[Candidate]]:
    """``candidates`` as the choices ``acquire`` tries in order: each run of one non-empty
    ``group``, every other candidate alone."""
    out: list[list[Candidate]] = []
    for c in candidates:
        if out and c.group and out[-1][-1].group == c.group:
            out[-1].append(c)
        else:
            out.append([c])
    return out


class Ledger(Protocol):
    async def register(self, worker: str, capacity_bytes: int, max_sessions: int) -> WorkerUsage:
        """Records the worker's capacity and that a gateway saw it healthy now; reclaims its
        expired leases. Returns its usage afterwards."""

    async def acquire(
        self, lease_id: str, candidates: Sequence[Candidate], ttl_s: float
    ) -> Admitted | None:
        """Records lease ``lease_id`` on the first candidate, in the given order, with room for
        it (``admitted + need <= capacity`` and ``sessions < max_sessions``), after reclaiming
        that worker's expired leases; None when none has room. Within a ``group`` of
        consecutive candidates, the one with room whose admitted share of its capacity is
        least (ties: the first). A candidate's room counts its ``shared`` blocks that some
        live lease on that worker names already as free (module docstring). Atomic: no other
        operation sees a state between the check and the record. Unregistered workers have no
        room."""

    async def settle(self, worker: str, lease_id: str, kept: int) -> bool:
        """The lease keeps naming its first ``kept`` shared blocks; the bytes of the others
        become its own (its worker did not share them). False when it is not held."""

    async def renew(self, worker: str, lease_ids: Sequence[str], ttl_s: float) -> list[str]:
        """Extends the leases to now + ``ttl_s``; returns the ids that are no longer held
        (released, or reclaimed after expiring)."""

    async def release(self, worker: str, lease_id: str) -> bool:
        """Gives the lease's bytes back; idempotent (False when it was not held)."""

    async def release_dead_worker(self, worker: str, dead_after_s: float) -> int | None:
        """Releases every lease on ``worker`` if no gateway registered it (saw it healthy)
        within ``dead_after_s``; returns how many, or None when it was seen too recently."""

    async def usage(self, workers: Sequence[str]) -> dict[str, WorkerUsage]:
        """The registered ones among ``workers`` (expired leases may still be counted until
        their worker's next ``register`` or ``acquire``)."""

    async def close(self) -> None: ...


@dataclass
class _Held:
    private: int  # bytes held alone
    expiry: float
    blocks: tuple[SharedBlock, ...]  # the shared blocks it names


@dataclass
class _LocalWorker:
    capacity_bytes: int = 0
    max_sessions: int = 0
    seen: float = 0.0
    admitted_bytes: int = 0
    shared_bytes: int = 0  # of admitted_bytes, the named blocks'
    leases: dict[str, _Held] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # key -> [leases naming, bytes]

    def usage(self) -> WorkerUsage:
        return WorkerUsage(
            self.capacity_bytes, self.max_sessions, self.admitted_bytes, len(self.leases),
            self.shared_bytes,
        )  # fmt: skip

    def reclaim(self, now: float) -> None:
        for lease_id, held in list(self.leases.items()):
            if held.expiry <= now:
                self.drop(lease_id)

    @property
    def admitted_share(self) -> float:
        return self.admitted_bytes / self.capacity_bytes if self.capacity_bytes > 0 else 0.0

    def extra(self, c: Candidate) -> int:
        """Bytes admitting ``c`` adds: its private bytes and its blocks no lease names yet."""
        return c.private_bytes + sum(b.bytes for b in c.shared if b.key not in self.blocks)

    def has_room(self, c: Candidate) -> bool:
        if self.admitted_bytes + self.extra(c) > self.capacity_bytes:
            return False
        return self.max_sessions <= 0 or len(self.leases) < self.max_sessions

    def hold(self, lease_id: str, c: Candidate, expiry: float) -> None:
        self.admitted_bytes += c.private_bytes
        for b in c.shared:
            entry = self.blocks.setdefault(b.key, [0, b.bytes])
            if entry[0] == 0:
                self.admitted_bytes += b.bytes
                self.shared_bytes += b.bytes
            entry[0] += 1
        self.leases[lease_id] = _Held(c.private_bytes, expiry, c.shared)

    def let_go(self, blocks: Sequence[SharedBlock]) -> None:
        """The blocks lose a lease naming them; those no lease names any more free their
        bytes."""
        for b in blocks:
            entry = self.blocks[b.key]
            entry[0] -= 1
            if entry[0] == 0:
                self.admitted_bytes -= entry[1]
                self.shared_bytes -= entry[1]
                del self.blocks[b.key]

    def drop(self, lease_id: str) -> bool:
        held = self.leases.pop(lease_id, None)
        if held is None:
            return False
        self.admitted_bytes -= held.private
        self.let_go(held.blocks)
        return True

    def settle(self, lease_id: str, kept: int) -> bool:
        held = self.leases.get(lease_id)
        if held is None:
            return False
        moved = held.blocks[max(0, kept) :]
        own = sum(b.bytes for b in moved)
        held.private += own
        held.blocks = held.blocks[: max(0, kept)]
        self.admitted_bytes += own
        self.let_go(moved)
        return True


class LocalLedger:
    """The ledger in this process (one gateway replica). Methods are async for the interface's
    sake; each runs under a lock without awaiting, so it is atomic for coroutines and threads
    alike. ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _LocalWorker] = {}

    async def register(self, worker: str, capacity_bytes: int, max_sessions: int) -> WorkerUsage:
        with self._lock:
            w = self._workers.setdefault(worker, _LocalWorker())
            w.capacity_bytes, w.max_sessions = capacity_bytes, max_sessions
            w.seen = now = self._clock()
            w.reclaim(now)
            return w.usage()

    async def acquire(
        self, lease_id: str, candidates: Sequence[Candidate], ttl_s: float
    ) -> Admitted | None:
        with self._lock:
            now = self._clock()
            for group in groups(candidates):
                roomy = []
                for c in group:
                    w = self._workers.get(c.worker)
                    if w is None:
                        continue
                    w.reclaim(now)
                    if w.has_room(c):
                        roomy.append((w.admitted_share, c, w))
                if roomy:
                    _, c, w = min(roomy, key=lambda x: x[0])  # the first of the least
                    w.hold(lease_id, c, now + ttl_s)
                    return Admitted(c.worker, w.usage())
            return None

    async def renew(self, worker: str, lease_ids: Sequence[str], ttl_s: float) -> list[str]:
        with self._lock:
            w = self._workers.get(worker)
            if w is None:
                return list(lease_ids)
            expiry = self._clock() + ttl_s
            lost = []
            for lease_id in lease_ids:
                held = w.leases.get(lease_id)
                if held is None:
                    lost.append(lease_id)
                else:
                    held.expiry = expiry
            return lost

    async def release(self, worker: str, lease_id: str) -> bool:
        with self._lock:
            w = self._workers.get(worker)
            return w is not None and w.drop(lease_id)

    async def settle(self, worker: str, lease_id: str, kept: int) -> bool:
        with self._lock:
            w = self._workers.get(worker)
            return w is not None and w.settle(lease_id, kept)

    async def release_dead_worker(self, worker: str, dead_after_s: float) -> int | None:
        with self._lock:
            w = self._workers.get(worker)
            if w is None:
                return 0
            if self._clock() - w.seen <= dead_after_s:
                return None
            n = len(w.leases)
            w.leases.clear()
            w.blocks.clear()
            w.admitted_bytes = w.shared_bytes = 0
            return n

    async def usage(self, workers: Sequence[str]) -> dict[str, WorkerUsage]:
        with self._lock:
            return {a: self._workers[a].usage() for a in workers if a in self._workers}

    async def close(self) -> None:
        pass
