"""Optional history (DESIGN §4): complete pages of a request's imported history kept in the device
page pool while memory is spare.

The records: a page's life (``State``), the page itself, the admission that owns pages
(``Owner``) and the residency statistics the metrics read; then the tensors behind a page's
moves: where its rows live and publishing it in its slot's optional map. Every move handles a
batch of pages in one copy (one launch, one completion ticket) and one map write per source."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from services.worker.kv.transfers import to_device


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
    ``wanted`` lists every host-backed page of every admission: as (source, page) tuples, the
    collector tracked 88K of them at C = 48 on the H200 and its full collections cost the
    adaptive run 0.2 s; ints are not tracked."""
    return source << 32 | index


def page_of_key(key: int) -> tuple[int, int]:
    """(source, page) of a ``page_key``."""
    return key >> 32, key & 0xFFFFFFFF


@dataclass
class ResidencyStats:
    reclaim_events: int = 0
    reclaim_pages: int = 0
    reclaim_latency: list[float] = field(default_factory=list)  # seconds, drained by readers
    repopulated_pages: int = 0  # published (their copy completed)
    refill_pages: int = 0  # whose copy was queued (the step that queues it pays for it)
    admissions_waited: int = 0


# ---- the tensors behind page moves -------------------------------------------------------
def page_rows(payload, pgs: list[OptPage]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device store rows, host arena element offsets) of every row of ``pgs``."""
    p, dev = payload.page, payload.device
    meta = to_device([(pg.page, pg.slot, pg.source, pg.index) for pg in pgs], dev)
    offs = torch.arange(p, device=dev)
    rows = (meta[:, 0:1] * p + offs).reshape(-1)
    base = payload.host.base[meta[:, 1], meta[:, 2]]  # element base of each region
    host = (base.unsqueeze(1) + (meta[:, 3:4] * p + offs) * payload.store.shape[1]).reshape(-1)
    return rows, host


def publish(payload, pgs: list[OptPage], hide: bool = False) -> None:
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
            payload.device,
        )
        payload.geo[source].opt_map[slots, index] = value.to(torch.int32)


def import_pages(
    payload, source: int, slot: int, first: int, pages: list[int], src: torch.Tensor
) -> None:
    """Resident-first: copies a prefill's rows (at device locations ``src``) of history pages
    ``first ..`` into the physical ``pages`` in one copy, and publishes them (the map write is
    stream-ordered after the copy)."""
    p, dev = payload.page, payload.device
    phys = to_device(pages, dev)
    payload.store[(phys.unsqueeze(1) * p + torch.arange(p, device=dev)).reshape(-1)] = (
        payload.store[src]
    )
    payload.geo[source].opt_map[slot, first : first + len(pages)] = phys.to(torch.int32)
