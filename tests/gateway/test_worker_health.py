"""The gateway's view of a worker's health, against an in-process gRPC worker that can miss
polls: a worker stays healthy through fewer than ``health_misses`` missed polls in a row and
turns unhealthy at that many; a worker that answers it is not ok is unhealthy at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import grpc.aio

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.gateway import GatewaySettings
from services.gateway.worker_client import WorkerPool


class FlakyWorker(pb_grpc.WorkerServicer):
    """Answers every poll, except that the next ``miss`` Health calls fail as an unreachable
    worker's would; ``ok`` is what an answered Health says."""

    def __init__(self, vocab_size: int = 300) -> None:
        self.miss = 0
        self.ok = True
        self.vocab_size = vocab_size

    async def Health(self, request, context):
        if self.miss > 0:
            self.miss -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return pb.HealthResponse(ok=self.ok, status="serving" if self.ok else "store lost")

    async def GetLoad(self, request, context):
        return pb.LoadResponse(worker_id="w", max_num_seqs=4, kv_capacity_bytes=1 << 30)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name="fake", max_model_len=1024, vocab_size=self.vocab_size,
                            mode="resident")  # fmt: skip


@asynccontextmanager
async def serving(worker: pb_grpc.WorkerServicer) -> AsyncIterator[str]:
    """``worker`` on an in-process gRPC server; its address."""
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_a_worker_turns_unhealthy_only_after_consecutive_missed_polls() -> None:
    fake = FlakyWorker()
    misses = GatewaySettings().health_misses
    assert misses == 3
    async with serving(fake) as address:
        pool = WorkerPool([address], poll_interval_s=60)  # polled by hand below
        await pool.start()
        try:
            w = pool.workers[address]
            assert w.healthy
            fake.miss = misses - 1
            for _ in range(misses - 1):
                await pool.poll_all()
                assert w.healthy and pool.any_healthy and w.last_error
            await pool.poll_all()  # answered: the count starts again
            assert w.healthy and w.misses == 0 and w.last_error is None
            fake.miss = misses
            for _ in range(misses):
                await pool.poll_all()
            assert not w.healthy and "UNAVAILABLE" in (w.last_error or "")
            await pool.poll_all()
            assert w.healthy  # back at the first answered poll
            fake.ok = False
            await pool.poll_all()
            assert not w.healthy and w.last_error == "unhealthy: store lost"
        finally:
            await pool.close()


async def test_health_misses_is_a_setting() -> None:
    fake = FlakyWorker()
    async with serving(fake) as address:
        pool = WorkerPool([address], poll_interval_s=60, health_misses=1)
        await pool.start()
        try:
            fake.miss = 1
            await pool.poll_all()
            assert not pool.workers[address].healthy
        finally:
            await pool.close()
