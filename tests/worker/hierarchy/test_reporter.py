"""The durability reporter: marks reach a real (in-process) host store in order, merged per
region over its interval, so a region costs one store call per interval, not one per pass."""

from __future__ import annotations

from services.kv_host_store.errors import NotFound
from services.kv_host_store.records import RowRange
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.hierarchy.reporter import DurabilityReporter, OwnerId


class Counting:
    """Forwards to the store and counts the calls that reach it."""

    def __init__(self, store: LocalHostStore) -> None:
        self.store = store
        self.marks: list[tuple[str, int, int]] = []

    def mark_durable(self, region_id, owner, start, end, generation=0):
        self.marks.append((region_id, start, end))
        return self.store.mark_durable(region_id, owner, start, end, generation)

    def release_region(self, owner, region_id, generation=0):
        return self.store.release_region(owner, region_id, generation)


def test_marks_coalesce_per_region_and_interval() -> None:
    store = LocalHostStore(1 << 20)
    try:
        regions = [store.allocate("req", "w", s, 256, 64) for s in range(3)]
        counting = Counting(store)
        rep = DurabilityReporter(counting, OwnerId("w"), interval=0.2)
        # a pass commits one row of every source, 100 passes in a row (out of order in part)
        for row in [*range(50, 100), *range(50)]:
            for r in regions:
                rep.report(r.region_id, row, row + 1)
        rep.flush()
        assert len(counting.marks) <= 2 * len(regions), counting.marks  # not 300 calls
        for r in store.lookup("req", "w"):
            assert r.durable == (RowRange(0, 100),)
        # a release drops the region's pending marks and reaches the store after earlier ones
        rep.report(regions[0].region_id, 100, 120)
        rep.release(regions[0].region_id)
        rep.report(regions[1].region_id, 100, 120)
        rep.flush()
        left = {r.region_id: r.durable for r in store.lookup("req", "w")}
        assert regions[0].region_id not in left
        assert left[regions[1].region_id] == (RowRange(0, 120),)
        rep.close()
    finally:
        store.close()


def test_a_release_is_not_held_back_by_the_marks_interval() -> None:
    """Only marks wait to be merged: a release queued behind them reaches the store at once
    (a finished session must not stay adoptable for a successor), in order after them."""
    import time

    store = LocalHostStore(1 << 20)
    try:
        region = store.allocate("req", "w", 0, 16, 64)
        rep = DurabilityReporter(Counting(store), OwnerId("w"), interval=5.0)
        rep.report(region.region_id, 0, 4)
        rep.release(region.region_id)

        def released() -> bool:
            try:
                store.lookup("req", "w")
            except NotFound:
                return True
            return False

        t0 = time.monotonic()
        while not released() and time.monotonic() - t0 < 2.0:
            time.sleep(0.01)
        assert released(), "the release waited for the marks' interval"
        rep.close()
    finally:
        store.close()


def test_a_region_state_supersedes_its_pending_marks() -> None:
    """A decode step reports each region's whole durable state; the last state of an interval
    is what reaches the store, in one call per range."""
    store = LocalHostStore(1 << 20)
    try:
        regions = [store.allocate("req", "w", s, 256, 64) for s in range(2)]
        counting = Counting(store)
        rep = DurabilityReporter(counting, OwnerId("w"), interval=0.2)
        rep.report(regions[0].region_id, 0, 3)
        for n in range(4, 60):
            rep.report_state([(r.region_id, (RowRange(0, n),)) for r in regions])
        rep.report_state([(regions[1].region_id, (RowRange(0, 60), RowRange(100, 110)))])
        rep.flush()
        assert len(counting.marks) <= 2 * 3, counting.marks  # not one call per step
        left = {r.region_id: r.durable for r in store.lookup("req", "w")}
        assert left[regions[0].region_id] == (RowRange(0, 59),)
        assert left[regions[1].region_id] == (RowRange(0, 60), RowRange(100, 110))
        rep.close()
    finally:
        store.close()
