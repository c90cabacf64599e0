"""Reclaim (DESIGN §4, eq. 4): taking whole requests' optional history back for an admission.

The requests to reclaim are chosen by policy (``policy.requests_to_reclaim`` over
``policy.reclaim_order``); this is the mechanism that carries it out. A reclaimed request's pages
retire without ever breaking the residency invariant:

    READY (unbacked) -> BACKING: device->host copy; still published -- completes -> backed
    READY (backed)   -> DRAINING: unpublished; earlier readers      -- completes -> free

A page still PENDING (its refill in flight) retires when its copy completes. A drained page that
was backed up goes back on its request's ``wanted`` list: repopulation may return it later."""

from __future__ import annotations

import time

import torch

from services.worker.hierarchy.device_store import DeviceStore
from services.worker.kv.reports import ResidencyStats
from services.worker.residency.completions import InFlight
from services.worker.residency.optional_history import (
    OptionalHistory,
    OptPage,
    State,
    page_key,
    page_rows,
    publish,
)


class Reclaim:
    def __init__(
        self,
        store: DeviceStore,
        history: OptionalHistory,
        copies: InFlight[list[OptPage]],
        stats: ResidencyStats,
    ) -> None:
        self.store = store
        self.history = history
        self.copies = copies
        self.stats = stats

    def reclaim(self, oid: int) -> None:
        """Starts retiring every optional page of admission ``oid``."""
        owner = self.history.owner(oid)
        self.stats.reclaim_events += 1
        owner.reclaim_started = time.monotonic()
        unbacked, backed = [], []
        for pg in owner.pages.values():
            if pg.retire:
                continue
            pg.retire = True
            if pg.state is State.READY:
                (backed if pg.backed or pg.dead else unbacked).append(pg)
            # PENDING pages retire when their copy completes.
        self._back_up(unbacked)
        self.drain(backed)

    def _back_up(self, pgs: list[OptPage]) -> None:
        """Device -> host copies of READY pages that are not backed yet; they stay published
        until the backup is durable."""
        if not pgs:
            return
        for pg in pgs:
            pg.state = State.BACKING

        def backup() -> None:
            rows, host = page_rows(self.store, pgs)
            self.store.backup(rows, host, torch.ones_like(rows, dtype=torch.bool))

        self.copies.submit("backup", pgs, backup)

    def backed_up(self, pgs: list[OptPage]) -> None:
        """Their backups completed: durable on the host, then drained."""
        p = self.store.page
        for pg in pgs:
            if not pg.dead:
                self.store.host.mark_durable(pg.slot, pg.source, pg.index * p, pg.index * p + p)
            pg.backed = True
        self.drain(pgs)

    def drain(self, pgs: list[OptPage]) -> None:
        """Unpublishes the pages; they are freed once every reader issued before is done."""
        if not pgs:
            return
        # a dead page whose slot holds a newer request is not in that slot's map any more
        visible = [pg for pg in pgs if not pg.dead or self.history.is_current(pg.owner)]
        publish(self.store, visible, hide=True)
        for pg in pgs:
            pg.state = State.DRAINING
        self.copies.submit("drain", pgs, lambda: None)

    def drained(self, pgs: list[OptPage]) -> None:
        """Their readers are done: the pages return to the pool."""
        for pg in pgs:
            owner = self.history.owner(pg.owner)
            del owner.pages[page_key(pg.source, pg.index)]
            self.store.pages.give([pg.page])
            if not pg.dead:  # backed up: the request may get it back when memory frees
                owner.wanted.append(page_key(pg.source, pg.index))
                self.stats.reclaim_pages += 1
                if owner.reclaim_started is not None and not any(
                    q.retire for q in owner.pages.values()
                ):
                    self.stats.reclaim_latency.append(time.monotonic() - owner.reclaim_started)
                    owner.reclaim_started = None
            self.history.forget_if_empty(pg.owner)
