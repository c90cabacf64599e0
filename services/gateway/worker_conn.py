"""One worker as the gateway sees it: a gRPC channel (reconnecting quickly, so that streams
waiting for a restarted worker find it soon) and what the last health/load poll learned."""

from __future__ import annotations

import logging

import grpc
import grpc.aio

from dhisparse.rpc import worker_pb2, worker_pb2_grpc
from services.gateway import convert
from services.gateway.convert import ModelInfo, WorkerLoad
from services.gateway.routing import WorkerStatus

log = logging.getLogger(__name__)


def describe(e: grpc.aio.AioRpcError) -> str:
    return f"{e.code().name}: {e.details() or 'no details'}"


class WorkerClient:
    """One worker: its channel and what the last poll learned. A poll the worker does not
    answer is a miss; ``misses_allowed`` misses in a row mark it unhealthy (one lost poll is a
    busy event loop or a dropped packet, not a dead worker). A worker that answers it is not
    ok is unhealthy at once."""

    def __init__(self, address: str, misses_allowed: int = 3) -> None:
        if misses_allowed < 1:
            raise ValueError(f"misses_allowed must be >= 1, got {misses_allowed}")
        self.address = address
        self.misses_allowed = misses_allowed
        self.misses = 0  # polls missed in a row
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self.healthy = False
        self.model: ModelInfo | None = None
        self.load: WorkerLoad | None = None
        self.in_flight = 0
        self.in_flight_at_poll = 0
        self.last_error: str | None = None
        # its registration with its host store, as its last answered health poll said (kept
        # once it stops answering: a dead worker's streams are taken from that generation)
        self.generation = 0
        # a data-parallel-attention group: each rank's own registration (owner, generation),
        # by rank, as that poll said: where the sessions each rank runs are held
        self.rank_owners: tuple[tuple[str, int], ...] = ()

    def open(self) -> None:
        """Creates the channel; must run on the event loop that will use it (grpc.aio binds a
        channel to the loop it was created on), hence not in ``__init__``."""
        if self._channel is None:
            # Reconnect quickly: a restarted worker is waited for by streams to re-attach.
            options = [
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ]
            self._channel = grpc.aio.insecure_channel(self.address, options=options)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        if self._stub is None:
            raise RuntimeError(f"worker client {self.address} is not open")
        return self._stub

    async def poll(self, timeout_s: float) -> None:
        """Health, then load; model info until it is known. Never raises."""
        was_healthy = self.healthy
        try:
            if self.model is None:
                info = await self.stub.GetModelInfo(
                    worker_pb2.ModelInfoRequest(), timeout=timeout_s
                )
                self.model = convert.model_info(info)
            health = await self.stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s)
            self.generation = health.generation
            self.rank_owners = tuple((o.owner, o.generation) for o in health.rank_owners)
            if not health.ok:
                self.healthy, self.last_error = False, f"unhealthy: {health.status}"
            else:
                load = await self.stub.GetLoad(worker_pb2.LoadRequest(), timeout=timeout_s)
                self.load = convert.worker_load(load)
                self.in_flight_at_poll = self.in_flight
                self.healthy, self.last_error = True, None
            self.misses = 0
        except grpc.aio.AioRpcError as e:
            self.misses += 1
            self.last_error = describe(e)
            if self.misses < self.misses_allowed and self.healthy:
                log.info(
                    "worker %s missed a health poll (%d of %d in a row): %s",
                    self.address, self.misses, self.misses_allowed, self.last_error,
                )  # fmt: skip
            else:
                self.healthy = False
                # A worker that comes back may be a restarted process serving another model.
                self.model = None
        if was_healthy != self.healthy:
            log.info(
                "worker %s is %s%s",
                self.address,
                "healthy" if self.healthy else "unhealthy",
                f" ({self.last_error})" if self.last_error else "",
            )

    def status(self) -> WorkerStatus:
        load, model = self.load, self.model
        return WorkerStatus(
            address=self.address,
            healthy=self.healthy,
            num_running=load.num_running if load else 0,
            num_waiting=load.num_waiting if load else 0,
            max_num_seqs=load.max_num_seqs if load else 0,
            kv_capacity_bytes=load.kv_capacity_bytes if load else 0,
            kv_free_bytes=load.kv_free_bytes if load else 0,
            serving_ranks=load.serving_ranks if load else 1,
            in_flight=self.in_flight,
            in_flight_at_poll=self.in_flight_at_poll,
            model_name=model.model_name if model else "",
            mode=model.mode if model else "",
            config_json=model.config_json if model else "",
            kv_layout_json=model.kv_layout_json if model else "",
            page_size=model.page_size if model else 0,
            prefix_cache=model.prefix_cache if model else False,
            kv_store_id=load.kv_store_id if load else "",
        )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
