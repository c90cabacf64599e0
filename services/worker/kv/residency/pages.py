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


@dataclass(eq=False)
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
    pages: dict[tuple[int, int], OptPage] = field(default_factory=dict)
    # Host-backed imported pages not on the device, to refill (source, page) in order.
    wanted: list[tuple[int, int]] = field(default_factory=list)
    reclaim_started: float | None = None


@dataclass
class ResidencyStats:
    reclaim_events: int = 0
    reclaim_pages: int = 0
    reclaim_latency: list[float] = field(default_factory=list)  # seconds, drained by readers
    repopulated_pages: int = 0  # published (their copy completed)
    refill_pages: int = 0  # whose copy was queued (the step that queues it pays for it)
    admissions_waited: int = 0
