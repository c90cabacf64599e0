"""A page pool's holders: slots (taken, then shared) and cached prefixes, each counted; a page
is free once nothing holds it, and pages only cached prefixes hold are counted apart (the
device prefix cache's reclaimable memory), given way to any take with a reclaim hook."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv.paged import PagedRows, PagePool


def test_a_page_is_free_once_no_slot_and_no_prefix_holds_it() -> None:
    pool = PagePool(6)
    a = pool.take(3)
    assert a == [0, 1, 2] and pool.free == 3
    pool.cache(a[:2])  # a prefix keeps the first two
    pool.share(a[:2])  # a second slot shares them
    pool.give(a)  # the first slot lets go: page 2 is free, 0 and 1 are still shared
    assert pool.free == 4 and pool.cached_only == 0
    pool.give(a[:2])  # the second slot lets go: the prefix alone holds them
    assert pool.free == 4 and pool.cached_only == 2
    pool.share(a[:1])  # a third slot takes the first page from the prefix
    assert pool.cached_only == 1
    pool.uncache(a[:2])  # the prefix is evicted: page 1 is free, page 0 still the slot's
    assert pool.free == 5 and pool.cached_only == 0
    pool.give(a[:1])
    assert pool.free == 6 and sorted(pool.take(6)) == list(range(6))


def test_a_free_page_cannot_be_shared_or_cached() -> None:
    pool = PagePool(2)
    with pytest.raises(RuntimeError, match="free"):
        pool.share([0])
    with pytest.raises(RuntimeError, match="no slot"):
        pool.cache([1])


def test_a_seated_slot_reads_the_shared_pages_and_grows_past_them() -> None:
    rows = PagedRows(8, 4, 2, max_slots=2, max_rows_per_slot=32, dtype=torch.float32, device="cpu")
    assert rows.ensure(0, 8)
    rows.write(torch.zeros(8, dtype=torch.long), torch.arange(8), torch.arange(16.0).view(8, 2))
    shared = rows.slot_pages(0, 2)
    rows.free_list.cache(shared)
    rows.release(0)
    assert rows.used_bytes == 0 and rows.cached_bytes == 8 * 2 * 4
    rows.seat(1, shared)
    assert rows.ensure(1, 12) and rows.slot_pages(1, 3)[:2] == shared
    got = rows.gather_padded(torch.tensor([1]), torch.tensor([8]), 8)[0]
    assert torch.equal(got, torch.arange(16.0).view(8, 2))
    assert rows.used_bytes == 3 * 4 * 2 * 4 and rows.cached_bytes == 0


def test_with_a_reclaim_hook_cached_pages_give_way_to_any_take() -> None:
    """Pages only cached prefixes hold are available; a take short of free pages drops
    prefixes (the hook, least recently used first in ``DeviceRecords``) until it has them;
    pages a slot still holds stay held."""
    pool = PagePool(6)
    a, b = pool.take(2), pool.take(2)
    pool.cache(a)
    pool.cache(b)
    pool.give(a)
    pool.give(b[:1])  # page b[1] is still a slot's
    prefixes = [a, b]

    def reclaim() -> bool:
        if not prefixes:
            return False
        pool.uncache(prefixes.pop(0))
        return True

    assert pool.free == 2 and pool.available == 2  # no hook: cached pages are not available
    pool.reclaim = reclaim
    assert pool.available == 5
    assert len(pool.take(5)) == 5 and prefixes == []  # both prefixes dropped for it
    assert pool.free == 0 and pool.cached_only == 0
    with pytest.raises(RuntimeError, match="1 pages asked, 0 free"):
        pool.take(1)


def test_a_take_drops_only_the_prefixes_it_needs() -> None:
    pool = PagePool(4)
    held = [pool.take(1) for _ in range(4)]
    for pages in held:
        pool.cache(pages)
        pool.give(pages)
    dropped: list[list[int]] = []

    def reclaim() -> bool:
        pages = held.pop(0)
        pool.uncache(pages)
        dropped.append(pages)
        return True

    pool.reclaim = reclaim
    assert sorted(pool.take(2)) == sorted(p for d in dropped for p in d) and len(dropped) == 2
    assert pool.cached_only == 2 and pool.available == 2
