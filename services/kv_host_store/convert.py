"""Protobuf <-> records, and store errors <-> gRPC status codes. Protobuf types stop here and in
``server``/``client``: the store and its callers see only ``records`` and ``errors``."""

from __future__ import annotations

import grpc

from dhisparse.rpc import kv_host_store_pb2 as pb
from services.kv_host_store.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreError,
)
from services.kv_host_store.records import (
    ArenaInfo,
    OwnerLease,
    PrefixHit,
    Region,
    ReleaseResult,
    RequestInfo,
    RowRange,
    StoreStats,
)

STATUS_OF_ERROR: dict[type[StoreError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    CapacityExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}
_ERROR_OF_STATUS = {code: cls for cls, code in STATUS_OF_ERROR.items()}


def status_of(error: StoreError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_OF_ERROR:
            return STATUS_OF_ERROR[cls]
    return grpc.StatusCode.INTERNAL


def error_from_rpc(error: grpc.RpcError) -> Exception:
    """The store error a failed call stands for, or ``error`` itself for transport failures
    (UNAVAILABLE, DEADLINE_EXCEEDED, ...), which callers handle differently."""
    code, details = error.code(), error.details()  # type: ignore[attr-defined]
    cls = _ERROR_OF_STATUS.get(code)
    return error if cls is None else cls(details or code.name)


def region_to_proto(r: Region) -> pb.Region:
    return pb.Region(
        region_id=r.region_id,
        request_id=r.request_id,
        owner=r.owner,
        source=r.source,
        offset=r.offset,
        num_rows=r.num_rows,
        row_bytes=r.row_bytes,
        durable=[pb.RowRange(start=d.start, end=d.end) for d in r.durable],
        generation=r.generation,
    )


def region_from_proto(m: pb.Region) -> Region:
    return Region(
        region_id=m.region_id,
        request_id=m.request_id,
        owner=m.owner,
        source=m.source,
        offset=m.offset,
        num_rows=m.num_rows,
        row_bytes=m.row_bytes,
        durable=tuple(RowRange(d.start, d.end) for d in m.durable),
        generation=m.generation,
    )


def stats_to_proto(s: StoreStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        capacity_bytes=s.capacity_bytes,
        used_bytes=s.used_bytes,
        regions=s.regions,
        requests=s.requests,
        durable_bytes=s.durable_bytes,
        allocations_refused=s.allocations_refused,
        largest_free_bytes=s.largest_free_bytes,
        owners_live=s.owners_live,
        adoptions=s.adoptions,
        orphans_expired=s.orphans_expired,
        prefix_records=s.prefix_records,
        prefix_bytes=s.prefix_bytes,
        prefix_evictions=s.prefix_evictions,
        prefix_hits=s.prefix_hits,
        owners_fenced=s.owners_fenced,
        handovers=s.handovers,
    )


def stats_from_proto(m: pb.StatsResponse) -> StoreStats:
    return StoreStats(
        capacity_bytes=m.capacity_bytes,
        used_bytes=m.used_bytes,
        regions=m.regions,
        requests=m.requests,
        durable_bytes=m.durable_bytes,
        allocations_refused=m.allocations_refused,
        largest_free_bytes=m.largest_free_bytes,
        owners_live=m.owners_live,
        adoptions=m.adoptions,
        orphans_expired=m.orphans_expired,
        prefix_records=m.prefix_records,
        prefix_bytes=m.prefix_bytes,
        prefix_evictions=m.prefix_evictions,
        prefix_hits=m.prefix_hits,
        owners_fenced=m.owners_fenced,
        handovers=m.handovers,
    )


def arena_to_proto(a: ArenaInfo) -> pb.ArenaInfo:
    return pb.ArenaInfo(
        path=a.path, capacity_bytes=a.capacity_bytes, alignment=a.alignment, store_id=a.store_id
    )


def arena_from_proto(m: pb.ArenaInfo) -> ArenaInfo:
    return ArenaInfo(
        path=m.path, capacity_bytes=m.capacity_bytes, alignment=m.alignment, store_id=m.store_id
    )


def release_from_proto(m: pb.ReleaseResponse) -> ReleaseResult:
    return ReleaseResult(released=m.released, bytes_freed=m.bytes_freed)


def lease_to_proto(lease: OwnerLease) -> pb.OwnerLease:
    return pb.OwnerLease(owner=lease.owner, generation=lease.generation, lease_ttl_s=lease.ttl_s)


def lease_from_proto(m: pb.OwnerLease) -> OwnerLease:
    return OwnerLease(owner=m.owner, generation=m.generation, ttl_s=m.lease_ttl_s)


def request_info_to_proto(r: RequestInfo) -> pb.RequestInfo:
    return pb.RequestInfo(
        request_id=r.request_id,
        owner=r.owner,
        generation=r.generation,
        regions=r.regions,
        bytes=r.nbytes,
        adoptable=r.adoptable,
        dead_for_s=r.dead_for_s,
    )


def request_info_from_proto(m: pb.RequestInfo) -> RequestInfo:
    return RequestInfo(
        request_id=m.request_id,
        owner=m.owner,
        generation=m.generation,
        regions=m.regions,
        nbytes=m.bytes,
        adoptable=m.adoptable,
        dead_for_s=m.dead_for_s,
    )


def prefix_hit_to_proto(h: PrefixHit | None) -> pb.AcquirePrefixResponse:
    if h is None:
        return pb.AcquirePrefixResponse(hit=False)
    return pb.AcquirePrefixResponse(
        hit=True, lease_id=h.lease_id, pages=h.pages, tokens=h.tokens,
        regions=[region_to_proto(r) for r in h.regions],
    )  # fmt: skip


def prefix_hit_from_proto(m: pb.AcquirePrefixResponse) -> PrefixHit | None:
    if not m.hit:
        return None
    regions = tuple(region_from_proto(r) for r in m.regions)
    return PrefixHit(m.lease_id, m.pages, m.tokens, regions)
