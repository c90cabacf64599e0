"""Clients of the host store, for workers: ``KVHostStoreClient`` (blocking; the engine runs in
a thread) and ``AsyncKVHostStoreClient`` (asyncio). Both return ``records`` and raise
``errors`` (a refused call raises e.g. ``PermissionDenied``; transport failures stay
``grpc.RpcError``). ``map_arena`` maps the store's arena file, which must be visible at the
same path (same node, shared /dev/shm)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from dhisparse.rpc import kv_host_store_pb2 as pb
from dhisparse.rpc import kv_host_store_pb2_grpc as pb_grpc
from services.kv_host_store import convert
from services.kv_host_store.arena import ArenaMapping, map_arena
from services.kv_host_store.records import ArenaInfo, Region, ReleaseResult, StoreStats


def _release_request(owner: str, request_id: str, region_id: str) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(owner=owner, request_id=request_id, region_id=region_id)


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
        self, request_id: str, owner: str, source: int, num_rows: int, row_bytes: int
    ) -> Region:
        m = pb.AllocateRequest(
            request_id=request_id,
            owner=owner,
            source=source,
            num_rows=num_rows,
            row_bytes=row_bytes,
        )
        return convert.region_from_proto(self._call(self._stub.Allocate, m))

    def mark_durable(self, region_id: str, owner: str, start_row: int, end_row: int) -> int:
        """Rows ``[start_row, end_row)`` are durable; returns the region's durable rows."""
        m = pb.MarkDurableRequest(
            region_id=region_id, owner=owner, start_row=start_row, end_row=end_row
        )
        return self._call(self._stub.MarkDurable, m).durable_rows

    def lookup(self, request_id: str, owner: str) -> list[Region]:
        m = pb.LookupRequest(request_id=request_id, owner=owner)
        return [convert.region_from_proto(r) for r in self._call(self._stub.Lookup, m).regions]

    def release_region(self, owner: str, region_id: str) -> ReleaseResult:
        m = _release_request(owner, "", region_id)
        return convert.release_from_proto(self._call(self._stub.Release, m))

    def release_request(self, owner: str, request_id: str) -> ReleaseResult:
        m = _release_request(owner, request_id, "")
        return convert.release_from_proto(self._call(self._stub.Release, m))

    def stats(self) -> StoreStats:
        return convert.stats_from_proto(self._call(self._stub.Stats, pb.StatsRequest()))

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
        self, request_id: str, owner: str, source: int, num_rows: int, row_bytes: int
    ) -> Region:
        m = pb.AllocateRequest(
            request_id=request_id,
            owner=owner,
            source=source,
            num_rows=num_rows,
            row_bytes=row_bytes,
        )
        return convert.region_from_proto(await self._call(self._stub.Allocate, m))

    async def mark_durable(self, region_id: str, owner: str, start_row: int, end_row: int) -> int:
        m = pb.MarkDurableRequest(
            region_id=region_id, owner=owner, start_row=start_row, end_row=end_row
        )
        return (await self._call(self._stub.MarkDurable, m)).durable_rows

    async def lookup(self, request_id: str, owner: str) -> list[Region]:
        m = pb.LookupRequest(request_id=request_id, owner=owner)
        resp = await self._call(self._stub.Lookup, m)
        return [convert.region_from_proto(r) for r in resp.regions]

    async def release_region(self, owner: str, region_id: str) -> ReleaseResult:
        m = _release_request(owner, "", region_id)
        return convert.release_from_proto(await self._call(self._stub.Release, m))

    async def release_request(self, owner: str, request_id: str) -> ReleaseResult:
        m = _release_request(owner, request_id, "")
        return convert.release_from_proto(await self._call(self._stub.Release, m))

    async def stats(self) -> StoreStats:
        return convert.stats_from_proto(await self._call(self._stub.Stats, pb.StatsRequest()))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVHostStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
