"""The gRPC face of the host store. The servicer only translates messages to and from
``HostStore`` and maps its errors to status codes; ``KVHostStoreServer`` owns the lifecycle of
arena file, gRPC server and metrics endpoint; ``serve`` runs it until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIServer

import grpc

from dhisparse.rpc import kv_host_store_pb2 as pb
from dhisparse.rpc import kv_host_store_pb2_grpc as pb_grpc
from services.kv_host_store import convert
from services.kv_host_store.arena import HostArena
from services.kv_host_store.errors import StoreError
from services.kv_host_store.metrics import build_registry, start_metrics_server
from services.kv_host_store.records import ArenaInfo, RegionSpec
from services.kv_host_store.settings import KVHostStoreSettings
from services.kv_host_store.store import HostStore

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _maps_store_errors(method: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Turns a ``StoreError`` into the matching gRPC status, with its message as details."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await method(self, request, context)
        except StoreError as e:
            await context.abort(convert.status_of(e), str(e))
            raise AssertionError("unreachable: abort raises") from e

    return wrapper


class KVHostStoreServicer(pb_grpc.KVHostStoreServicer):
    def __init__(self, store: HostStore, arena: ArenaInfo) -> None:
        self._store = store
        self._arena = arena

    async def GetArena(
        self, request: pb.ArenaRequest, context: grpc.aio.ServicerContext
    ) -> pb.ArenaInfo:
        return convert.arena_to_proto(self._arena)

    @_maps_store_errors
    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.Region:
        r = request
        region = self._store.allocate(
            r.request_id, r.owner, r.source, r.num_rows, r.row_bytes, r.generation
        )
        return convert.region_to_proto(region)

    @_maps_store_errors
    async def AllocateMany(
        self, request: pb.AllocateManyRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateManyResponse:
        r = request
        specs = [RegionSpec(s.source, s.num_rows, s.row_bytes) for s in r.specs]
        regions = self._store.allocate_many(r.request_id, r.owner, specs, r.generation)
        return pb.AllocateManyResponse(regions=[convert.region_to_proto(x) for x in regions])

    @_maps_store_errors
    async def MarkDurable(
        self, request: pb.MarkDurableRequest, context: grpc.aio.ServicerContext
    ) -> pb.MarkDurableResponse:
        r = request
        rows = self._store.mark_durable(r.region_id, r.owner, r.start_row, r.end_row, r.generation)
        return pb.MarkDurableResponse(durable_rows=rows)

    @_maps_store_errors
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        regions = self._store.lookup(request.request_id, request.owner, request.generation)
        return pb.LookupResponse(regions=[convert.region_to_proto(r) for r in regions])

    @_maps_store_errors
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        result = self._store.release(
            request.owner,
            request_id=request.request_id,
            region_id=request.region_id,
            generation=request.generation,
        )
        return pb.ReleaseResponse(released=result.released, bytes_freed=result.bytes_freed)

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return convert.stats_to_proto(self._store.stats())

    @_maps_store_errors
    async def RegisterOwner(
        self, request: pb.RegisterOwnerRequest, context: grpc.aio.ServicerContext
    ) -> pb.OwnerLease:
        lease = self._store.register_owner(request.owner, request.lease_ttl_s, request.salt)
        log.info("owner %s registered generation %d", lease.owner, lease.generation)
        return convert.lease_to_proto(lease)

    @_maps_store_errors
    async def RenewOwner(
        self, request: pb.RenewOwnerRequest, context: grpc.aio.ServicerContext
    ) -> pb.OwnerLease:
        return convert.lease_to_proto(self._store.renew_owner(request.owner, request.generation))

    @_maps_store_errors
    async def ReleaseOwner(
        self, request: pb.ReleaseOwnerRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseOwnerResponse:
        self._store.release_owner(request.owner, request.generation)
        return pb.ReleaseOwnerResponse()

    @_maps_store_errors
    async def ListRequests(
        self, request: pb.ListRequestsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRequestsResponse:
        infos = self._store.list_requests(request.owner, request.adoptable_only)
        return pb.ListRequestsResponse(requests=[convert.request_info_to_proto(r) for r in infos])

    @_maps_store_errors
    async def Adopt(
        self, request: pb.AdoptRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdoptResponse:
        r = request
        regions = self._store.adopt(
            r.request_id, r.owner, r.generation, from_owner=r.from_owner, fence=r.fence,
            from_generation=r.from_generation,
        )  # fmt: skip
        log.info("request %s adopted by %s/%d%s", r.request_id, r.owner, r.generation,
                 f" from {r.from_owner}" if r.from_owner else "")  # fmt: skip
        return pb.AdoptResponse(regions=[convert.region_to_proto(r) for r in regions])

    @_maps_store_errors
    async def HandOver(
        self, request: pb.HandOverRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandOverResponse:
        self._store.hand_over(request.request_id, request.owner, request.generation)
        log.info("request %s handed over by %s/%d", request.request_id, request.owner,
                 request.generation)  # fmt: skip
        return pb.HandOverResponse()

    @_maps_store_errors
    async def CachePrefix(
        self, request: pb.CachePrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.CachePrefixResponse:
        cached = self._store.cache_prefix(
            request.request_id, request.owner, request.generation, list(request.page_hashes),
            list(request.token_ids), request.page_size,
        )  # fmt: skip
        return pb.CachePrefixResponse(cached=cached)

    @_maps_store_errors
    async def AcquirePrefix(
        self, request: pb.AcquirePrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquirePrefixResponse:
        hit = self._store.acquire_prefix(
            request.owner, request.generation, list(request.page_hashes),
            list(request.token_ids), request.page_size, request.whole,
        )  # fmt: skip
        return convert.prefix_hit_to_proto(hit)

    @_maps_store_errors
    async def ReleasePrefix(
        self, request: pb.ReleasePrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleasePrefixResponse:
        self._store.release_prefix(request.lease_id)
        return pb.ReleasePrefixResponse()


class KVHostStoreServer:
    """Arena file + store + gRPC server + metrics endpoint, started and stopped together.

    ``start`` creates the arena (refusing one held by a live store) and binds both ports;
    ``port``/``metrics_port`` then hold the bound ports (useful with port 0). ``stop`` lets
    in-flight RPCs finish within the grace period, then removes the arena file if configured.
    """

    def __init__(self, settings: KVHostStoreSettings) -> None:
        self.settings = settings
        self.store = HostStore(
            settings.capacity, settings.alignment, orphan_ttl_s=settings.orphan_ttl_s,
            placement=settings.placement(),
        )  # fmt: skip
        self.store_id = uuid.uuid4().hex
        self.port = 0
        self.metrics_port = 0
        self._arena: HostArena | None = None
        self._grpc: grpc.aio.Server | None = None
        self._metrics: WSGIServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def arena_info(self) -> ArenaInfo:
        s = self.settings
        return ArenaInfo(str(s.arena_path), s.capacity, s.alignment, self.store_id)

    async def start(self) -> None:
        s = self.settings
        self._arena = HostArena.create(s.arena_path, s.capacity, preallocate=s.preallocate)
        try:
            # No SO_REUSEPORT: a second store on the same port must fail, not share it.
            self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            pb_grpc.add_KVHostStoreServicer_to_server(
                KVHostStoreServicer(self.store, self.arena_info), self._grpc
            )
            self.port = self._grpc.add_insecure_port(f"{s.host}:{s.port}")
            if self.port == 0:  # older grpcio reports a failed bind this way
                raise OSError(f"cannot bind gRPC to {s.host}:{s.port}")
            httpd, _ = start_metrics_server(build_registry(self.store), s.host, s.metrics_port)
            self._metrics, self.metrics_port = httpd, httpd.server_port
            await self._grpc.start()
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="orphan-sweeper")
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kv-host-store listening grpc=%s:%d metrics=%s:%d arena=%s capacity=%d store_id=%s",
            s.host,
            self.port,
            s.host,
            self.metrics_port,
            s.arena_path,
            s.capacity,
            self.store_id,
        )

    async def _sweep_forever(self) -> None:
        """Frees dead owners' requests nobody adopted within the orphan TTL."""
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                n = self.store.expire_orphans()
            except Exception:
                log.exception("orphan sweep failed")
                continue
            if n:
                log.warning("expired %d orphaned requests (owner dead, not adopted)", n)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._grpc is not None:
            await self._grpc.stop(self.settings.shutdown_grace_s)
            self._grpc = None
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        if self._arena is not None:
            self._arena.close(remove=self.settings.remove_arena_on_exit)
            self._arena = None


async def serve(settings: KVHostStoreSettings) -> None:
    """Runs the store until SIGTERM or SIGINT, then shuts down gracefully."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    # Handlers first: a signal that arrives once the ready line is out must not kill us
    # with the arena file left behind.
    for sig in signals:
        loop.add_signal_handler(sig, stopping.set)
    server = KVHostStoreServer(settings)
    try:
        await server.start()
        try:
            await stopping.wait()
            log.info("kv-host-store shutting down")
        finally:
            await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
