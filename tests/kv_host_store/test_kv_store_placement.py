"""Placement policies: every one keeps regions disjoint, aligned and inside the arena; grouped
keeps one group's regions inside its extents (a source's regions of a batch in a footprint of
about their own bytes) and refuses nothing packed would place; scattered spreads them; the store's
durability and adoption are the same under each."""

from __future__ import annotations

import random

import pytest

from services.kv_host_store.allocator import Allocator
from services.kv_host_store.errors import CapacityExhausted
from services.kv_host_store.placement import GroupedAllocator, Placement
from services.kv_host_store.store import HostStore

ALIGN = 64


def check_disjoint(alloc, live: dict[int, int]) -> None:
    spans = sorted((o, alloc.aligned_size(n)) for o, n in live.items())
    assert spans == alloc.allocations()
    end = 0
    for offset, size in spans:
        assert offset % ALIGN == 0 and offset >= end
        end = offset + size
    assert end <= alloc.capacity
    assert alloc.used_bytes == sum(s for _, s in spans)
    assert alloc.free_bytes == alloc.capacity - alloc.used_bytes


def span(offsets: list[int], size: int) -> int:
    return max(offsets) + size - min(offsets)


def test_allocate_at_carves_a_free_block() -> None:
    a = Allocator(1024, ALIGN)
    assert a.allocate_at(256, 100)
    assert a.free_blocks() == [(0, 256), (384, 640)]
    assert not a.allocate_at(320, 64)  # inside the live range
    assert not a.allocate_at(960, 128)  # runs past the arena
    assert a.allocate_at(0, 256)
    assert a.free_blocks() == [(384, 640)]
    a.free(256)
    assert a.free_blocks() == [(256, 768)]
    with pytest.raises(ValueError):
        a.allocate_at(10, 64)


@pytest.mark.parametrize("kind", ["packed", "grouped", "scattered"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_regions_disjoint(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    alloc = Placement(kind, extent_bytes=16 * ALIGN, seed=seed).allocator(512 * ALIGN, ALIGN)
    live: dict[int, int] = {}
    for _ in range(600):
        if live and rng.random() < 0.45:
            offset = rng.choice(sorted(live))
            assert alloc.free(offset) == alloc.aligned_size(live.pop(offset))
        else:
            n = rng.randint(1, 24 * ALIGN)
            offset = alloc.allocate(n, (rng.randrange(2), rng.randrange(5)))
            if offset is not None:
                live[offset] = n
            else:
                assert alloc.largest_free() < alloc.aligned_size(n)
        check_disjoint(alloc, live)
    for offset in list(live):
        alloc.free(offset)
    assert alloc.used_bytes == 0 and alloc.largest_free() == alloc.capacity


def interleaved(kind: str, requests: int, sources: int, size: int) -> dict[int, list[int]]:
    """Admits requests one after another, one region per source each (as a worker does):
    source -> its regions' offsets."""
    alloc = Placement(kind, extent_bytes=64 * size).allocator(4 * requests * sources * size, ALIGN)
    out: dict[int, list[int]] = {s: [] for s in range(sources)}
    for _ in range(requests):
        for s in range(sources):
            out[s].append(alloc.allocate(size, ("w0", s)))
    return out


def windows(offsets: list[int], width: int) -> int:
    """Distinct ``width``-aligned windows the regions start in."""
    return len({o // width for o in offsets})


def test_grouped_keeps_a_sources_regions_in_few_windows() -> None:
    requests, sources, size = 256, 8, 4 * ALIGN
    extent = 64 * size
    packed = interleaved("packed", requests, sources, size)
    grouped = interleaved("grouped", requests, sources, size)
    for s in range(sources):
        # packed strides a source's regions by a request's every source
        assert span(packed[s], size) >= (requests - 1) * sources * size
        assert windows(packed[s], extent) >= requests * sources * size // extent - 1
        # grouped: the source's own extents, each full of its regions
        assert windows(grouped[s], extent) == requests * size // extent


def test_grouped_reuses_its_extents_and_gives_empty_ones_back() -> None:
    alloc = GroupedAllocator(64 * ALIGN, ALIGN, 8 * ALIGN)
    a = [alloc.allocate(2 * ALIGN, "a") for _ in range(4)]  # one extent, full
    b = alloc.allocate(ALIGN, "b")
    assert alloc.extents("a") == [(0, 8 * ALIGN)]
    assert alloc.extents("b") == [(8 * ALIGN, 8 * ALIGN)]
    alloc.free(a[1])
    assert alloc.allocate(2 * ALIGN, "a") == a[1]  # the hole of its own extent
    for o in a:
        alloc.free(o)
    assert alloc.extents("a") == []
    assert alloc.allocate(ALIGN, "b") == b + ALIGN  # still within b's extent
    big = alloc.allocate(20 * ALIGN, "c")  # larger than an extent: an extent of its own
    assert alloc.extents("c") == [(big, 20 * ALIGN)]


def test_grouped_refuses_nothing_packed_would_place() -> None:
    # More groups than extents fit: the arena fills to the last byte all the same.
    cap = 40 * ALIGN
    alloc = GroupedAllocator(cap, ALIGN, 16 * ALIGN)
    offsets = [alloc.allocate(ALIGN, ("w", i % 7)) for i in range(40)]
    assert None not in offsets and len(set(offsets)) == 40
    assert alloc.free_bytes == 0 and alloc.allocate(1, "x") is None


def test_scattered_spreads_regions_and_repeats_with_its_seed() -> None:
    def offsets(seed: int) -> list[int]:
        alloc = Placement("scattered", seed=seed).allocator(4096 * ALIGN, ALIGN)
        return [alloc.allocate(ALIGN, None) for _ in range(32)]

    assert offsets(1) == offsets(1) != offsets(2)
    assert span(offsets(1), ALIGN) > 2048 * ALIGN  # not packed at the bottom


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError):
        Placement("nearest")


@pytest.mark.parametrize("kind", ["packed", "grouped", "scattered"])
def test_store_durability_and_adoption_are_the_same_under_each_placement(kind: str) -> None:
    now = [0.0]
    store = HostStore(4096 * ALIGN, ALIGN, clock=lambda: now[0], placement=Placement(kind, 256))
    old = store.register_owner("w", ttl_s=10)
    regions = [store.allocate(f"r{i}", "w", s, 8, 96, old.generation)
               for i in range(6) for s in range(3)]  # fmt: skip
    for r in regions:
        store.mark_durable(r.region_id, "w", 0, 5, old.generation)
    new = store.register_owner("w", ttl_s=10)  # the worker restarted
    adopted = store.adopt("r2", "w", new.generation)
    assert [(r.offset, r.durable_rows) for r in adopted] == [
        (r.offset, 5) for r in regions if r.request_id == "r2"
    ]
    store.release("w", request_id="r2", generation=new.generation)
    now[0] += 1000
    assert store.expire_orphans() == 5
    assert store.stats().used_bytes == 0
    with pytest.raises(CapacityExhausted):
        store.allocate("huge", "w", 0, 4097, ALIGN, new.generation)
