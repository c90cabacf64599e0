"""The records of optional history: a page's life (``State``), the page itself, the admission
that owns pages (``Owner``) and the residency statistics the metrics read."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
