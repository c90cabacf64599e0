"""This gateway's side of the capacity ledger: the leases it holds (renewed every TTL/3 while
their requests run, released when they end), the workers' capacity it registers on every poll
(per account: a whole worker, or each rank of a data-parallel group, ``accounts``), the leases
of dead workers it releases, and the per-worker gauges.

A lease that this gateway fails to release or renew is never lost for good: it expires with
its TTL and the next poll of any gateway reclaims it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.gateway.accounts import Account, accounts
from services.gateway.ledger import (
    Admitted,
    Candidate,
    Ledger,
    LedgerUnavailable,
    SharedBlock,
    WorkerUsage,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import WorkerStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedLead:
    """The leading pages a request expects to share on one worker (``ledger.SharedBlock``, in
    order), each ``page_tokens`` tokens of its prompt."""

    blocks: tuple[SharedBlock, ...] = ()
    page_tokens: int = 0

    def within(self, tokens: int) -> int:
        """How many of the blocks lie within the prompt's first ``tokens`` tokens."""
        kept = tokens // self.page_tokens if self.page_tokens > 0 else 0
        return min(kept, len(self.blocks))


@dataclass(frozen=True)
class Offer:
    """An account admission would use: the bytes the request needs there, of which ``shared``
    are pages it expects to share."""

    account: Account
    need_bytes: int
    shared: SharedLead = SharedLead()


class LedgerLease:
    """A lease in the ledger on one account; ``settle`` and ``release`` return at once (the
    ledger writes run in the background); ``release`` is idempotent."""

    def __init__(self, keeper: LeaseKeeper, offer: Offer, lease_id: str) -> None:
        self._keeper = keeper
        self.account = offer.account
        self.lease_id = lease_id
        self.need_bytes = offer.need_bytes
        self.shared = offer.shared

    @property
    def worker(self) -> str:
        return self.account.worker

    @property
    def rank(self) -> int | None:
        """The data-parallel rank whose share the lease holds (None: the whole worker)."""
        return self.account.rank

    @property
    def key(self) -> str:
        return self.account.key

    def settle(self, shared_tokens: int) -> None:
        """Keeps the blocks within the first ``shared_tokens`` tokens; once (later calls, and
        a lease that named none, change nothing)."""
        kept = self.shared.within(shared_tokens)
        if kept < len(self.shared.blocks):
            self.shared = replace(self.shared, blocks=self.shared.blocks[:kept])
            self._keeper.settle(self, kept)

    def release(self) -> None:
        self._keeper.release(self)


class LeaseKeeper:
    def __init__(
        self,
        ledger: Ledger,
        *,
        lease_ttl_s: float,
        worker_dead_after_s: float,
        on_release: Callable[[], None] = lambda: None,
        metrics: GatewayMetrics | None = None,
        served_model_name: str | None = None,
    ) -> None:
        self.ledger = ledger
        self.lease_ttl_s = lease_ttl_s
        self.worker_dead_after_s = worker_dead_after_s
        self.on_release = on_release  # capacity came back: waiters may try again
        self.metrics = metrics
        self.served_model_name = served_model_name
        self._live: dict[str, LedgerLease] = {}  # by lease id
        self._usage: dict[str, WorkerUsage] = {}  # the ledger's view by account, as last seen
        self._accounts: dict[str, list[Account]] = {}  # by worker, as it last reported
        self._unhealthy_since: dict[str, float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None

    @property
    def live_leases(self) -> int:
        return len(self._live)

    def accounts(self, worker: str) -> list[Account]:
        """``worker``'s accounts as it last reported them (healthy); none before."""
        return self._accounts.get(worker, [])

    def usage(self, worker: str) -> WorkerUsage | None:
        """The ledger's view of ``worker``: the sum over its accounts (None: none seen)."""
        seen = [u for a in self.accounts(worker) if (u := self._usage.get(a.key)) is not None]
        if not seen:
            return self._usage.get(worker)
        return WorkerUsage(
            sum(u.capacity_bytes for u in seen), sum(u.max_sessions for u in seen),
            sum(u.admitted_bytes for u in seen), sum(u.sessions for u in seen),
            sum(u.shared_bytes for u in seen),
        )  # fmt: skip

    # ---- acquire and release ----------------------------------------------------------------
    async def acquire(self, lease_id: str, offers: Sequence[Offer]) -> LedgerLease | None:
        """A lease on the first of ``offers``, in order, with room: the ledger's ``acquire``,
        shielded: if the caller is cancelled after the ledger recorded the lease, the lease is
        released rather than left to its TTL. Raises ``LedgerUnavailable``."""
        by_key = {o.account.key: o for o in offers}
        # a worker's ranks are one choice: the ledger takes the least admitted with room
        ledger_candidates = [
            Candidate(
                o.account.key, o.need_bytes, "" if o.account.rank is None else o.account.worker,
                o.shared.blocks,
            )
            for o in offers
        ]  # fmt: skip
        task = asyncio.ensure_future(
            self.ledger.acquire(lease_id, ledger_candidates, self.lease_ttl_s)
        )
        try:
            admitted = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._undo(lease_id))
            raise
        if admitted is None:
            return None
        self._usage[admitted.worker] = admitted.usage
        lease = LedgerLease(self, by_key[admitted.worker], lease_id)
        self._live[lease_id] = lease
        return lease

    def _undo(self, lease_id: str) -> Callable[[asyncio.Future[Admitted | None]], None]:
        def undo(task: asyncio.Future[Admitted | None]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            admitted = task.result()
            if admitted is not None:
                self._spawn(self._release_in_ledger(admitted.worker, lease_id, 0))

        return undo

    def settle(self, lease: LedgerLease, kept: int) -> None:
        if lease.lease_id in self._live:
            self._spawn(self._settle_in_ledger(lease.key, lease.lease_id, kept))

    async def _settle_in_ledger(self, key: str, lease_id: str, kept: int) -> None:
        try:
            await self.ledger.settle(key, lease_id, kept)
        except LedgerUnavailable as e:
            log.warning("lease %s on %s not settled (%s): it counts as shared", lease_id, key, e)

    def release(self, lease: LedgerLease) -> None:
        if self._live.pop(lease.lease_id, None) is None:
            return
        self._spawn(self._release_in_ledger(lease.key, lease.lease_id, lease.need_bytes))

    async def _release_in_ledger(self, key: str, lease_id: str, need: int) -> None:
        """Releases ``lease_id`` on account ``key``."""
        try:
            await self.ledger.release(key, lease_id)
        except LedgerUnavailable as e:
            log.warning(
                "lease %s on %s not released (%s): it expires with its TTL", lease_id, key, e
            )
            return
        usage = self._usage.get(key)
        if usage is not None:
            self._usage[key] = replace(
                usage,
                admitted_bytes=max(0, usage.admitted_bytes - need),
                sessions=max(0, usage.sessions - 1),
            )
        self.on_release()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (shutting down): the lease expires with its TTL
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- renewal ----------------------------------------------------------------------------
    async def renew_all(self) -> None:
        """Extends every lease this gateway holds by a TTL."""
        by_worker: dict[str, list[str]] = {}  # by account
        for lease in list(self._live.values()):
            by_worker.setdefault(lease.key, []).append(lease.lease_id)

        async def renew(worker: str, ids: list[str]) -> None:
            try:
                lost = await self.ledger.renew(worker, ids, self.lease_ttl_s)
            except LedgerUnavailable as e:
                log.warning("could not renew %d leases on %s: %s", len(ids), worker, e)
                return
            for lease_id in lost:
                if self._live.pop(lease_id, None) is not None:
                    log.warning(
                        "lease %s on %s expired while its request runs (renewed too late)",
                        lease_id,
                        worker,
                    )

        await asyncio.gather(*(renew(w, ids) for w, ids in by_worker.items()))

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                await self.renew_all()
            except Exception:
                log.exception("lease renewal failed")

    # ---- workers ----------------------------------------------------------------------------
    async def observe(self, workers: Sequence[WorkerStatus]) -> None:
        """Registers the healthy workers' accounts (which also reclaims their expired leases),
        releases the leases of workers dead past the grace period and refreshes the gauges."""
        now = time.monotonic()
        healthy = [w for w in workers if w.healthy and w.kv_capacity_bytes > 0]
        for w in healthy:
            self._unhealthy_since.pop(w.address, None)
            self._accounts[w.address] = accounts(w)
        registered = [a for w in healthy for a in self._accounts[w.address]]
        results = await asyncio.gather(
            *(self.ledger.register(a.key, a.capacity_bytes, a.max_sessions) for a in registered),
            return_exceptions=True,
        )
        for a, result in zip(registered, results, strict=True):
            if isinstance(result, WorkerUsage):
                self._usage[a.key] = result
            else:
                log.warning("could not register %s in the ledger: %s", a.key, result)
        down = [w.address for w in workers if not w.healthy]
        for address in down:
            since = self._unhealthy_since.setdefault(address, now)
            if now - since >= self.worker_dead_after_s:
                await self._release_dead(address)
        with contextlib.suppress(LedgerUnavailable):
            self._usage.update(await self.ledger.usage([k for a in down for k in self._keys(a)]))
        self._export(workers)

    def _keys(self, worker: str) -> list[str]:
        """``worker``'s account keys (its address before it reported any)."""
        return [a.key for a in self.accounts(worker)] or [worker]

    async def _release_dead(self, address: str) -> None:
        n = 0
        for key in self._keys(address):  # registered together: all seen at the same poll
            try:
                released = await self.ledger.release_dead_worker(key, self.worker_dead_after_s)
            except LedgerUnavailable as e:
                log.warning("could not release the leases of dead worker %s: %s", key, e)
                return
            if released is None:
                return  # another gateway saw it healthy recently
            n += released
        for lease_id, lease in list(self._live.items()):
            if lease.worker == address:
                del self._live[lease_id]
        if n:
            log.warning(
                "worker %s unreachable for over %gs: released its %d leases",
                address,
                self.worker_dead_after_s,
                n,
            )

    def _export(self, workers: Sequence[WorkerStatus]) -> None:
        if self.metrics is None:
            return
        m = self.metrics
        for w in workers:
            usage = self.usage(w.address)
            if usage is None:
                continue
            model = self.served_model_name or w.model_name
            m.admitted_sessions.labels(model, w.address).set(usage.sessions)
            m.admitted_bytes.labels(model, w.address).set(usage.admitted_bytes)
            m.admitted_shared_bytes.labels(model, w.address).set(usage.shared_bytes)
            m.free_capacity.labels(model, w.address).set(usage.free_bytes)

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever(), name="lease-renewer")

    async def close(self) -> None:
        """Stops renewing, releases what is still held and closes the ledger."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        for lease in list(self._live.values()):
            lease.release()
        await self.flush()
        await self.ledger.close()

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Waits (up to ``timeout_s``) for the ledger writes under way: releases and settles."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
