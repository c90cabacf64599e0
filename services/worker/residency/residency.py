"""The mechanism of load-adaptive residency (mode ``adaptive``).

*Optional history* is complete pages of a request's imported (prefill) history kept in the
device page pool while memory is spare. A page is visible to the resolver (published in the
slot's optional map) only while its bytes are valid there. Life of a page:

    resident-first (admission):      copied from the prefill pass          -> READY (unbacked)
    repopulation:   PENDING (host->device copy in flight)  -- completes -->   READY (backed)
    reclaim:        READY (unbacked) -> BACKING (device->host copy) -- completes -> backed
                    READY (backed)   -> DRAINING: unpublished; earlier readers -- complete -> free

Invariant (checked by ``check``): every committed row of every admitted request is in its
tail ring, in a published page, or has a durable host copy. Eq. 3: required + optional +
reserve <= the pool, always; optional pages grow only into the room left."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from services.worker.residency.check import check_residency
from services.worker.residency.completions import Completions
from services.worker.residency.optional_history import (
    OptPage,
    Owner,
    ResidencyStats,
    State,
    import_pages,
    page_key,
    page_of_key,
    page_rows,
    publish,
)
from services.worker.residency.policy import (
    Holder,
    RoundRobin,
    reclaim_order,
    refill_pays,
    requests_to_reclaim,
)


class Residency:
    def __init__(
        self,
        payload,  # HierarchyPayload (not imported: it imports us)
        completions: Completions,
        reserve_pages: int,
        populate_pages: int,
        order: str = "largest",
        write_through: bool = False,
        *,
        topk: int,  # k: rows a decode step selects per source
        payback: float,  # see ``refill_pays``
        overlap_refills: bool = False,
    ) -> None:
        self.p = payload
        # Durable sessions: imported history is backed up at once even when kept on the device
        # (a crash would lose a deferred backup), so resident-first pages start out backed.
        self.write_through = write_through
        self.completions = completions
        self.reserve = reserve_pages
        self.populate_pages = populate_pages
        self.order = order
        self.topk, self.payback = topk, payback
        # refill copies beside the decode passes (a side stream) instead of before them
        self.overlap_refills = overlap_refills
        # () -> {slot: decode steps it may still take}
        self._horizon: Callable[[], dict[int, int]] = dict
        self.rr = RoundRobin()
        self.stats = ResidencyStats()
        self._owners: dict[int, Owner] = {}
        self._slot_owner: dict[int, int] = {}
        # ticket -> (what completes, the pages it covers): one ticket per batch of pages
        self._tickets: dict[int, tuple[str, list[OptPage]]] = {}
        self._seq = itertools.count()
        self._waiting = False  # an admission found no room since the last maintain()
        self._queued = 0  # pages the requests the scheduler could not admit will take
        self._warm_copies()

    def _warm_copies(self) -> None:
        """Launches the refill and reclaim copies once now, so that their kernels are built
        before serving: on the H200 a first refill, mid-run, took 0.2 s of host time (its
        kernel variant built) against 0.2 ms after. The refill copy reads the arena's first
        page of rows into a free page (no reader), the backup copies nothing (``keep`` is all
        false); both take the same kind of fresh index tensors as the real ones."""
        p = self.p
        if p.pages.free == 0 or p.host.arena.numel() < p.page * p.store.shape[1]:
            return
        (page,) = p.pages.take(1)
        offs = torch.arange(p.page, device=p.device)
        rows = page * p.page + offs
        host = offs * p.store.shape[1]
        p.restore(p.store, rows, host, p.host.arena)
        p.backup(p.store, rows, host, torch.zeros_like(rows, dtype=torch.bool), p.host.arena)
        p.pages.give([page])

    # ---- accounting (pages; eq. 3) ----------------------------------------------------------
    @property
    def optional_pages(self) -> int:
        return sum(len(o.pages) for o in self._owners.values())

    @property
    def required_pages(self) -> int:
        return self.p.pages.total - self.p.pages.free - self.optional_pages

    @property
    def retiring_pages(self) -> int:
        """Optional pages already on their way back to the pool."""
        return sum(pg.retire for o in self._owners.values() for pg in o.pages.values())

    def holders(self) -> list[Holder]:
        """Admitted requests and the optional pages each could still give back (a_r)."""
        return [
            Holder(o.slot, sum(not pg.retire for pg in o.pages.values()), seq)
            for seq, o in self._owners.items()
            if self._slot_owner.get(o.slot) == seq
        ]

    def room(self) -> int:
        """Pages that required or optional allocations may still take without breaking eq. 3."""
        return self.p.pages.total - self.required_pages - self.optional_pages - self.reserve

    def note_queue(self, pages: int) -> None:
        """Pages the requests still waiting after this step's admissions will take. They are
        spoken for: optional history may only use what is left (it would be reclaimed at
        once, and a reclaim takes a whole request's history)."""
        self._queued = pages

    def note_horizons(self, horizons: Callable[[], dict[int, int]]) -> None:
        """``horizons()``: decode steps each running slot may still take (its token budget
        left); called when a refill is considered."""
        self._horizon = horizons

    def pays(self, owner: Owner) -> bool:
        """Whether refilling the request's history pays for its copy (``refill_pays``); a slot
        the scheduler said nothing about is refilled (unknown horizon)."""
        left = self._horizon().get(owner.slot)
        rows = max(owner.imported, default=0)
        return left is None or refill_pays(left, self.topk, rows, self.payback)

    def spare(self) -> int:
        """Pages optional history may take now: the room less the queue's pages."""
        return self.room() - self._queued

    def settling(self) -> bool:
        """Copies or drains are in flight: pages will come back."""
        return bool(self._tickets)

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
        self.last_reclaim: list[int] | None = []
        if deficit <= 0:
            return False  # enough is already on its way back
        chosen = requests_to_reclaim(reclaim_order(self.holders(), self.order), deficit)
        self.last_reclaim = None if chosen is None else [h.slot for h in chosen]
        for h in chosen or ():
            self._reclaim(self._slot_owner[h.slot])
        return False

    def on_admit(self, slot: int, imported: list[int]) -> None:
        owner = next(self._seq)
        self._owners[owner] = Owner(slot, list(imported))
        self._slot_owner[slot] = owner

    def release(self, slot: int) -> None:
        """The request is gone: its pages are unpublished now and freed once readers finish."""
        owner = self._slot_owner.pop(slot, None)
        if owner is None:
            return
        ready = []
        for pg in self._owners[owner].pages.values():
            pg.retire = pg.dead = True
            if pg.state is State.READY:
                ready.append(pg)
        self._drain(ready)
        self._forget_if_empty(owner)

    # ---- resident-first -------------------------------------------------------------------
    def keep_imported(
        self, slot: int, source: int, lo: int, hi: int, rows_at
    ) -> list[tuple[int, int]]:
        """After a prefill pass wrote rows [lo, hi) of ``source``: keeps its complete pages on
        the device while there is room (their host backup is deferred) and returns the row
        ranges that are *not* kept, which the caller backs up now — all of [lo, hi) with
        ``write_through``. ``rows_at(start, end)`` gives the device locations of rows the
        pass wrote."""
        p = self.p.page
        owner = self._owners[self._slot_owner[slot]]
        owner.imported[source] = max(owner.imported[source], hi)
        first, last = -(-lo // p), hi // p  # the complete pages the pass wrote
        n = 0 if self._waiting else max(0, min(last - first, self.spare()))
        rest: list[tuple[int, int]] = []
        cursor = lo
        if n:  # one copy and one map update for all of them
            pages = self.p.pages.take(n)
            a, b = first * p, (first + n) * p
            if a > lo:
                rest.append((lo, a))
            import_pages(self.p, source, slot, first, pages, rows_at(a, b))
            for j, page in enumerate(pages):
                owner.pages[page_key(source, first + j)] = OptPage(
                    self._slot_owner[slot], slot, source, first + j, page, State.READY,
                    self.write_through,
                )  # fmt: skip
            cursor = b
        if cursor < hi:
            rest.append((cursor, hi))
        for a, b in rest:  # complete pages the caller backs up now: candidates for refill
            owner.wanted.extend(page_key(source, index) for index in range(-(-a // p), b // p))
        return [(lo, hi)] if self.write_through else rest

    # ---- completions, reclaim, repopulation -------------------------------------------------
    def maintain(self) -> None:
        """Between steps: advances pages whose copies completed, then refills optional history
        (bounded, round-robin) if no admission is waiting for room."""
        for ticket in self.completions.done():
            kind, pgs = self._tickets.pop(ticket)
            {"populate": self._populated, "backup": self._backed_up, "drain": self._drained}[kind](
                pgs
            )
        waiting, self._waiting = self._waiting, False
        if not waiting:
            self._populate()

    def _reclaim(self, owner_id: int) -> None:
        owner = self._owners[owner_id]
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
        self._drain(backed)

    def _back_up(self, pgs: list[OptPage]) -> None:
        """Device -> host copies of READY pages that are not backed yet; they stay published
        until the backup is durable."""
        if not pgs:
            return
        for pg in pgs:
            pg.state = State.BACKING

        def backup() -> None:
            rows, host = page_rows(self.p, pgs)
            keep = torch.ones_like(rows, dtype=torch.bool)
            self.p.backup(self.p.store, rows, host, keep, self.p.host.arena)

        self._tickets[self.completions.submit(backup)] = ("backup", pgs)

    def _backed_up(self, pgs: list[OptPage]) -> None:
        p = self.p.page
        for pg in pgs:
            if not pg.dead:
                self.p.host.mark_durable(pg.slot, pg.source, pg.index * p, pg.index * p + p)
            pg.backed = True
        self._drain(pgs)

    def _drain(self, pgs: list[OptPage]) -> None:
        """Unpublishes the pages; they are freed once every reader issued before is done."""
        if not pgs:
            return
        publish(
            self.p,
            [pg for pg in pgs if not pg.dead or self._slot_owner.get(pg.slot) == pg.owner],
            hide=True,
        )
        for pg in pgs:
            pg.state = State.DRAINING
        self._tickets[self.completions.submit(lambda: None)] = ("drain", pgs)

    def _drained(self, pgs: list[OptPage]) -> None:
        for pg in pgs:
            owner = self._owners[pg.owner]
            del owner.pages[page_key(pg.source, pg.index)]
            self.p.pages.give([pg.page])
            if not pg.dead:  # backed up: the request may get it back when memory frees
                owner.wanted.append(page_key(pg.source, pg.index))
                self.stats.reclaim_pages += 1
                if owner.reclaim_started is not None and not any(
                    q.retire for q in owner.pages.values()
                ):
                    self.stats.reclaim_latency.append(time.monotonic() - owner.reclaim_started)
                    owner.reclaim_started = None
            self._forget_if_empty(pg.owner)

    def _populated(self, pgs: list[OptPage]) -> None:
        # reclaimed or released while the copy was in flight: never published
        gone = [pg for pg in pgs if pg.retire]
        for pg in gone:
            pg.state = State.DRAINING
        self._drained(gone)
        ready = [pg for pg in pgs if not pg.retire]
        for pg in ready:
            pg.state = State.READY
        publish(self.p, ready)
        self.stats.repopulated_pages += len(ready)

    def _populate(self) -> None:
        budget = min(self.populate_pages, self.spare())
        if budget <= 0:
            return
        live = {
            o.slot: (oid, o)
            for oid, o in self._owners.items()
            if self._slot_owner.get(o.slot) == oid
            and o.reclaim_started is None
            and o.wanted
            and self.pays(o)
        }
        grant = self.rr.plan({s: len(o.wanted) for s, (_, o) in live.items()}, budget)
        pgs: list[OptPage] = []
        for slot, n in grant.items():
            oid, owner = live[slot]
            todo, owner.wanted = owner.wanted[:n], owner.wanted[n:]
            for key, page in zip(todo, self.p.pages.take(len(todo)), strict=True):
                source, index = page_of_key(key)
                pg = OptPage(oid, slot, source, index, page, State.PENDING, True)
                owner.pages[key] = pg
                pgs.append(pg)
        if not pgs:
            return

        def fill() -> None:  # ordered before readers; the ticket says when it is done
            rows, host = page_rows(self.p, pgs)
            self.p.restore(self.p.store, rows, host, self.p.host.arena)

        self._tickets[self.completions.submit(fill, overlap=self.overlap_refills)] = (
            "populate",
            pgs,
        )
        self.stats.refill_pages += len(pgs)

    def _forget_if_empty(self, owner_id: int) -> None:
        owner = self._owners.get(owner_id)
        if owner is not None and not owner.pages and self._slot_owner.get(owner.slot) != owner_id:
            del self._owners[owner_id]

    # ---- checks ---------------------------------------------------------------------------
    def pages_of(self, slot: int) -> dict[int, OptPage]:
        owner = self._slot_owner.get(slot)
        return {} if owner is None else dict(self._owners[owner].pages)

    def check(self) -> None:
        """Raises AssertionError when eq. 3 or the residency invariant is broken."""
        check_residency(self)
