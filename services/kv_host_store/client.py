"""Clients of the host store, for workers: ``KVHostStoreClient`` (blocking; the engine runs in
a thread) and ``AsyncKVHostStoreClient`` (asyncio). Both return ``records`` and raise
``errors`` (a refused call raises e.g. ``PermissionDenied``; transport failures stay
``grpc.RpcError``, raised within ``timeout``: a dead store never hangs a caller). ``map_arena``
maps the store's arena file, which must be visible at the same path (same node, shared
/dev/shm). Owner-scoped calls take the caller's ``generation`` (``register_owner``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from dhisparse.rpc import kv_host_store_pb2 as pb
from dhisparse.rpc import kv_host_store_pb2_grpc as pb_grpc
from services.kv_host_store import convert
from services.kv_host_store.arena import ArenaMapping, map_arena
from services.kv_host_store.records import (
    ArenaInfo,
    OwnerLease,
    PrefixHit,
    Region,
    RegionSpec,
    ReleaseResult,
    RequestInfo,
    StoreStats,
)


class _Messages:
    """The request message of each call, shared by both clients."""

    @staticmethod
    def allocate(request_id: str, owner: str, source: int, rows: int, row_bytes: int, gen: int):
        return pb.AllocateRequest(
            request_id=request_id, owner=owner, source=source, num_rows=rows,
            row_bytes=row_bytes, generation=gen,
        )  # fmt: skip

    @staticmethod
    def allocate_many(request_id: str, owner: str, specs: Sequence[RegionSpec], gen: int):
        return pb.AllocateManyRequest(
            request_id=request_id, owner=owner, generation=gen,
            specs=[pb.RegionSpec(source=s.source, num_rows=s.num_rows, row_bytes=s.row_bytes)
                   for s in specs],
        )  # fmt: skip

    @staticmethod
    def mark_durable(region_id: str, owner: str, start: int, end: int, gen: int):
        return pb.MarkDurableRequest(
            region_id=region_id, owner=owner, start_row=start, end_row=end, generation=gen
        )

    @staticmethod
    def release(owner: str, request_id: str, region_id: str, gen: int) -> pb.ReleaseRequest:
        return pb.ReleaseRequest(
            owner=owner, request_id=request_id, region_id=region_id, generation=gen
        )

    @staticmethod
    def adopt(request_id: str, owner: str, gen: int, from_owner: str, fence: bool, from_gen: int):
        return pb.AdoptRequest(
            request_id=request_id, owner=owner, generation=gen, from_owner=from_owner,
            fence=fence, from_generation=from_gen,
        )  # fmt: skip


M = _Messages


class KVHostStoreClient:
    """Blocking client; thread-safe (one channel, shared). ``timeout`` bounds every call."""

    def __init__(self, target: str, *, timeout: float | None = 10.0) -> None:
        self.target = target
        self._timeout = timeout
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.KVHostStoreStub(self._channel)

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise convert.error_from_rpc(e) from e

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the channel connects; raises ``grpc.FutureTimeoutError`` after
        ``timeout`` seconds."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def get_arena(self) -> ArenaInfo:
        return convert.arena_from_proto(self._call(self._stub.GetArena, pb.ArenaRequest()))

    def map_arena(self) -> tuple[ArenaInfo, ArenaMapping]:
        """The arena's description and a shared mapping of it (see ``arena.map_arena``)."""
        info = self.get_arena()
        return info, map_arena(info.path, info.capacity_bytes)

    def allocate(
        self,
        request_id: str,
        owner: str,
        source: int,
        num_rows: int,
        row_bytes: int,
        generation: int = 0,
    ) -> Region:
        m = M.allocate(request_id, owner, source, num_rows, row_bytes, generation)
        return convert.region_from_proto(self._call(self._stub.Allocate, m))

    def allocate_many(
        self, request_id: str, owner: str, specs: Sequence[RegionSpec], generation: int = 0
    ) -> list[Region]:
        """``HostStore.allocate_many``: every region of ``specs`` in one call, all or none."""
        m = M.allocate_many(request_id, owner, specs, generation)
        resp = self._call(self._stub.AllocateMany, m)
        return [convert.region_from_proto(r) for r in resp.regions]

    def mark_durable(
        self, region_id: str, owner: str, start_row: int, end_row: int, generation: int = 0
    ) -> int:
        """Rows ``[start_row, end_row)`` are durable; returns the region's durable rows."""
        m = M.mark_durable(region_id, owner, start_row, end_row, generation)
        return self._call(self._stub.MarkDurable, m).durable_rows

    def lookup(self, request_id: str, owner: str, generation: int = 0) -> list[Region]:
        m = pb.LookupRequest(request_id=request_id, owner=owner, generation=generation)
        return [convert.region_from_proto(r) for r in self._call(self._stub.Lookup, m).regions]

    def release_region(self, owner: str, region_id: str, generation: int = 0) -> ReleaseResult:
        m = M.release(owner, "", region_id, generation)
        return convert.release_from_proto(self._call(self._stub.Release, m))

    def release_request(self, owner: str, request_id: str, generation: int = 0) -> ReleaseResult:
        m = M.release(owner, request_id, "", generation)
        return convert.release_from_proto(self._call(self._stub.Release, m))

    def stats(self) -> StoreStats:
        return convert.stats_from_proto(self._call(self._stub.Stats, pb.StatsRequest()))

    def register_owner(self, owner: str, ttl_s: float, salt: str = "") -> OwnerLease:
        m = pb.RegisterOwnerRequest(owner=owner, lease_ttl_s=ttl_s, salt=salt)
        return convert.lease_from_proto(self._call(self._stub.RegisterOwner, m))

    def renew_owner(self, owner: str, generation: int) -> OwnerLease:
        m = pb.RenewOwnerRequest(owner=owner, generation=generation)
        return convert.lease_from_proto(self._call(self._stub.RenewOwner, m))

    def release_owner(self, owner: str, generation: int) -> None:
        m = pb.ReleaseOwnerRequest(owner=owner, generation=generation)
        self._call(self._stub.ReleaseOwner, m)

    def list_requests(self, owner: str = "", adoptable_only: bool = False) -> list[RequestInfo]:
        m = pb.ListRequestsRequest(owner=owner, adoptable_only=adoptable_only)
        resp = self._call(self._stub.ListRequests, m)
        return [convert.request_info_from_proto(r) for r in resp.requests]

    def adopt(
        self, request_id: str, owner: str, generation: int, from_owner: str = "",
        fence: bool = False, from_generation: int = 0,
    ) -> list[Region]:  # fmt: skip
        """``HostStore.adopt``."""
        m = M.adopt(request_id, owner, generation, from_owner, fence, from_generation)
        return [convert.region_from_proto(r) for r in self._call(self._stub.Adopt, m).regions]

    def hand_over(self, request_id: str, owner: str, generation: int) -> None:
        m = pb.HandOverRequest(request_id=request_id, owner=owner, generation=generation)
        self._call(self._stub.HandOver, m)

    def cache_prefix(
        self,
        request_id: str,
        owner: str,
        generation: int,
        hashes: list[str],
        token_ids: list[int],
        page_size: int,
    ) -> bool:
        m = pb.CachePrefixRequest(
            request_id=request_id, owner=owner, generation=generation, page_hashes=hashes,
            token_ids=token_ids, page_size=page_size,
        )  # fmt: skip
        return self._call(self._stub.CachePrefix, m).cached

    def acquire_prefix(
        self, owner: str, generation: int, hashes: list[str], token_ids: list[int],
        page_size: int, whole: bool = False,
    ) -> PrefixHit | None:  # fmt: skip
        m = pb.AcquirePrefixRequest(
            owner=owner, generation=generation, page_hashes=hashes, token_ids=token_ids,
            page_size=page_size, whole=whole,
        )  # fmt: skip
        return convert.prefix_hit_from_proto(self._call(self._stub.AcquirePrefix, m))

    def release_prefix(self, lease_id: str) -> None:
        self._call(self._stub.ReleasePrefix, pb.ReleasePrefixRequest(lease_id=lease_id))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVHostStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVHostStoreClient:
    """asyncio client; create and use it on one event loop. Same methods, awaited."""

    def __init__(self, target: str, *, timeout: float | None = 10.0) -> None:
        self.target = target
        self._timeout = timeout
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.KVHostStoreStub(self._channel)

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise convert.error_from_rpc(e) from e

    async def wait_ready(self, timeout: float) -> None:
        """Waits until the channel connects; raises ``TimeoutError`` after ``timeout`` s."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def get_arena(self) -> ArenaInfo:
        return convert.arena_from_proto(await self._call(self._stub.GetArena, pb.ArenaRequest()))

    async def map_arena(self) -> tuple[ArenaInfo, ArenaMapping]:
        info = await self.get_arena()
        return info, map_arena(info.path, info.capacity_bytes)

    async def allocate(
        self,
        request_id: str,
        owner: str,
        source: int,
        num_rows: int,
        row_bytes: int,
        generation: int = 0,
    ) -> Region:
        m = M.allocate(request_id, owner, source, num_rows, row_bytes, generation)
        return convert.region_from_proto(await self._call(self._stub.Allocate, m))

    async def allocate_many(
        self, request_id: str, owner: str, specs: Sequence[RegionSpec], generation: int = 0
    ) -> list[Region]:
        m = M.allocate_many(request_id, owner, specs, generation)
        resp = await self._call(self._stub.AllocateMany, m)
        return [convert.region_from_proto(r) for r in resp.regions]

    async def mark_durable(
        self, region_id: str, owner: str, start_row: int, end_row: int, generation: int = 0
    ) -> int:
        m = M.mark_durable(region_id, owner, start_row, end_row, generation)
        return (await self._call(self._stub.MarkDurable, m)).durable_rows

    async def lookup(self, request_id: str, owner: str, generation: int = 0) -> list[Region]:
        m = pb.LookupRequest(request_id=request_id, owner=owner, generation=generation)
        resp = await self._call(self._stub.Lookup, m)
        return [convert.region_from_proto(r) for r in resp.regions]

    async def release_region(
        self, owner: str, region_id: str, generation: int = 0
    ) -> ReleaseResult:
        m = M.release(owner, "", region_id, generation)
        return convert.release_from_proto(await self._call(self._stub.Release, m))

    async def release_request(
        self, owner: str, request_id: str, generation: int = 0
    ) -> ReleaseResult:
        m = M.release(owner, request_id, "", generation)
        return convert.release_from_proto(await self._call(self._stub.Release, m))

    async def stats(self) -> StoreStats:
        return convert.stats_from_proto(await self._call(self._stub.Stats, pb.StatsRequest()))

    async def register_owner(self, owner: str, ttl_s: float, salt: str = "") -> OwnerLease:
        m = pb.RegisterOwnerRequest(owner=owner, lease_ttl_s=ttl_s, salt=salt)
        return convert.lease_from_proto(await self._call(self._stub.RegisterOwner, m))

    async def renew_owner(self, owner: str, generation: int) -> OwnerLease:
        m = pb.RenewOwnerRequest(owner=owner, generation=generation)
        return convert.lease_from_proto(await self._call(self._stub.RenewOwner, m))

    async def release_owner(self, owner: str, generation: int) -> None:
        m = pb.ReleaseOwnerRequest(owner=owner, generation=generation)
        await self._call(self._stub.ReleaseOwner, m)

    async def list_requests(
        self, owner: str = "", adoptable_only: bool = False
    ) -> list[RequestInfo]:
        m = pb.ListRequestsRequest(owner=owner, adoptable_only=adoptable_only)
        resp = await self._call(self._stub.ListRequests, m)
        return [convert.request_info_from_proto(r) for r in resp.requests]

    async def adopt(
        self, request_id: str, owner: str, generation: int, from_owner: str = "",
        fence: bool = False, from_generation: int = 0,
    ) -> list[Region]:  # fmt: skip
        m = M.adopt(request_id, owner, generation, from_owner, fence, from_generation)
        resp = await self._call(self._stub.Adopt, m)
        return [convert.region_from_proto(r) for r in resp.regions]

    async def hand_over(self, request_id: str, owner: str, generation: int) -> None:
        m = pb.HandOverRequest(request_id=request_id, owner=owner, generation=generation)
        await self._call(self._stub.HandOver, m)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVHostStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
