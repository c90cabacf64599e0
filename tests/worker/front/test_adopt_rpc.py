"""The worker's ``Adopt`` RPC against a real store process: a worker "dies" mid-generation (an
engine dropped without releasing anything, its lease still running), and two live workers of
the node — real gRPC servers around real engines — are asked at once to adopt its session.
Exactly one streams the rest, token for token what an uninterrupted run gives; the other is
refused with FAILED_PRECONDITION. Both fenced the dead worker off the store."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.kv_host_store.client import KVHostStoreClient
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.prefix_setup import prefix_salt
from services.worker.request.request import SamplingParams
from services.worker.server import start_server
from services.worker.settings import WorkerSettings
from tests.conftest import free_port
from tests.kv_host_store.conftest import StoreProcess, kill_process, start_store_process

PROMPT = list(range(10, 50))
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
COMMON = dict(model="tiny-glm", mode="hisparse", kv_pool_mib=16, max_model_len=256)


@pytest.fixture
def store() -> Iterator[StoreProcess]:
    arena = Path("/dev/shm") / f"dhisparse-test-{uuid.uuid4().hex}"
    sp = start_store_process(arena)
    try:
        yield sp
    finally:
        kill_process(sp.proc)
        arena.unlink(missing_ok=True)


def dead_worker(target: str, steps: int) -> int:
    """Runs ``r0`` for ``steps`` steps on a worker ``wA`` of the node, then drops it without
    releasing anything; returns its generation."""
    client = KVHostStoreClient(target, timeout=10)
    _, mapping = client.map_arena()
    cfg = EngineConfig(**COMMON, owner="wA")
    engine = Engine(cfg, host=(client, mapping))
    link = HostLink(client, "wA", 60.0, engine.kv.host_backups, prefix_salt(cfg, engine.kv).root())
    generation = link.register()
    engine.add_request("r0", PROMPT, PARAMS)
    for _ in range(steps):
        engine.step()
    engine.kv.host_backups.flush()
    return generation


async def test_two_live_workers_race_to_adopt_and_exactly_one_streams(store) -> None:
    (want,) = Engine(EngineConfig(**COMMON)).generate([PROMPT], [PARAMS])
    generation = dead_worker(store.target, steps=12)
    servers, channels, stubs = [], [], []
    try:
        for wid in ("wB", "wC"):
            port = free_port()
            settings = WorkerSettings(
                **COMMON, port=port, metrics_port=0, worker_id=wid, kv_store=store.target,
                gc_freeze=False,
            )  # fmt: skip
            servers.append(await start_server(settings))
            channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            stubs.append(pb_grpc.WorkerStub(channels[-1]))
        loads = [await s.GetLoad(pb.LoadRequest()) for s in stubs]
        assert loads[0].kv_store_id and loads[0].kv_store_id == loads[1].kv_store_id  # one node
        health = [await s.Health(pb.HealthRequest()) for s in stubs]
        assert [h.generation for h in health] == [1, 1]  # each registered with the store
        request = pb.AdoptSessionRequest(
            request_id="r0", from_owner="wA", from_generation=generation, tokens_received=5,
            fence=True,
        )  # fmt: skip

        async def adopt(stub) -> list[int] | grpc.StatusCode:
            try:
                return [t async for r in stub.Adopt(request) for t in r.token_ids]
            except grpc.aio.AioRpcError as e:
                assert "another adopter took it" in (e.details() or ""), e.details()
                return e.code()

        results = await asyncio.gather(*(adopt(s) for s in stubs))
        streamed = [r for r in results if isinstance(r, list)]
        assert len(streamed) == 1, results
        assert streamed[0] == want.output_ids[5:]
        assert [r for r in results if not isinstance(r, list)] == [
            grpc.StatusCode.FAILED_PRECONDITION
        ]
        with KVHostStoreClient(store.target) as c:
            stats = c.stats()
            assert (stats.adoptions, stats.owners_fenced) == (1, 1)
            with pytest.raises(Exception, match="released"):
                c.renew_owner("wA", generation)  # fenced off for good
    finally:
        for ch in channels:
            await ch.close()
        for server, engine in servers:
            await server.stop(grace=None)
            engine.shutdown()
