"""Optional history (DESIGN §4): complete pages of a request's imported history kept in the device
page pool while memory is spare.

The records: a page's life (``State``), the page itself, the admission that owns pages
(``Owner``) and the residency statistics the metrics read; then the tensors behind a page's
moves: where its rows live and publishing it in its slot's optional map. Every move handles a
batch of pages in one copy (one launch, one completion ticket) and one map write per source."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from services.worker.hierarchy.device_store import DeviceStore
from services.worker.transfers import to_device


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    BACKING = "backing"
    DRAINING = "draining"


@dataclass(eq=False, slots=True)  # slots: one object for the collector to track, not two
class OptPage:
    owner: int  # the admission that holds it
    slot: int
    source: int
    index: int  # history page number: rows [index * p, (index + 1) * p)
    page: int  # physical page in the pool
    state: State
    backed: bool  # its rows have durable host copies
    retire: bool = False  # free it as soon as its state allows
    dead: bool = False  # its request is gone: no backup needed


@dataclass
class Owner:
    slot: int
    imported: list[int]  # imported (prefill) rows per source
    pages: dict[int, OptPage] = field(default_factory=dict)  # by ``page_key``
    # Host-backed imported pages not on the device, to refill in order (``page_key``s).
    wanted: list[int] = field(default_factory=list)
    reclaim_started: float | None = None


def page_key(source: int, index: int) -> int:
    """A history page as one int (the keys of ``Owner.pages``, the entries of ``wanted``).
    ``wanted`` lists every host-backed page of every admission, tens of thousands at high
    concurrency: as ints they are objects the garbage collector does not track, where
    (source, page) tuples would lengthen every full collection."""
    return source << 32 | index


def page_of_key(key: int) -> tuple[int, int]:
    """(source, page) of a ``page_key``."""
    return key >> 32, key & 0xFFFFFFFF


class OptionalHistory:
    """Who holds which optional pages: one ``Owner`` per admission (an id that outlives its
    slot's reuse, so a page still draining after its request ended is never mistaken for the
    slot's next request's), and each slot's current admission."""

    def __init__(self) -> None:
        self._owners: dict[int, Owner] = {}
        self._current: dict[int, int] = {}  # slot -> its current admission's owner id
        self._seq = itertools.count()

    def admit(self, slot: int, imported: list[int]) -> int:
        """A new admission in ``slot`` with ``imported`` rows per source; its owner id."""
        oid = next(self._seq)
        self._owners[oid] = Owner(slot, list(imported))
        self._current[slot] = oid
        return oid

    def end(self, slot: int) -> int | None:
        """The slot's admission ended (its pages may still be draining); its owner id."""
        return self._current.pop(slot, None)

    def owner(self, oid: int) -> Owner:
        return self._owners[oid]

    def current_id(self, slot: int) -> int:
        return self._current[slot]

    def is_current(self, oid: int) -> bool:
        """Whether ``oid`` is still its slot's admission (its request runs)."""
        owner = self._owners.get(oid)
        return owner is not None and self._current.get(owner.slot) == oid

    def admitted(self) -> Iterator[tuple[int, Owner]]:
        """(owner id, owner) of every running request."""
        for oid in self._current.values():
            yield oid, self._owners[oid]

    def forget_if_empty(self, oid: int) -> None:
        """Drops an ended admission once it holds no page."""
        owner = self._owners.get(oid)
        if owner is not None and not owner.pages and not self.is_current(oid):
            del self._owners[oid]

    def pages_of(self, slot: int) -> dict[int, OptPage]:
        """The optional pages of the slot's running request, by ``page_key``."""
        oid = self._current.get(slot)
        return {} if oid is None else dict(self._owners[oid].pages)

    @property
    def optional_pages(self) -> int:
        return sum(len(o.pages) for o in self._owners.values())

    @property
    def retiring_pages(self) -> int:
        """Optional pages already on their way back to the pool."""
        return sum(pg.retire for o in self._owners.values() for pg in o.pages.values())


# ---- the tensors behind page moves -------------------------------------------------------
def page_rows(store: DeviceStore, pgs: list[OptPage]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device store rows, host arena element offsets) of every row of ``pgs``."""
    p, dev = store.page, store.device
    meta = to_device([(pg.page, pg.slot, pg.source, pg.index) for pg in pgs], dev)
    offs = torch.arange(p, device=dev)
    rows = (meta[:, 0:1] * p + offs).reshape(-1)
    base = store.host.base[meta[:, 1], meta[:, 2]]  # element base of each region
    host = (base.unsqueeze(1) + (meta[:, 3:4] * p + offs) * store.row_elems).reshape(-1)
    return rows, host


def publish(store: DeviceStore, pgs: list[OptPage], hide: bool = False) -> None:
    """Sets (or, with ``hide``, clears) the pages in their slots' optional maps."""
    by_source: dict[int, list[OptPage]] = {}
    for pg in pgs:
        by_source.setdefault(pg.source, []).append(pg)
    for source, group in by_source.items():
        slots, index, value = to_device(
            [
                [pg.slot for pg in group],
                [pg.index for pg in group],
                [-1 if hide else pg.page for pg in group],
            ],
            store.device,
        )
        store.geo[source].opt_map[slots, index] = value.to(torch.int32)


def import_pages(
    store: DeviceStore, source: int, slot: int, first: int, pages: list[int], src: torch.Tensor
) -> None:
    """Resident-first: copies a prefill's rows (at device locations ``src``) of history pages
    ``first ..`` into the physical ``pages`` in one copy, and publishes them (the map write is
    stream-ordered after the copy)."""
    p, dev = store.page, store.device
    phys = to_device(pages, dev)
    store.rows[(phys.unsqueeze(1) * p + torch.arange(p, device=dev)).reshape(-1)] = store.rows[src]
    store.geo[source].opt_map[slot, first : first + len(pages)] = phys.to(torch.int32)
