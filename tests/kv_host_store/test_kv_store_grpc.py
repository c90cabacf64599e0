"""The store as a service: a real `dhisparse kv-host-store` process (and an in-process server
for the asyncio client), talked to over loopback gRPC."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dhisparse import metrics as names
from dhisparse.rpc import kv_host_store_pb2 as pb
from dhisparse.rpc import kv_host_store_pb2_grpc as pb_grpc
from services.kv_host_store import (
    AsyncKVHostStoreClient,
    CapacityExhausted,
    InvalidArgument,
    KVHostStoreClient,
    NotFound,
    PermissionDenied,
    RegionSpec,
    RowRange,
)
from services.kv_host_store.server import KVHostStoreServer

from .conftest import CAPACITY, StoreProcess, kill_process, start_store_process

# A second worker process: finds the request's region through the store, maps the arena on
# its own and prints the region's bytes.
READER = """
import sys
from services.kv_host_store import KVHostStoreClient
with KVHostStoreClient(sys.argv[1]) as client:
    (region,) = client.lookup(sys.argv[2], sys.argv[3])
    info, arena = client.map_arena()
    print(arena.rows_of(region).numpy().tobytes().hex())
"""


@pytest.fixture
def client(store_process: StoreProcess) -> Iterator[KVHostStoreClient]:
    c = KVHostStoreClient(store_process.target)
    c.wait_ready(30)
    yield c
    c.close()


def test_bytes_written_through_one_mapping_are_read_through_another_process(
    store_process: StoreProcess, client: KVHostStoreClient
) -> None:
    info, arena = client.map_arena()
    assert (info.path, info.capacity_bytes) == (str(store_process.arena_path), CAPACITY)
    assert info.alignment == 4096 and info.store_id
    region = client.allocate("req-1", "worker-0", source=3, num_rows=100, row_bytes=576)
    assert region.offset % info.alignment == 0 and region.nbytes == 57_600
    payload = os.urandom(region.nbytes)
    arena.region(region.offset, region.nbytes).numpy()[:] = list(payload)
    assert client.mark_durable(region.region_id, "worker-0", 0, 100) == 100

    out = subprocess.run(
        [sys.executable, "-c", READER, store_process.target, "req-1", "worker-0"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    assert bytes.fromhex(out) == payload

    (got,) = client.lookup("req-1", "worker-0")
    assert got == replace(region, durable=(RowRange(0, 100),))
    stats = client.stats()
    assert (stats.regions, stats.requests, stats.durable_bytes) == (1, 1, 57_600)
    assert stats.used_bytes == 61_440 and stats.capacity_bytes == CAPACITY
    released = client.release_request("worker-0", "req-1")
    assert (released.released, released.bytes_freed) == (1, 61_440)
    assert client.stats().used_bytes == 0
    arena.close()


def _status(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=10)
    return e.value.code(), e.value.details()


def test_error_statuses_carry_messages(store_process: StoreProcess) -> None:
    with grpc.insecure_channel(store_process.target) as channel:
        stub = pb_grpc.KVHostStoreStub(channel)
        region = stub.Allocate(
            pb.AllocateRequest(request_id="r", owner="w0", source=0, num_rows=10, row_bytes=64)
        )
        C = grpc.StatusCode
        cases = [
            (stub.Allocate, pb.AllocateRequest(request_id="r", owner="w0", num_rows=0, row_bytes=1),
             C.INVALID_ARGUMENT, "num_rows"),
            (stub.Allocate, pb.AllocateRequest(owner="w0", num_rows=1, row_bytes=1),
             C.INVALID_ARGUMENT, "request_id"),
            (stub.Allocate, pb.AllocateRequest(request_id="x", owner="w0", num_rows=1, row_bytes=CAPACITY + 1),
             C.RESOURCE_EXHAUSTED, "largest free"),
            (stub.Allocate, pb.AllocateRequest(request_id="r", owner="w1", num_rows=1, row_bytes=1),
             C.PERMISSION_DENIED, "owned by 'w0'"),
            (stub.MarkDurable, pb.MarkDurableRequest(region_id=region.region_id, owner="w0", start_row=5, end_row=11),
             C.INVALID_ARGUMENT, "inside the region"),
            (stub.MarkDurable, pb.MarkDurableRequest(region_id=region.region_id, owner="w1", start_row=0, end_row=1),
             C.PERMISSION_DENIED, "not 'w1'"),
            (stub.MarkDurable, pb.MarkDurableRequest(region_id="nope", owner="w0", start_row=0, end_row=1),
             C.NOT_FOUND, "no region"),
            (stub.Lookup, pb.LookupRequest(request_id="unknown", owner="w0"),
             C.NOT_FOUND, "no regions for request"),
            (stub.Lookup, pb.LookupRequest(request_id="r", owner="w1"),
             C.PERMISSION_DENIED, "owned by"),
            (stub.Release, pb.ReleaseRequest(owner="w0"),
             C.INVALID_ARGUMENT, "exactly one"),
            (stub.Release, pb.ReleaseRequest(owner="w0", request_id="r", region_id=region.region_id),
             C.INVALID_ARGUMENT, "exactly one"),
            (stub.Release, pb.ReleaseRequest(owner="w1", region_id=region.region_id),
             C.PERMISSION_DENIED, "owned by"),
        ]  # fmt: skip
        for call, request, code, fragment in cases:
            got_code, details = _status(call, request)
            assert (got_code, fragment in details) == (code, True), (request, details)
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.regions, stats.allocations_refused) == (1, 1)


def test_metrics_endpoint_serves_the_store_gauges(
    store_process: StoreProcess, client: KVHostStoreClient
) -> None:
    client.allocate("a", "w0", 0, 10, 4096)
    r = client.allocate("b", "w0", 1, 1, 100)
    client.mark_durable(r.region_id, "w0", 0, 1)
    with pytest.raises(CapacityExhausted):
        client.allocate("c", "w0", 0, 1, 2 * CAPACITY)
    text = httpx.get(store_process.metrics_url, timeout=10).text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[names.HOST_STORE_CAPACITY_BYTES] == CAPACITY
    assert samples[names.HOST_STORE_USED_BYTES] == 11 * 4096
    assert samples[names.HOST_STORE_DURABLE_BYTES] == 100
    assert samples[names.HOST_STORE_REGIONS] == 2
    assert samples[names.HOST_STORE_REQUESTS] == 2
    assert samples[names.HOST_STORE_REFUSED + "_total"] == 1
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    assert types[names.HOST_STORE_REFUSED] == "counter"
    assert types[names.HOST_STORE_USED_BYTES] == "gauge"


def test_sigterm_shuts_down_and_removes_the_arena(store_process: StoreProcess) -> None:
    assert store_process.arena_path.exists()
    assert store_process.terminate() == 0
    assert not store_process.arena_path.exists()
    assert any("shutting down" in line for line in store_process.log)


def test_arena_is_kept_when_configured(arena_path: Path) -> None:
    sp = start_store_process(arena_path, "--no-remove-arena-on-exit")
    try:
        assert sp.terminate() == 0
        assert arena_path.exists()
    finally:
        kill_process(sp.proc)


def test_second_store_on_the_same_arena_fails_to_start(store_process: StoreProcess) -> None:
    with pytest.raises(RuntimeError, match="held by another running kv_host_store"):
        start_store_process(store_process.arena_path)
    assert store_process.proc.poll() is None  # the first store is unharmed
    assert store_process.arena_path.exists()


# -- in-process server, asyncio and threaded clients ---------------------------------------


async def test_async_client_maps_statuses_to_store_errors(server: KVHostStoreServer) -> None:
    async with AsyncKVHostStoreClient(f"127.0.0.1:{server.port}") as client:
        info = await client.get_arena()
        assert info.store_id == server.store_id
        region = await client.allocate("r", "w0", 0, 8, 512)
        assert await client.mark_durable(region.region_id, "w0", 4, 8) == 4
        assert await client.mark_durable(region.region_id, "w0", 0, 2) == 6
        (got,) = await client.lookup("r", "w0")
        assert got.durable == (RowRange(0, 2), RowRange(4, 8))
        with pytest.raises(PermissionDenied, match="not 'w1'"):
            await client.lookup("r", "w1")
        with pytest.raises(NotFound):
            await client.release_region("w0", "missing")
        with pytest.raises(InvalidArgument, match="num_rows"):
            await client.allocate("r", "w0", 0, -1, 512)
        with pytest.raises(CapacityExhausted, match="requested"):
            await client.allocate("r", "w0", 0, 1, CAPACITY * 2)
        assert (await client.release_region("w0", region.region_id)).released == 1
        assert (await client.stats()).used_bytes == 0
        specs = [RegionSpec(0, 8, 512), RegionSpec(-1, 2, 100)]
        many = await client.allocate_many("m", "w0", specs)
        assert [(r.source, r.num_rows, r.row_bytes) for r in many] == [(0, 8, 512), (-1, 2, 100)]
        with pytest.raises(CapacityExhausted, match="requested"):  # all or nothing
            await client.allocate_many(
                "m", "w0", [RegionSpec(1, 1, 64), RegionSpec(2, 1, CAPACITY * 2)]
            )
        assert len(await client.lookup("m", "w0")) == 2


async def test_sync_client_from_an_engine_thread(server: KVHostStoreServer) -> None:
    def engine_thread() -> tuple[int, bytes]:
        with KVHostStoreClient(f"127.0.0.1:{server.port}") as client:
            region = client.allocate("r", "w0", 2, 4, 8)
            both = client.allocate_many("s", "w0", [RegionSpec(0, 2, 8), RegionSpec(1, 3, 8)])
            assert [r.source for r in both] == [0, 1]
            _info, arena = client.map_arena()
            arena.rows_of(region)[:] = 7
            data = arena.region(region.offset, region.nbytes).numpy().tobytes()
            arena.close()
            return client.lookup("r", "w0")[0].source, data

    source, data = await asyncio.to_thread(engine_thread)
    assert source == 2 and data == b"\x07" * 32
