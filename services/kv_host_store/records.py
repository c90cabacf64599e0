"""Plain records the store returns; the client returns the same ones (no protobuf types)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, end)`` of a region."""

    start: int
    end: int  # exclusive

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RegionSpec:
    """A region asked for: ``num_rows`` rows of ``row_bytes`` bytes of ``source`` (a KV source,
    >= 0, or a reserved id for session state, < 0)."""

    source: int
    num_rows: int
    row_bytes: int


@dataclass(frozen=True)
class Region:
    """One request's rows of one KV source: ``num_rows * row_bytes`` contiguous arena bytes
    starting at ``offset``. ``durable`` lists the rows holding complete, committed bytes,
    merged and sorted."""

    region_id: str
    request_id: str
    owner: str
    source: int  # a KV source (>= 0) or a reserved id for session state (< 0)
    offset: int  # byte offset in the arena, a multiple of the store's alignment
    num_rows: int
    row_bytes: int
    durable: tuple[RowRange, ...] = ()
    generation: int = 0  # the owner's generation holding it (0: an owner that never registered)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def durable_rows(self) -> int:
        return sum(r.rows for r in self.durable)


@dataclass(frozen=True)
class ReleaseResult:
    released: int  # regions freed
    bytes_freed: int  # aligned bytes returned to the arena


@dataclass(frozen=True)
class StoreStats:
    capacity_bytes: int
    used_bytes: int  # aligned bytes held by live regions
    regions: int
    requests: int
    durable_bytes: int  # durable rows * row_bytes over all regions
    allocations_refused: int  # refused for capacity since the store started
    largest_free_bytes: int  # the largest allocation that would succeed now
    owners_live: int = 0  # registered owners whose lease runs
    adoptions: int = 0  # requests adopted from dead owners since the store started
    owners_fenced: int = 0  # owner generations a peer found unreachable and fenced off
    handovers: int = 0  # requests their live owner offered to peers (draining)
    orphans_expired: int = 0  # requests of dead owners freed unadopted since the store started
    prefix_records: int = 0  # cached prefixes (``prefix_cache``)
    prefix_bytes: int = 0  # aligned arena bytes they hold
    prefix_evictions: int = 0  # cached prefixes evicted for room since the store started
    prefix_hits: int = 0  # leases taken on a cached prefix since the store started


@dataclass(frozen=True)
class ArenaInfo:
    """Where the arena lives, so a worker can map it."""

    path: str
    capacity_bytes: int
    alignment: int
    store_id: str  # changes when the store restarts with a fresh arena: remap and forget regions


@dataclass(frozen=True)
class OwnerLease:
    """A worker process's registration: ``generation`` fences off every earlier process that
    registered under the same worker id; the lease must be renewed within ``ttl_s``."""

    owner: str
    generation: int
    ttl_s: float


@dataclass(frozen=True)
class RequestInfo:
    """One request holding regions, as ``list_requests`` reports it."""

    request_id: str
    owner: str
    generation: int
    regions: int
    nbytes: int  # aligned bytes its regions hold
    adoptable: bool  # its owner is dead (lease expired, released, or a newer generation)
    dead_for_s: float  # seconds since its owner died (0 while it lives)


@dataclass(frozen=True)
class PrefixHit:
    """A lease on a cached prefix: its first ``pages`` complete pages (``tokens`` tokens) match
    the query. ``regions``: the record's regions (per KV source and session source id, rows
    from 0), readable until the lease is released; nobody writes them."""

    lease_id: str
    pages: int
    tokens: int
    regions: tuple[Region, ...]
