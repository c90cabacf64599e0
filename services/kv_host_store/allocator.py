"""Byte ranges of the host arena: best-fit over a sorted, coalesced free list.

Pure Python and unlocked (the store serializes calls). One allocation is always one contiguous
range: a request's rows of one source must lie together so that a step's host misses fall in
a few windows (DESIGN §3: scattered reads over a huge arena run at a third of the bulk rate).
Where the ranges go relative to each other is a placement policy (``placement.py``); this
allocator is its mechanism, and on its own the ``packed`` policy.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Hashable


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Allocator:
    """Allocates aligned byte ranges of ``[0, capacity)``.

    Invariants: free blocks are sorted by offset, never overlap and never touch (a freed range
    merges with free neighbours); free blocks and live allocations tile ``[0, capacity)``
    exactly; every offset and every size is a multiple of ``alignment``. Best fit (ties: lowest
    offset) keeps large holes whole for large requests.
    """

    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        if not _is_power_of_two(alignment):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity <= 0 or capacity % alignment:
            raise ValueError(
                f"capacity must be a positive multiple of the alignment {alignment}, got {capacity}"
            )
        self._capacity = capacity
        self._alignment = alignment
        self._free_starts: list[int] = [0]  # sorted offsets of free blocks
        self._free_sizes: dict[int, int] = {0: capacity}  # free block offset -> size
        self._live: dict[int, int] = {}  # allocation offset -> aligned size
        self._used = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    def aligned_size(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment: what an allocation of ``nbytes`` consumes."""
        a = self._alignment
        return (nbytes + a - 1) // a * a

    def largest_free(self) -> int:
        """Size of the largest free block: the largest allocation that succeeds now."""
        return max(self._free_sizes.values(), default=0)

    def allocate(self, nbytes: int, group: Hashable = None) -> int | None:
        """Offset of a new contiguous range of at least ``nbytes`` bytes, or ``None`` when no
        free block is large enough (fragmentation included). ``nbytes`` must be positive.
        ``group`` (the placement class, ``placement.py``) does not change best fit."""
        need = self.checked_size(nbytes)
        best_i, best_size = -1, 0
        for i, start in enumerate(self._free_starts):
            size = self._free_sizes[start]
            if size >= need and (best_i < 0 or size < best_size):
                best_i, best_size = i, size
                if size == need:
                    break
        if best_i < 0:
            return None
        start = self._free_starts[best_i]
        del self._free_sizes[start]
        if best_size == need:
            del self._free_starts[best_i]
        else:
            # The remainder stays at the same list position: it still precedes the next block.
            self._free_starts[best_i] = start + need
            self._free_sizes[start + need] = best_size - need
        self._live[start] = need
        self._used += need
        return start

    def checked_size(self, nbytes: int) -> int:
        """``aligned_size`` of a positive ``nbytes``; raises ``ValueError`` otherwise."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        return self.aligned_size(nbytes)

    def allocate_at(self, offset: int, nbytes: int) -> bool:
        """Takes ``[offset, offset + aligned nbytes)`` when it lies inside one free block
        (``offset`` aligned); False, changing nothing, otherwise."""
        need = self.checked_size(nbytes)
        if offset % self._alignment:
            raise ValueError(f"offset {offset} is not a multiple of {self._alignment}")
        i = bisect_right(self._free_starts, offset) - 1
        if i < 0:
            return False
        start = self._free_starts[i]
        size = self._free_sizes[start]
        if offset + need > start + size:
            return False
        del self._free_sizes[start]
        del self._free_starts[i]
        end = start + size
        pieces = [(s, e) for s, e in ((start, offset), (offset + need, end)) if e > s]
        for j, (s, e) in enumerate(pieces):
            self._free_starts.insert(i + j, s)
            self._free_sizes[s] = e - s
        self._live[offset] = need
        self._used += need
        return True

    def free(self, offset: int) -> int:
        """Returns the allocation at ``offset`` to the free list, merging it with free
        neighbours; returns the bytes freed. Raises ``ValueError`` for an offset that is not a
        live allocation (double free)."""
        size = self._live.pop(offset, None)
        if size is None:
            raise ValueError(f"no live allocation at offset {offset}")
        self._used -= size
        i = bisect_left(self._free_starts, offset)
        start, end = offset, offset + size
        if i < len(self._free_starts) and self._free_starts[i] == end:  # merge the next block
            end += self._free_sizes.pop(end)
            del self._free_starts[i]
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_sizes[prev] == start:  # merge into the previous block
                self._free_sizes[prev] = end - prev
                return size
        self._free_starts.insert(i, start)
        self._free_sizes[start] = end - start
        return size

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block, by offset."""
        return [(s, self._free_sizes[s]) for s in self._free_starts]

    def allocations(self) -> list[tuple[int, int]]:
        """``(offset, aligned size)`` of every live allocation, by offset."""
        return sorted(self._live.items())
