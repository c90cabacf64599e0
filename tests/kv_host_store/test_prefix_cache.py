"""Cached prefixes in the store: handed over by a worker, owned by the store, leased by
admissions, evicted least-recently-used under arena pressure and never while leased, and never
a live request's regions. Then the same calls over gRPC against a real store process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.kv_host_store import CapacityExhausted, KVHostStoreClient, NotFound
from services.kv_host_store.errors import PermissionDenied
from services.kv_host_store.prefix_index import PrefixSalt, page_hashes
from services.kv_host_store.store import HostStore

from .conftest import StoreProcess

ALIGN = 4096
CAP = 64 * ALIGN
SALT = PrefixSalt("preset:test", "float32", "auto", 4)
ROW = 1024  # 4 rows a page: a page is one aligned block


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def tokens_of(i: int, pages: int) -> list[int]:
    return [1000 * i + j for j in range(4 * pages)]


def leave(store: HostStore, owner: str, i: int, pages: int, gen: int = 0) -> list[str]:
    """A worker's finished request ``i`` of ``pages`` pages, handed to the store."""
    rid = f"prefix-{owner}-{i}"
    store.allocate(rid, owner, 0, 4 * pages, ROW, gen)
    store.allocate(rid, owner, -2, 4 * pages, 256, gen)  # its index keys
    tokens = tokens_of(i, pages)
    hashes = page_hashes(SALT, tokens)
    assert store.cache_prefix(rid, owner, gen, hashes, tokens, 4)
    return hashes


def test_a_cached_prefix_belongs_to_the_store_and_is_leased_by_its_longest_match() -> None:
    store = HostStore(CAP, ALIGN)
    hashes = leave(store, "w0", 1, pages=3)
    s = store.stats()
    assert (s.requests, s.regions, s.prefix_records) == (0, 0, 1)  # nobody's request any more
    assert s.prefix_bytes == 3 * ALIGN + ALIGN and s.used_bytes == s.prefix_bytes
    with pytest.raises(NotFound):
        store.lookup("prefix-w0-1", "w0")
    query = [*tokens_of(1, 2), 7, 7, 7, 7, 8]  # two pages match, a third does not
    hit = store.acquire_prefix("w1", 0, page_hashes(SALT, query), query, 4)
    assert hit is not None and (hit.pages, hit.tokens) == (2, 8)
    assert sorted(r.source for r in hit.regions) == [-2, 0]
    assert next(r for r in hit.regions if r.source == 0).num_rows == 12  # the whole record
    store.release_prefix(hit.lease_id)
    with pytest.raises(NotFound):
        store.release_prefix(hit.lease_id)
    assert store.acquire_prefix("w1", 0, hashes, tokens_of(1, 3), 8) is None  # other page size
    assert store.stats().prefix_hits == 1
    # a reader of a record's end state (token rings): no lease, no hit on the first pages
    assert store.acquire_prefix("w1", 0, page_hashes(SALT, query), query, 4, whole=True) is None
    hit = store.acquire_prefix("w1", 0, hashes, tokens_of(1, 3), 4, whole=True)
    assert hit is not None and hit.pages == 3
    store.release_prefix(hit.lease_id)
    assert store.stats().prefix_hits == 2


def test_pages_a_record_already_holds_are_not_cached_twice_and_longer_ones_replace_it() -> None:
    store = HostStore(CAP, ALIGN)
    leave(store, "w0", 1, pages=2)
    store.allocate("again", "w0", 0, 8, ROW)
    tokens = tokens_of(1, 2)
    assert not store.cache_prefix("again", "w0", 0, page_hashes(SALT, tokens), tokens, 4)
    s = store.stats()
    assert s.prefix_records == 1 and s.used_bytes == s.prefix_bytes  # its regions were freed
    longer = [*tokens_of(1, 2), 5, 5, 5, 5]
    store.allocate("longer", "w0", 0, 12, ROW)
    assert store.cache_prefix("longer", "w0", 0, page_hashes(SALT, longer), longer, 4)
    s = store.stats()
    assert s.prefix_records == 1 and s.prefix_bytes == 3 * ALIGN  # the shorter one went
    with pytest.raises(PermissionDenied):  # only the request's owner hands it over
        store.allocate("x", "w0", 0, 4, ROW)
        store.cache_prefix("x", "w1", 0, page_hashes(SALT, tokens), tokens, 4)


def test_an_arena_filled_past_capacity_by_cached_prefixes_evicts_no_live_region() -> None:
    """Live requests hold a quarter of the arena; finished ones keep handing prefixes over far
    past its capacity. Eviction takes the least recently used unleased record; a leased one
    and every live region stay, with their bytes."""
    store = HostStore(CAP, ALIGN)
    live = [store.allocate(f"live-{i}", "w0", 0, 16, ROW) for i in range(4)]
    leave(store, "w1", 0, pages=4)
    leased = store.acquire_prefix("w2", 0, page_hashes(SALT, tokens_of(0, 4)), tokens_of(0, 4), 4)
    assert leased is not None
    leave(store, "w1", 1, pages=4)
    for i in range(2, 40):  # 38 more records of 5 blocks: three times the arena
        if i == 5:  # record 1, used again, outlives records 2..4
            hit = store.acquire_prefix(
                "w2", 0, page_hashes(SALT, tokens_of(1, 4)), tokens_of(1, 4), 4
            )
            assert hit is not None
            store.release_prefix(hit.lease_id)
        leave(store, "w1", i, pages=4)
    s = store.stats()
    assert s.prefix_evictions > 0 and s.used_bytes <= CAP
    assert [store.lookup(f"live-{i}", "w0") for i in range(4)] == [[r] for r in live]
    held = store.acquire_prefix("w2", 0, page_hashes(SALT, tokens_of(0, 4)), tokens_of(0, 4), 4)
    assert held is not None and held.regions == leased.regions  # leased: never evicted
    for gone in (2, 3, 4):
        tokens = tokens_of(gone, 4)
        assert store.acquire_prefix("w2", 0, page_hashes(SALT, tokens), tokens, 4) is None
    with pytest.raises(CapacityExhausted):  # past what eviction can free: live and leased stay
        store.allocate("huge", "w0", 0, 64 * 4, ROW)
    assert store.lookup("live-0", "w0") == [live[0]]


def test_a_dead_workers_lease_is_dropped_by_the_sweep() -> None:
    clock = Clock()
    store = HostStore(CAP, ALIGN, clock=clock, orphan_ttl_s=100.0)
    lease = store.register_owner("w2", 1.0)
    leave(store, "w1", 0, pages=40)  # 50 of the arena's 64 blocks
    hit = store.acquire_prefix(
        "w2", lease.generation, page_hashes(SALT, tokens_of(0, 40)), tokens_of(0, 40), 4
    )
    assert hit is not None
    with pytest.raises(CapacityExhausted):
        store.allocate("big", "w0", 0, 4 * 20, ROW)
    clock.t = 5.0  # w2's lease expired: its process is gone
    store.expire_orphans()
    store.allocate("big", "w0", 0, 4 * 20, ROW)
    assert store.stats().prefix_records == 0 and store.stats().prefix_evictions == 1


@pytest.fixture
def client(store_process: StoreProcess) -> Iterator[KVHostStoreClient]:
    c = KVHostStoreClient(store_process.target)
    c.wait_ready(30)
    yield c
    c.close()


def test_prefixes_over_grpc(client: KVHostStoreClient) -> None:
    _info, arena = client.map_arena()
    region = client.allocate("prefix-r", "w0", 0, 8, ROW)
    arena.region(region.offset, region.nbytes).numpy()[:] = 7
    tokens = tokens_of(3, 2)
    hashes = page_hashes(SALT, tokens)
    assert client.cache_prefix("prefix-r", "w0", 0, hashes, tokens, 4)
    assert client.acquire_prefix("w1", 0, hashes, [0, *tokens[1:]], 4) is None
    assert client.acquire_prefix("w1", 0, hashes[:1], tokens[:5], 4, whole=True) is None
    hit = client.acquire_prefix("w1", 0, hashes, tokens, 4)
    assert hit is not None and (hit.pages, hit.tokens) == (2, 8)
    (got,) = hit.regions
    assert (got.offset, got.num_rows) == (region.offset, 8)
    assert (arena.region(got.offset, got.nbytes).numpy() == 7).all()
    client.release_prefix(hit.lease_id)
    with pytest.raises(NotFound):
        client.release_prefix(hit.lease_id)
    s = client.stats()
    assert (s.prefix_records, s.prefix_bytes, s.prefix_hits, s.requests) == (1, 2 * ALIGN, 1, 0)
