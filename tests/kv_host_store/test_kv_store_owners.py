"""Owners of the host store: worker processes with a generation and a lease. A dead owner's
requests are adoptable (never a live owner's), the adopter gets the very regions, calls from a
dead generation are fenced off, and requests nobody adopts expire. Store logic with a fake
clock, then the same over gRPC with the server's orphan sweeper."""

from __future__ import annotations

import asyncio

import pytest

from dhisparse import metrics as names
from services.kv_host_store import (
    AsyncKVHostStoreClient,
    CapacityExhausted,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
)
from services.kv_host_store.server import KVHostStoreServer
from services.kv_host_store.settings import KVHostStoreSettings
from services.kv_host_store.store import HostStore
from tests.kv_host_store.conftest import ALIGN, Clock


def test_generations_count_up_and_fence_off_the_previous_process(store: HostStore) -> None:
    g1 = store.register_owner("w0", 5.0).generation
    r = store.allocate("req", "w0", 0, 4, 64, generation=g1)
    g2 = store.register_owner("w0", 5.0).generation  # the process restarted
    assert (g1, g2) == (1, 2)
    with pytest.raises(FailedPrecondition, match="superseded by generation 2"):
        store.mark_durable(r.region_id, "w0", 0, 1, generation=g1)
    with pytest.raises(FailedPrecondition, match="superseded"):
        store.renew_owner("w0", g1)
    # Not yet adopted: the new generation does not own it either, until it adopts.
    with pytest.raises(PermissionDenied, match="generation 1, not 'w0' generation 2"):
        store.lookup("req", "w0", generation=g2)
    (adopted,) = store.adopt("req", "w0", g2)
    assert (adopted.region_id, adopted.offset, adopted.generation) == (r.region_id, r.offset, 2)
    assert store.mark_durable(r.region_id, "w0", 0, 2, generation=g2) == 2
    with pytest.raises(FailedPrecondition, match="not registered"):
        store.allocate("x", "w9", 0, 1, 64, generation=3)  # e.g. after the store restarted


def test_a_live_owners_requests_are_never_adoptable(store: HostStore, clock: Clock) -> None:
    g0 = store.register_owner("w0", 5.0).generation
    g1 = store.register_owner("w1", 60.0).generation
    store.allocate("req", "w0", 0, 4, 64, generation=g0)
    clock.t += 4.0
    store.renew_owner("w0", g0)
    clock.t += 4.0  # 8 s after registering, 4 s after renewing: alive
    with pytest.raises(FailedPrecondition, match="live owner 'w0' generation 1: not adoptable"):
        store.adopt("req", "w1", g1)
    assert store.list_requests(adoptable_only=True) == []
    # Isolation stays as it was: w1 can neither read nor free w0's regions.
    with pytest.raises(PermissionDenied):
        store.lookup("req", "w1", generation=g1)
    with pytest.raises(PermissionDenied):
        store.release("w1", request_id="req", generation=g1)


def test_adoptable_once_the_lease_expired(store: HostStore, clock: Clock) -> None:
    g0 = store.register_owner("w0", 5.0).generation
    g1 = store.register_owner("w1", 60.0).generation
    r = store.allocate("req", "w0", 0, 4, 64, generation=g0)
    clock.t += 6.0  # w0 stopped renewing: its lease ran out a second ago
    (info,) = store.list_requests("w0", adoptable_only=True)
    assert info.adoptable and info.dead_for_s == pytest.approx(1.0) and info.regions == 1
    (adopted,) = store.adopt("req", "w1", g1)
    assert (adopted.owner, adopted.offset) == ("w1", r.offset)
    assert store.stats().adoptions == 1
    # The old owner comes back to life: renewing works, but the request is gone from it.
    store.renew_owner("w0", g0)
    with pytest.raises(PermissionDenied):
        store.release("w0", request_id="req", generation=g0)


def test_only_a_live_registered_owner_adopts(store: HostStore, clock: Clock) -> None:
    g0 = store.register_owner("w0", 5.0).generation
    store.allocate("req", "w0", 0, 4, 64, generation=g0)
    store.register_owner("w0", 5.0)
    with pytest.raises(FailedPrecondition, match="live registered owner"):
        store.adopt("req", "w2", 0)  # never registered
    g3 = store.register_owner("w3", 5.0).generation
    clock.t += 10.0  # w3's own lease expired
    with pytest.raises(FailedPrecondition, match="live registered owner"):
        store.adopt("req", "w3", g3)
    g4 = store.register_owner("w4", 5.0).generation
    with pytest.raises(NotFound):
        store.adopt("nope", "w4", g4)


def test_released_owner_is_adoptable_at_once(store: HostStore) -> None:
    g0 = store.register_owner("w0", 60.0).generation
    g1 = store.register_owner("w1", 60.0).generation
    store.allocate("req", "w0", 0, 4, 64, generation=g0)
    store.release_owner("w0", g0)
    assert store.adopt("req", "w1", g1)[0].owner == "w1"


def test_orphans_expire_unless_adopted(store: HostStore, clock: Clock) -> None:
    g0 = store.register_owner("w0", 5.0).generation
    store.allocate("a", "w0", 0, 4, 64, generation=g0)
    store.allocate("b", "w0", 0, 4, 64, generation=g0)
    store.allocate("legacy", "old", 0, 4, 64)  # an owner that never registered: no lease
    g1 = store.register_owner("w0", 5.0).generation
    store.adopt("b", "w0", g1)
    clock.t += 29.0
    assert store.expire_orphans() == 0  # not yet: dead for 29 s of 30
    clock.t += 1.0
    assert store.expire_orphans() == 1  # "a"; "b" was adopted, "legacy" has no lease
    s = store.stats()
    assert (s.requests, s.orphans_expired, s.regions) == (2, 1, 2)
    assert {i.request_id for i in store.list_requests()} == {"b", "legacy"}
    clock.t += 100.0  # g1 stopped renewing too: its adopted request expires in turn
    assert store.expire_orphans() == 1
    assert store.stats().owners_live == 0


def test_capacity_exhaustion_is_a_clear_error(clock: Clock) -> None:
    store = HostStore(4 * ALIGN, ALIGN, clock=clock)
    g = store.register_owner("w0", 5.0).generation
    store.allocate("a", "w0", 0, 3, ALIGN, generation=g)
    with pytest.raises(CapacityExhausted, match=r"host KV store full.*requested 8192 bytes, "):
        store.allocate("b", "w0", 0, 2, ALIGN, generation=g)
    assert store.stats().allocations_refused == 1


async def test_owner_rpcs_and_the_orphan_sweeper(arena_path) -> None:
    settings = KVHostStoreSettings(
        port=0, metrics_port=0, arena_path=arena_path, capacity=64 << 20,
        shutdown_grace_s=0.2, orphan_ttl_s=0.3, sweep_interval_s=0.05,
    )  # fmt: skip
    srv = KVHostStoreServer(settings)
    await srv.start()
    try:
        async with AsyncKVHostStoreClient(f"127.0.0.1:{srv.port}", timeout=5) as c:
            lease = await c.register_owner("w0", 60.0)
            assert (lease.owner, lease.generation, lease.ttl_s) == ("w0", 1, 60.0)
            r = await c.allocate("req", "w0", 0, 8, 64, generation=1)
            await c.allocate("gone", "w0", 1, 8, 64, generation=1)
            assert r.generation == 1
            await c.renew_owner("w0", 1)
            other = await c.register_owner("w1", 60.0)
            with pytest.raises(FailedPrecondition, match="not adoptable"):
                await c.adopt("req", "w1", other.generation)
            assert (await c.register_owner("w0", 60.0)).generation == 2
            infos = await c.list_requests("w0", adoptable_only=True)
            assert [i.request_id for i in infos] == ["gone", "req"]
            (adopted,) = await c.adopt("req", "w1", other.generation)
            assert (adopted.region_id, adopted.owner) == (r.region_id, "w1")
            await c.release_owner("w1", other.generation)
            with pytest.raises(FailedPrecondition, match="released"):
                await c.renew_owner("w1", other.generation)
            for _ in range(100):  # the sweeper frees both orphans after 0.3 s
                if (await c.stats()).requests == 0:
                    break
                await asyncio.sleep(0.05)
            s = await c.stats()
            assert (s.requests, s.adoptions, s.orphans_expired, s.owners_live) == (0, 1, 2, 1)
        text = srv_metrics(srv)
        assert f"{names.HOST_STORE_ADOPTIONS}_total 1.0" in text
        assert f"{names.HOST_STORE_ORPHANS_EXPIRED}_total 2.0" in text
        assert f"{names.HOST_STORE_OWNERS} 1.0" in text
    finally:
        await srv.stop()


def srv_metrics(srv: KVHostStoreServer) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{srv.metrics_port}/metrics").text
