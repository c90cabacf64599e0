"""The host store's logic, with no gRPC in it: regions of the arena, who owns them, and which
of their rows are durable.

Ownership is per *request*: every region of a request belongs to the worker that allocated the
request's first region, and only that owner may allocate more, mark durable, look up or release.
A later "adopt after the owner died" transfers a request to a new owner and bumps its
``generation``, so calls still in flight from the dead owner are fenced off; all ownership checks
go through ``_owned_request`` so adoption changes one place (plus rewriting the ``owner`` of the
request's region records).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field, replace

from services.kv_host_store.allocator import Allocator
from services.kv_host_store.errors import (
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from services.kv_host_store.intervals import add_range, covered
from services.kv_host_store.records import Region, ReleaseResult, StoreStats

_MAX_ID_LEN = 256  # ids are uuids or similar; a bound keeps a buggy caller from bloating memory
_INT32 = (-(2**31), 2**31 - 1)  # the proto's source field


@dataclass
class _Request:
    owner: str
    generation: int = 0  # bumped by a future adopt(); part of the lease a caller must present
    region_ids: set[str] = field(default_factory=set)


def _check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string")
    if len(value) > _MAX_ID_LEN:
        raise InvalidArgument(f"{name} is longer than {_MAX_ID_LEN} characters")
    return value


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise InvalidArgument(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidArgument(f"{name} must be <= {hi}, got {value}")
    return value


class HostStore:
    """Regions of one arena of ``capacity`` bytes, keyed by region id and indexed by request.

    Thread-safe: every public method holds one lock (the gRPC server runs on asyncio and the
    metrics endpoint scrapes from its own thread). Returned ``Region``s are snapshots.
    """

    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        self._alloc = Allocator(capacity, alignment)
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._requests: dict[str, _Request] = {}
        self._durable_bytes = 0
        self._refused = 0

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def alignment(self) -> int:
        return self._alloc.alignment

    # -- ownership ---------------------------------------------------------------------------

    def _owned_request(self, request_id: str, owner: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"no regions for request {request_id!r}")
        if req.owner != owner:
            raise PermissionDenied(
                f"request {request_id!r} is owned by {req.owner!r}, not {owner!r}"
            )
        return req

    def _owned_region(self, region_id: str, owner: str) -> Region:
        region = self._regions.get(region_id)
        if region is None:
            raise NotFound(f"no region {region_id!r}")
        self._owned_request(region.request_id, owner)
        return region

    # -- operations --------------------------------------------------------------------------

    def allocate(
        self, request_id: str, owner: str, source: int, num_rows: int, row_bytes: int
    ) -> Region:
        """A new contiguous region of ``num_rows * row_bytes`` bytes for rows of ``source`` of
        ``request_id``, owned by ``owner``; no rows are durable yet.

        Raises ``PermissionDenied`` when the request belongs to another owner and
        ``CapacityExhausted`` (naming requested vs largest free bytes) when no contiguous free
        range fits. A request may hold several regions of one source (e.g. while moving to a
        larger one); ``lookup`` returns them all.
        """
        _check_id("request_id", request_id)
        _check_id("owner", owner)
        _check_int("source", source, *_INT32)
        _check_int("num_rows", num_rows, lo=1)
        _check_int("row_bytes", row_bytes, lo=1)
        nbytes = num_rows * row_bytes
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and req.owner != owner:
                raise PermissionDenied(
                    f"request {request_id!r} is owned by {req.owner!r}, not {owner!r}"
                )
            need = self._alloc.aligned_size(nbytes)
            offset = self._alloc.allocate(nbytes)
            if offset is None:
                self._refused += 1
                largest = self._alloc.largest_free()
                raise CapacityExhausted(
                    f"no contiguous free range for {num_rows} rows x {row_bytes} B: requested "
                    f"{need} bytes, largest free {largest} bytes (free {self._alloc.free_bytes} "
                    f"of {self._alloc.capacity} bytes)",
                    requested=need,
                    largest_free=largest,
                )
            if req is None:
                req = self._requests[request_id] = _Request(owner=owner)
            region = Region(
                region_id=uuid.uuid4().hex,
                request_id=request_id,
                owner=owner,
                source=source,
                offset=offset,
                num_rows=num_rows,
                row_bytes=row_bytes,
            )
            self._regions[region.region_id] = region
            req.region_ids.add(region.region_id)
            return region

    def mark_durable(self, region_id: str, owner: str, start_row: int, end_row: int) -> int:
        """Records that rows ``[start_row, end_row)`` of the region hold complete, committed
        bytes; calls may arrive in any order and overlap. Returns the region's durable rows."""
        _check_id("region_id", region_id)
        _check_id("owner", owner)
        _check_int("start_row", start_row, lo=0)
        _check_int("end_row", end_row)
        with self._lock:
            region = self._owned_region(region_id, owner)
            if not start_row < end_row <= region.num_rows:
                raise InvalidArgument(
                    f"rows [{start_row}, {end_row}) must be a non-empty range inside the "
                    f"region's {region.num_rows} rows"
                )
            durable = add_range(region.durable, start_row, end_row)
            before, after = covered(region.durable), covered(durable)
            self._regions[region_id] = replace(region, durable=durable)
            self._durable_bytes += (after - before) * region.row_bytes
            return after

    def lookup(self, request_id: str, owner: str) -> list[Region]:
        """Every region of ``request_id`` with its durable rows, ordered by (source, offset)."""
        _check_id("request_id", request_id)
        _check_id("owner", owner)
        with self._lock:
            req = self._owned_request(request_id, owner)
            regions = [self._regions[r] for r in req.region_ids]
        return sorted(regions, key=lambda r: (r.source, r.offset))

    def release(
        self, owner: str, *, request_id: str | None = None, region_id: str | None = None
    ) -> ReleaseResult:
        """Frees one region (``region_id``) or every region of a request (``request_id``):
        exactly one must be given (an empty string counts as not given, as in the proto)."""
        _check_id("owner", owner)
        if bool(request_id) == bool(region_id):
            raise InvalidArgument("give exactly one of request_id and region_id")
        with self._lock:
            if region_id:
                _check_id("region_id", region_id)
                victims = [self._owned_region(region_id, owner)]
            else:
                req = self._owned_request(_check_id("request_id", request_id), owner)
                victims = [self._regions[r] for r in req.region_ids]
            freed = sum(self._free(region) for region in victims)
            return ReleaseResult(released=len(victims), bytes_freed=freed)

    def _free(self, region: Region) -> int:
        del self._regions[region.region_id]
        req = self._requests[region.request_id]
        req.region_ids.discard(region.region_id)
        if not req.region_ids:
            del self._requests[region.request_id]
        self._durable_bytes -= region.durable_rows * region.row_bytes
        return self._alloc.free(region.offset)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                capacity_bytes=self._alloc.capacity,
                used_bytes=self._alloc.used_bytes,
                regions=len(self._regions),
                requests=len(self._requests),
                durable_bytes=self._durable_bytes,
                allocations_refused=self._refused,
                largest_free_bytes=self._alloc.largest_free(),
            )
