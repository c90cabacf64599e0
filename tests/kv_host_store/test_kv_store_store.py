from __future__ import annotations

import contextlib
import itertools
import random
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.kv_host_store.errors import (
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from services.kv_host_store.intervals import add_range, contains, covered
from services.kv_host_store.records import RegionSpec, RowRange
from services.kv_host_store.store import HostStore

ALIGN = 4096
CAP = 64 * ALIGN


@pytest.fixture
def store() -> HostStore:
    return HostStore(CAP, ALIGN)


# -- durable intervals ---------------------------------------------------------------------------


def test_add_range_merges_overlapping_and_touching() -> None:
    r: tuple[RowRange, ...] = ()
    r = add_range(r, 10, 20)
    r = add_range(r, 0, 5)
    r = add_range(r, 30, 40)
    assert r == (RowRange(0, 5), RowRange(10, 20), RowRange(30, 40))
    r = add_range(r, 5, 10)  # touches both neighbours
    assert r == (RowRange(0, 20), RowRange(30, 40))
    r = add_range(r, 15, 35)  # overlaps both
    assert r == (RowRange(0, 40),)
    assert add_range(r, 3, 7) == r  # already covered
    # rows marked in order, as decode steps do: extend the last range, or start a new one
    assert add_range(r, 40, 41) == (RowRange(0, 41),)
    assert add_range(r, 38, 45) == (RowRange(0, 45),)
    assert add_range(r, 42, 43) == (RowRange(0, 40), RowRange(42, 43))


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), max_size=40))
def test_add_range_matches_a_set_of_rows(marks: list[tuple[int, int]]) -> None:
    r: tuple[RowRange, ...] = ()
    rows: set[int] = set()
    for start, length in marks:
        r = add_range(r, start, start + length)
        rows |= set(range(start, start + length))
    assert covered(r) == len(rows)
    assert {i for x in r for i in range(x.start, x.end)} == rows
    assert all(a.end < b.start for a, b in itertools.pairwise(r))  # sorted, not touching
    for start, length in marks:
        assert contains(r, start, start + length)


def test_mark_durable_out_of_order_and_overlapping(store: HostStore) -> None:
    region = store.allocate("req", "w0", source=0, num_rows=100, row_bytes=576)
    assert store.mark_durable(region.region_id, "w0", 50, 60) == 10
    assert store.mark_durable(region.region_id, "w0", 0, 10) == 20
    assert store.mark_durable(region.region_id, "w0", 55, 70) == 30
    assert store.mark_durable(region.region_id, "w0", 0, 10) == 30  # a retry changes nothing
    assert store.mark_durable(region.region_id, "w0", 10, 50) == 70
    (got,) = store.lookup("req", "w0")
    assert got.durable == (RowRange(0, 70),)
    assert store.stats().durable_bytes == 70 * 576


# -- allocation, capacity, release ------------------------------------------------------------


def test_allocate_returns_aligned_disjoint_regions(store: HostStore) -> None:
    a = store.allocate("r1", "w0", 0, 10, 100)
    b = store.allocate("r1", "w0", 1, 10, 100)
    c = store.allocate("r2", "w0", 0, 3, ALIGN)
    spans = sorted((x.offset, x.offset + x.nbytes) for x in (a, b, c))
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
    assert all(x.offset % ALIGN == 0 for x in (a, b, c))
    assert len({a.region_id, b.region_id, c.region_id}) == 3
    s = store.stats()
    assert (s.regions, s.requests, s.used_bytes) == (3, 2, 5 * ALIGN)
    assert [r.source for r in store.lookup("r1", "w0")] == [0, 1]


def test_capacity_exhaustion_names_requested_and_largest_free(store: HostStore) -> None:
    store.allocate("big", "w0", 0, 60, ALIGN)
    with pytest.raises(CapacityExhausted, match=r"requested 20480 bytes, largest free 16384") as e:
        store.allocate("r", "w0", 0, 5, ALIGN)
    assert (e.value.requested, e.value.largest_free) == (5 * ALIGN, 4 * ALIGN)
    with pytest.raises(CapacityExhausted, match="requested"):
        store.allocate("r", "w0", 0, 1, CAP + 1)  # larger than the whole arena
    s = store.stats()
    assert s.allocations_refused == 2
    assert s.requests == 1  # a refused allocation leaves no trace of its request


def test_allocate_many_is_all_or_nothing(store: HostStore) -> None:
    """A request's regions in one call, in the order asked; when one does not fit, none of
    them is kept (the request holds what it held before) and the refusal names it."""
    specs = [RegionSpec(0, 8, ALIGN), RegionSpec(1, 4, ALIGN), RegionSpec(-2, 1, 100)]
    got = store.allocate_many("r", "w0", specs)
    assert [(g.source, g.num_rows, g.row_bytes) for g in got] == [
        (0, 8, ALIGN),
        (1, 4, ALIGN),
        (-2, 1, 100),
    ]
    assert len({g.offset for g in got}) == 3
    assert sorted(r.region_id for r in store.lookup("r", "w0")) == sorted(g.region_id for g in got)
    used = store.stats().used_bytes
    too_many = [RegionSpec(2, 16, ALIGN), RegionSpec(3, 64, ALIGN)]  # the second cannot fit
    with pytest.raises(CapacityExhausted, match=f"{64} rows x {ALIGN} B"):
        store.allocate_many("r", "w0", too_many)
    with pytest.raises(CapacityExhausted):
        store.allocate_many("fresh", "w0", too_many)
    s = store.stats()
    assert (s.used_bytes, s.regions, s.requests) == (used, 3, 1)  # "fresh" left no trace
    with pytest.raises(InvalidArgument, match="num_rows"):
        store.allocate_many("r", "w0", [RegionSpec(0, 1, 1), RegionSpec(1, 0, 1)])
    with pytest.raises(InvalidArgument, match="no regions"):
        store.allocate_many("r", "w0", [])
    with pytest.raises(PermissionDenied):
        store.allocate_many("r", "w1", specs[:1])
    assert store.stats().regions == 3


def test_release_frees_capacity(store: HostStore) -> None:
    regions = [store.allocate("r", "w0", src, 16, ALIGN) for src in range(4)]
    with pytest.raises(CapacityExhausted):
        store.allocate("other", "w0", 0, 1, 1)
    one = store.release("w0", region_id=regions[0].region_id)
    assert (one.released, one.bytes_freed) == (1, 16 * ALIGN)
    store.mark_durable(regions[1].region_id, "w0", 0, 16)
    rest = store.release("w0", request_id="r")
    assert (rest.released, rest.bytes_freed) == (3, 48 * ALIGN)
    s = store.stats()
    assert (s.used_bytes, s.regions, s.requests, s.durable_bytes) == (0, 0, 0, 0)
    assert s.largest_free_bytes == CAP
    store.allocate("whole", "w0", 0, 1, CAP)  # the arena coalesced back into one range
    with pytest.raises(NotFound):
        store.lookup("r", "w0")
    with pytest.raises(NotFound):
        store.release("w0", region_id=regions[1].region_id)


# -- isolation -----------------------------------------------------------------------------------


def test_other_owner_is_denied_everything(store: HostStore) -> None:
    region = store.allocate("req", "w0", 0, 8, 64)
    with pytest.raises(PermissionDenied, match="owned by 'w0', not 'w1'"):
        store.mark_durable(region.region_id, "w1", 0, 1)
    with pytest.raises(PermissionDenied):
        store.lookup("req", "w1")
    with pytest.raises(PermissionDenied):
        store.release("w1", region_id=region.region_id)
    with pytest.raises(PermissionDenied):
        store.release("w1", request_id="req")
    with pytest.raises(PermissionDenied):
        store.allocate("req", "w1", 1, 8, 64)  # nor may it add regions to the request
    assert store.lookup("req", "w0")[0].durable == ()
    assert store.stats().regions == 1


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", "w0", 0, 1, 1), "request_id"),
        (("r", "", 0, 1, 1), "owner"),
        (("r", "w0", 0, 0, 1), "num_rows"),
        (("r", "w0", 0, -3, 1), "num_rows"),
        (("r", "w0", 0, 1, 0), "row_bytes"),
        (("r", "w0", 2**31, 1, 1), "source"),
        (("r", "w0", 0, 1.5, 1), "num_rows"),
        (("r", "w0", 0, True, 1), "num_rows"),
        (("x" * 300, "w0", 0, 1, 1), "request_id"),
    ],
)
def test_allocate_rejects_bad_arguments(store: HostStore, args: tuple, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        store.allocate(*args)


def test_mark_durable_rejects_ranges_outside_the_region(store: HostStore) -> None:
    region = store.allocate("r", "w0", 0, 10, 64)
    for start, end in [(5, 5), (6, 5), (-1, 3), (0, 11), (10, 12)]:
        with pytest.raises(InvalidArgument):
            store.mark_durable(region.region_id, "w0", start, end)
    with pytest.raises(NotFound):
        store.mark_durable("no-such-region", "w0", 0, 1)
    with pytest.raises(InvalidArgument, match="region_id"):
        store.mark_durable("", "w0", 0, 1)


def test_release_needs_exactly_one_target(store: HostStore) -> None:
    region = store.allocate("r", "w0", 0, 10, 64)
    with pytest.raises(InvalidArgument, match="exactly one"):
        store.release("w0")
    with pytest.raises(InvalidArgument, match="exactly one"):
        store.release("w0", request_id="r", region_id=region.region_id)
    with pytest.raises(InvalidArgument, match="exactly one"):
        store.release("w0", request_id="", region_id="")
    with pytest.raises(InvalidArgument, match="owner"):
        store.release("", region_id=region.region_id)


# -- concurrency ---------------------------------------------------------------------------------


def test_concurrent_owners_never_share_bytes() -> None:
    store = HostStore(1024 * ALIGN, ALIGN)
    errors: list[BaseException] = []

    def worker(owner: str, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(300):
                req = f"{owner}-{i % 7}"
                try:
                    region = store.allocate(req, owner, rng.randrange(4), rng.randint(1, 50), 512)
                    store.mark_durable(region.region_id, owner, 0, region.num_rows)
                except CapacityExhausted:
                    pass
                if rng.random() < 0.3:
                    with contextlib.suppress(NotFound):
                        store.release(owner, request_id=req)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(f"w{i}", i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    regions = [r for w in range(4) for i in range(7) for r in _lookup_or_empty(store, w, i)]
    spans = sorted((r.offset, r.offset + r.nbytes) for r in regions)
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
    s = store.stats()
    assert s.regions == len(regions)
    assert s.durable_bytes == sum(r.nbytes for r in regions)


def _lookup_or_empty(store: HostStore, w: int, i: int) -> list:
    try:
        return store.lookup(f"w{w}-{i}", f"w{w}")
    except NotFound:
        return []
