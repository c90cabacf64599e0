"""Repopulation (DESIGN §4): refilling reclaimed optional history when memory is free again.

A bounded round-robin (``policy.RoundRobin``) hands out at most ``populate_pages`` pages per
attempt among the running requests that miss history, that are not being reclaimed, and whose
remaining decode steps pay for the copy (``policy.refill_pays``). A refilled page is PENDING,
invisible to the resolver, until its host-to-device copy completes; then it is published READY
(and backed: its rows came from the host). A page reclaimed or released while its copy was in
flight is never published."""

from __future__ import annotations

from collections.abc import Callable

from services.worker.hierarchy.device_store import DeviceStore
from services.worker.kv.config import ResidencyConfig
from services.worker.kv.reports import ResidencyStats
from services.worker.residency.completions import InFlight
from services.worker.residency.optional_history import (
    OptionalHistory,
    OptPage,
    Owner,
    State,
    page_of_key,
    page_rows,
    publish,
)
from services.worker.residency.policy import RoundRobin, refill_pays


class Repopulation:
    def __init__(
        self,
        store: DeviceStore,
        history: OptionalHistory,
        copies: InFlight[list[OptPage]],
        stats: ResidencyStats,
        cfg: ResidencyConfig,
        topk: int,
    ) -> None:
        self.store = store
        self.history = history
        self.copies = copies
        self.stats = stats
        self.cfg = cfg
        self.topk = topk  # k: rows a decode step selects per source
        self.rr = RoundRobin()
        # () -> {slot: decode steps it may still take}
        self._horizon: Callable[[], dict[int, int]] = dict

    def note_horizons(self, horizons: Callable[[], dict[int, int]]) -> None:
        """``horizons()``: decode steps each running slot may still take (its token budget
        left); called when a refill is considered."""
        self._horizon = horizons

    def pays(self, owner: Owner) -> bool:
        """Whether refilling the request's history pays for its copy (``refill_pays``); a slot
        the scheduler said nothing about is refilled (unknown horizon)."""
        left = self._horizon().get(owner.slot)
        rows = max(owner.imported, default=0)
        return left is None or refill_pays(left, self.topk, rows, self.cfg.populate_payback)

    def populate(self, spare: int) -> None:
        """Queues the refill of at most ``min(populate_pages, spare)`` pages."""
        budget = min(self.cfg.populate_pages, spare)
        if budget <= 0:
            return
        live = {
            o.slot: (oid, o)
            for oid, o in self.history.admitted()
            if o.reclaim_started is None and o.wanted and self.pays(o)
        }
        grant = self.rr.plan({s: len(o.wanted) for s, (_, o) in live.items()}, budget)
        pgs: list[OptPage] = []
        for slot, n in grant.items():
            oid, owner = live[slot]
            todo, owner.wanted = owner.wanted[:n], owner.wanted[n:]
            for key, page in zip(todo, self.store.pages.take(len(todo)), strict=True):
                source, index = page_of_key(key)
                pg = OptPage(oid, slot, source, index, page, State.PENDING, True)
                owner.pages[key] = pg
                pgs.append(pg)
        if not pgs:
            return

        def fill() -> None:  # ordered before readers; the ticket says when it is done
            rows, host = page_rows(self.store, pgs)
            self.store.restore(rows, host)

        self.copies.submit("populate", pgs, fill, overlap=self.cfg.overlap_refills)
        self.stats.refill_pages += len(pgs)

    def populated(self, pgs: list[OptPage], drained: Callable[[list[OptPage]], None]) -> None:
        """Their copies completed: published, except those retired meanwhile, which go to
        ``drained`` (never published, nothing to wait for)."""
        gone = [pg for pg in pgs if pg.retire]
        for pg in gone:
            pg.state = State.DRAINING
        drained(gone)
        ready = [pg for pg in pgs if not pg.retire]
        for pg in ready:
            pg.state = State.READY
        publish(self.store, ready)
        self.stats.repopulated_pages += len(ready)
