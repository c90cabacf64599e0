"""The store's bookkeeping of regions, unlocked and unchecked: the arena's allocator, every live
region by id, the regions of each request, and the durable-byte count. ``HostStore`` checks
arguments and ownership and holds the lock around every use."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.kv_host_store.errors import CapacityExhausted
from services.kv_host_store.intervals import add_range, covered
from services.kv_host_store.placement import Placement
from services.kv_host_store.records import Region


@dataclass
class Holding:
    """The regions of one request and the owner process holding them."""

    owner: str
    generation: int = 0  # of the owner process; fences off a dead generation's calls
    region_ids: set[str] = field(default_factory=set)
    salt: str = ""  # how its rows were computed (its allocating owner's registered salt)
    handed_over: float | None = None  # when its live owner offered it to a peer (draining)


class RegionTable:
    def __init__(self, capacity: int, alignment: int, placement: Placement = Placement()) -> None:
        self.alloc = placement.allocator(capacity, alignment)
        self.regions: dict[str, Region] = {}
        self.requests: dict[str, Holding] = {}
        self.durable_bytes = 0
        self.refused = 0

    def add(
        self,
        request_id: str,
        owner: str,
        generation: int,
        source: int,
        rows: int,
        row_bytes: int,
        evict: Callable[[], bool] = lambda: False,
        salt: str = "",
    ) -> Region:
        """A new region, placed with the other regions of ``(owner, source)`` as the placement
        policy says. While no free range fits, ``evict()`` frees something (a cached prefix)
        and it tries again; raises ``CapacityExhausted`` (counted) once ``evict()`` has nothing
        left to free. ``salt``: the owner's, kept with a request's first region."""
        need = self.alloc.aligned_size(rows * row_bytes)
        while self.alloc.largest_free() < need and evict():
            pass
        offset = self.alloc.allocate(rows * row_bytes, (owner, source))
        while offset is None and evict():  # a placement may refuse even a large enough hole
            offset = self.alloc.allocate(rows * row_bytes, (owner, source))
        if offset is None:
            self.refused += 1
            largest = self.alloc.largest_free()
            raise CapacityExhausted(
                f"host KV store full: no contiguous free range for {rows} rows x {row_bytes} B: "
                f"requested {need} bytes, largest free {largest} bytes (free "
                f"{self.alloc.free_bytes} of {self.alloc.capacity} bytes)",
                requested=need,
                largest_free=largest,
            )
        req = self.requests.setdefault(request_id, Holding(owner, generation, salt=salt))
        region = Region(
            uuid.uuid4().hex, request_id, owner, source, offset, rows, row_bytes,
            generation=generation,
        )  # fmt: skip
        self.regions[region.region_id] = region
        req.region_ids.add(region.region_id)
        return region

    def mark(self, region: Region, start: int, end: int) -> int:
        """Adds rows ``[start, end)`` to the region's durable rows; returns how many it has."""
        durable = add_range(region.durable, start, end)
        before, after = covered(region.durable), covered(durable)
        self.regions[region.region_id] = replace(region, durable=durable)
        self.durable_bytes += (after - before) * region.row_bytes
        return after

    def free(self, region: Region) -> int:
        """Frees one region (and forgets its request with its last region); returns bytes."""
        del self.regions[region.region_id]
        req = self.requests[region.request_id]
        req.region_ids.discard(region.region_id)
        if not req.region_ids:
            del self.requests[region.request_id]
        self.durable_bytes -= region.durable_rows * region.row_bytes
        return self.alloc.free(region.offset)

    def detach(self, request_id: str) -> tuple[list[Region], int]:
        """Forgets a request and its regions, keeping their bytes allocated (they are the
        prefix cache's now, ``free_detached`` returns them); (its regions, aligned bytes)."""
        req = self.requests.pop(request_id)
        regions = [self.regions.pop(r) for r in sorted(req.region_ids)]
        self.durable_bytes -= sum(r.durable_rows * r.row_bytes for r in regions)
        return regions, sum(self.alloc.aligned_size(r.nbytes) for r in regions)

    def free_detached(self, region: Region) -> int:
        return self.alloc.free(region.offset)

    def of(self, req: Holding) -> list[Region]:
        """The request's regions ordered by (source, offset)."""
        regions = [self.regions[r] for r in req.region_ids]
        return sorted(regions, key=lambda r: (r.source, r.offset))

    def transfer(self, req: Holding, owner: str, generation: int) -> None:
        req.owner, req.generation, req.handed_over = owner, generation, None
        for rid in req.region_ids:
            self.regions[rid] = replace(self.regions[rid], owner=owner, generation=generation)

    def held_bytes(self, req: Holding) -> int:
        return sum(self.alloc.aligned_size(self.regions[r].nbytes) for r in req.region_ids)
