from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kv_host_store.allocator import Allocator

ALIGN = 64


def check_invariants(a: Allocator) -> None:
    """Live and free blocks tile [0, capacity) exactly, aligned, free blocks never touching."""
    live = [(o, s, "live") for o, s in a.allocations()]
    free = [(o, s, "free") for o, s in a.free_blocks()]
    blocks = sorted(live + free)
    pos = 0
    for offset, size, _ in blocks:
        assert offset == pos, f"gap or overlap at {pos}: {blocks}"
        assert offset % a.alignment == 0 and size % a.alignment == 0 and size > 0
        pos += size
    assert pos == a.capacity
    for (o1, s1, k1), (_, _, k2) in itertools.pairwise(blocks):
        assert not (k1 == k2 == "free"), f"free blocks at {o1}+{s1} not coalesced"
    assert a.used_bytes == sum(s for _, s, _ in live)
    assert a.largest_free() == max((s for _, s, _ in free), default=0)


def test_allocations_are_aligned_and_contiguous() -> None:
    a = Allocator(1024, ALIGN)
    o1 = a.allocate(1)
    o2 = a.allocate(65)
    assert (o1, o2) == (0, 64)  # 1 byte takes one aligned unit, 65 take two
    assert a.used_bytes == 192
    check_invariants(a)


def test_refuses_when_no_contiguous_range_fits() -> None:
    a = Allocator(4 * ALIGN, ALIGN)
    offs = [a.allocate(ALIGN) for _ in range(4)]
    assert a.allocate(1) is None
    a.free(offs[0])
    a.free(offs[2])
    # Two units free but not adjacent: a two-unit allocation must not be split across them.
    assert a.free_bytes == 2 * ALIGN
    assert a.largest_free() == ALIGN
    assert a.allocate(2 * ALIGN) is None
    check_invariants(a)


def test_free_coalesces_both_neighbours() -> None:
    a = Allocator(3 * ALIGN, ALIGN)
    x, y, z = (a.allocate(ALIGN) for _ in range(3))
    a.free(x)
    a.free(z)
    a.free(y)
    assert a.free_blocks() == [(0, 3 * ALIGN)]


def test_best_fit_keeps_large_hole_whole() -> None:
    a = Allocator(10 * ALIGN, ALIGN)
    offs = [a.allocate(s * ALIGN) for s in (4, 1, 1, 1, 3)]
    a.free(offs[0])  # hole of 4 at 0
    a.free(offs[2])  # hole of 1 at 5
    assert a.allocate(ALIGN) == 5 * ALIGN  # the exact fit, not the front of the big hole
    assert a.allocate(4 * ALIGN) == 0


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        Allocator(1024, 48)
    with pytest.raises(ValueError, match="multiple"):
        Allocator(1000, 64)
    a = Allocator(1024, ALIGN)
    with pytest.raises(ValueError, match="positive"):
        a.allocate(0)
    off = a.allocate(10)
    assert off is not None
    a.free(off)
    with pytest.raises(ValueError, match="no live allocation"):
        a.free(off)  # double free
    with pytest.raises(ValueError, match="no live allocation"):
        a.free(64)  # never allocated


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(1, 9 * ALIGN), st.integers(0, 10**6)),
        max_size=120,
    )
)
def test_random_allocs_and_frees_keep_invariants(ops: list[tuple[bool, int, int]]) -> None:
    a = Allocator(64 * ALIGN, ALIGN)
    live: dict[int, int] = {}  # offset -> requested bytes
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            largest = a.largest_free()
            off = a.allocate(nbytes)
            if off is None:
                assert a.aligned_size(nbytes) > largest  # refused only when nothing fits
            else:
                assert off not in live
                live[off] = nbytes
        else:
            off = sorted(live)[pick % len(live)]
            assert a.free(off) == a.aligned_size(live.pop(off))
        check_invariants(a)
    for off in list(live):
        a.free(off)
    assert a.free_blocks() == [(0, a.capacity)]  # coalescing restores the whole arena
    assert a.used_bytes == 0


def test_many_random_operations_seeded() -> None:
    rng = random.Random(1234)
    a = Allocator(4096 * ALIGN, ALIGN)
    live: list[tuple[int, int]] = []
    for step in range(20_000):
        if live and rng.random() < 0.45:
            off, _ = live.pop(rng.randrange(len(live)))
            a.free(off)
        else:
            nbytes = rng.randint(1, 64 * ALIGN)
            off = a.allocate(nbytes)
            if off is not None:
                live.append((off, nbytes))
        if step % 1000 == 0:
            check_invariants(a)
            spans = sorted((o, o + n) for o, n in live)
            assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
    for off, _ in live:
        a.free(off)
    assert a.free_blocks() == [(0, a.capacity)]
