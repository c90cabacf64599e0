"""Load-adaptive residency (mode ``adaptive``): optional history within eq. 3.

*Optional history* is complete pages of a request's imported (prefill) history kept in the
device page pool while memory is spare (``optional_history.py``). A page is visible to the
resolver (published in the slot's optional map) only while its bytes are valid there. Its life:

    resident-first (admission):      copied from the prefill pass          -> READY (unbacked)
    repopulation:   PENDING (host->device copy in flight)  -- completes -->   READY (backed)
    reclaim:        READY (unbacked) -> BACKING (device->host copy) -- completes -> backed
                    READY (backed)   -> DRAINING: unpublished; earlier readers -- complete -> free

This module admits (resident-first, and eq. 4's reclaim when an admission is short: ``reclaim``),
refills between steps (``repopulation``) and keeps the accounts. Invariant (``check``): every
committed row of every admitted request is in its tail ring, in a published page, or has a
durable host copy. Eq. 3: required + optional + reserve <= the pool, always; optional pages grow
only into the room left."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.hierarchy.device_store import DeviceStore
from services.worker.kv.config import ResidencyConfig
from services.worker.kv.reports import ResidencyStats
from services.worker.residency.check import check_residency
from services.worker.residency.completions import Completions, InFlight
from services.worker.residency.optional_history import (
    OptionalHistory,
    OptPage,
    State,
    import_pages,
    page_key,
)
from services.worker.residency.policy import Holder, reclaim_order, requests_to_reclaim
from services.worker.residency.reclaim import Reclaim
from services.worker.residency.repopulation import Repopulation


class Residency:
    def __init__(
        self,
        store: DeviceStore,
        completions: Completions,
        cfg: ResidencyConfig,
        *,
        topk: int,  # k: rows a decode step selects per source
        write_through: bool = False,
    ) -> None:
        self.store = store
        self.cfg = cfg
        # Durable sessions: imported history is backed up at once even when kept on the device
        # (a crash would lose a deferred backup), so resident-first pages start out backed.
        self.write_through = write_through
        self.stats = ResidencyStats()
        self.history = OptionalHistory()
        # one ticket per batch of pages: what completes, and the pages it covers
        self.copies: InFlight[list[OptPage]] = InFlight(completions)
        self.reclaims = Reclaim(store, self.history, self.copies, self.stats)
        self.refills = Repopulation(store, self.history, self.copies, self.stats, cfg, topk)
        self.last_reclaim: list[int] | None = []  # slots the last short admission reclaimed
        self._waiting = False  # an admission found no room since the last maintain()
        self._queued = 0  # pages the requests the scheduler could not admit will take
        self.warm_copies()

    def warm_copies(self) -> None:
        """Launches the refill and reclaim copies once, so that their kernels are built before
        serving rather than in the step of a first refill. The refill copy reads the arena's
        first page of rows into a free page (no reader), the backup copies nothing (``keep`` is
        all false); both take the same kind of fresh index tensors as the real ones."""
        st = self.store
        if st.pages.free == 0 or st.host.arena.numel() < st.page * st.row_elems:
            return
        (page,) = st.pages.take(1)
        offs = torch.arange(st.page, device=st.device)
        rows = page * st.page + offs
        host = offs * st.row_elems
        st.restore(rows, host)
        st.backup(rows, host, torch.zeros_like(rows, dtype=torch.bool))
        st.pages.give([page])

    # ---- accounting (pages; eq. 3) ----------------------------------------------------------
    @property
    def reserve(self) -> int:
        return self.cfg.reserve_pages

    @property
    def optional_pages(self) -> int:
        return self.history.optional_pages

    @property
    def required_pages(self) -> int:
        """Pages admitted requests hold (hot caches, tails, index keys): neither optional
        history nor pages only cached index keys hold, which any take reclaims at once
        (``serving.key_records``)."""
        return self.store.pages.total - self.store.pages.available - self.optional_pages

    @property
    def retiring_pages(self) -> int:
        """Optional pages already on their way back to the pool."""
        return self.history.retiring_pages

    def holders(self) -> list[Holder]:
        """Admitted requests and the optional pages each could still give back (a_r)."""
        return [
            Holder(o.slot, sum(not pg.retire for pg in o.pages.values()), oid)
            for oid, o in self.history.admitted()
        ]

    def room(self) -> int:
        """Pages that required or optional allocations may still take without breaking eq. 3."""
        return self.store.pages.total - self.required_pages - self.optional_pages - self.reserve

    def note_queue(self, pages: int) -> None:
        """Pages the requests still waiting after this step's admissions will take. They are
        spoken for: optional history may only use what is left (it would be reclaimed at
        once, and a reclaim takes a whole request's history)."""
        self._queued = pages

    def note_horizons(self, horizons: Callable[[], dict[int, int]]) -> None:
        """``horizons()``: decode steps each running slot may still take (its token budget
        left); called when a refill is considered."""
        self.refills.note_horizons(horizons)

    def spare(self) -> int:
        """Pages optional history may take now: the room less the queue's pages."""
        return self.room() - self._queued

    def settling(self) -> bool:
        """Copies or drains are in flight: pages will come back."""
        return bool(self.copies)

    # ---- admission ------------------------------------------------------------------------
    def make_room(self, need: int) -> bool:
        """True when ``need`` pages fit now. Otherwise starts reclaiming whole requests (eq. 4)
        for the deficit, unless optional pages cannot cover it, and returns False: the
        admission waits and tries again."""
        room = self.room()
        if need <= room:
            return True
        self._waiting = True
        self.stats.admissions_waited += 1
        deficit = need - room - self.retiring_pages
        self.last_reclaim = []
        if deficit <= 0:
            return False  # enough is already on its way back
        chosen = requests_to_reclaim(reclaim_order(self.holders(), self.cfg.reclaim_order), deficit)
        self.last_reclaim = None if chosen is None else [h.slot for h in chosen]
        for h in chosen or ():
            self.reclaims.reclaim(self.history.current_id(h.slot))
        return False

    def on_admit(self, slot: int, committed: list[int]) -> None:
        """A request seated in ``slot`` with ``committed`` rows per source already durable on
        the host (none for a new admission; an adopted session's history, or a cached prefix
        it imported): their complete pages are wanted, refilled while memory is spare as a
        prefill's unkept pages are (``repopulation``); the page a request's next rows go to is
        its tail ring's, and the prefill that completes it makes it wanted."""
        oid = self.history.admit(slot, committed)
        owner, p = self.history.owner(oid), self.store.page
        for source, rows in enumerate(committed):
            owner.wanted.extend(page_key(source, index) for index in range(rows // p))

    def release(self, slot: int) -> None:
        """The request is gone: its pages are unpublished now and freed once readers finish."""
        oid = self.history.end(slot)
        if oid is None:
            return
        ready = []
        for pg in self.history.owner(oid).pages.values():
            pg.retire = pg.dead = True
            if pg.state is State.READY:
                ready.append(pg)
        self.reclaims.drain(ready)
        self.history.forget_if_empty(oid)

    # ---- resident-first -------------------------------------------------------------------
    def keep_imported(
        self, slot: int, source: int, lo: int, hi: int, rows_at: Callable[[int, int], torch.Tensor]
    ) -> list[tuple[int, int]]:
        """After a prefill pass wrote rows [lo, hi) of ``source`` (rows below lo: its earlier
        chunks, committed): keeps the complete pages within [lo, hi) on the device while there
        is room (their host backup is deferred) and returns the row ranges that are *not* kept,
        which the caller backs up now — all of [lo, hi) with ``write_through``.
        ``rows_at(start, end)`` gives the device locations of rows the pass wrote."""
        p = self.store.page
        oid = self.history.current_id(slot)
        owner = self.history.owner(oid)
        owner.imported[source] = max(owner.imported[source], hi)
        first, last = -(-lo // p), hi // p  # the complete pages the pass wrote
        n = 0 if self._waiting else max(0, min(last - first, self.spare()))
        rest: list[tuple[int, int]] = []
        cursor = lo
        if n:  # one copy and one map update for all of them
            pages = self.store.pages.take(n)
            a, b = first * p, (first + n) * p
            if a > lo:
                rest.append((lo, a))
            import_pages(self.store, source, slot, first, pages, rows_at(a, b))
            for j, page in enumerate(pages):
                owner.pages[page_key(source, first + j)] = OptPage(
                    oid, slot, source, first + j, page, State.READY, self.write_through
                )
            cursor = b
        if cursor < hi:
            rest.append((cursor, hi))
        # Complete pages the caller backs up now are candidates for refill: with a page an
        # earlier chunk of this prefill began (its rows are backed up), and which this one
        # completes.
        for a, b in rest:
            owner.wanted.extend(page_key(source, index) for index in range(a // p, b // p))
        return [(lo, hi)] if self.write_through else rest

    # ---- between steps ----------------------------------------------------------------------
    def maintain(self) -> None:
        """Between steps: advances pages whose copies completed, then refills optional history
        (bounded, round-robin) if no admission is waiting for room."""
        for kind, pgs in self.copies.done():
            if kind == "populate":
                self.refills.populated(pgs, self.reclaims.drained)
            elif kind == "backup":
                self.reclaims.backed_up(pgs)
            else:
                self.reclaims.drained(pgs)
        waiting, self._waiting = self._waiting, False
        if not waiting:
            self.refills.populate(self.spare())

    # ---- checks ---------------------------------------------------------------------------
    def pages_of(self, slot: int) -> dict[int, OptPage]:
        return self.history.pages_of(slot)

    def check(self) -> None:
        """Raises AssertionError when eq. 3 or the residency invariant is broken."""
        check_residency(self.store, self.history, self.reserve)
