"""Where the store places a new region: the placement policy, apart from the allocator that
carries it out.

A GPU reads scattered host rows at a rate set by the footprint the reads span, not by the
kernel, nor by the host's page size (ENVIRONMENT.md beside the repository, and the host-layout
runs in docs/results/archive/). One resolver launch reads one KV source's rows
of the requests one worker decodes, so those regions should lie together, and away from the
other sources' regions, the other workers' and the session state. Policies:

- ``packed``: best fit over the whole arena (``Allocator``). On a fresh arena a request's
  regions of every source end up side by side, so one source's regions of a batch are strided
  by a request's whole footprint.
- ``grouped``: regions of one *group* (the store uses (owner, source)) are packed into that
  group's *extents*, ``extent_bytes`` ranges taken from the arena by best fit and given back
  when their last region goes. A launch then reads from about its group's live bytes. When
  no extent of the group has room and the arena has no free extent left, the region goes into
  any extent with room: grouping never refuses what ``packed`` would place.
- ``scattered``: each region at a uniformly random free slot of its size: the spread a
  long-running, fragmented arena reaches, to measure against.

Every policy keeps one region one contiguous range (DESIGN §3) and never moves a region, so
durability and adoption (which only change who owns a region) are the same under each.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from services.kv_host_store.allocator import Allocator

PLACEMENTS = ("packed", "grouped", "scattered")


class RegionAllocator(Protocol):
    """What the store needs of an allocator (``Allocator`` and the policies below)."""

    @property
    def capacity(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def free_bytes(self) -> int: ...
    def aligned_size(self, nbytes: int) -> int: ...
    def largest_free(self) -> int: ...
    def allocate(self, nbytes: int, group: Hashable = None) -> int | None: ...
    def free(self, offset: int) -> int: ...
    def allocations(self) -> list[tuple[int, int]]: ...


@dataclass(frozen=True)
class Placement:
    """The placement policy of a store's arena (see the module docstring)."""

    kind: str = "packed"
    extent_bytes: int = 256 << 20  # grouped: one group's extent
    seed: int = 0  # scattered: the positions' random stream

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.kind!r}; choose one of {PLACEMENTS}")
        if self.extent_bytes <= 0:
            raise ValueError(f"extent_bytes must be positive, got {self.extent_bytes}")

    def allocator(self, capacity: int, alignment: int) -> RegionAllocator:
        if self.kind == "grouped":
            return GroupedAllocator(capacity, alignment, self.extent_bytes)
        if self.kind == "scattered":
            return ScatteredAllocator(capacity, alignment, self.seed)
        return Allocator(capacity, alignment)


class ScatteredAllocator(Allocator):
    """Each allocation at a uniformly random free slot of its own size (slots: multiples of
    the aligned size, so that equal regions never leave holes too small for each other); best
    fit when no such slot is free."""

    def __init__(self, capacity: int, alignment: int = 4096, seed: int = 0) -> None:
        super().__init__(capacity, alignment)
        self._rng = random.Random(seed)

    def allocate(self, nbytes: int, group: Hashable = None) -> int | None:
        need = self.checked_size(nbytes)
        # Slots a free block offers: the multiples of ``need`` it holds whole.
        fits = []
        for start, size in self.free_blocks():
            first = -(-start // need)
            n = (start + size) // need - first
            if n > 0:
                fits.append((first, n))
        total = sum(n for _, n in fits)
        if total == 0:
            return super().allocate(need)
        pick = self._rng.randrange(total)
        for first, n in fits:
            if pick < n:
                offset = (first + pick) * need
                taken = self.allocate_at(offset, need)
                assert taken
                return offset
            pick -= n
        raise AssertionError("unreachable")


@dataclass
class _Extent:
    offset: int
    space: Allocator  # offsets relative to the extent
    group: Hashable


class GroupedAllocator:
    """Regions packed into the extents of their group (see the module docstring).

    Invariants: extents are live ranges of ``outer``, never overlapping; every live region
    lies inside exactly one extent; an extent with no region is given back at once."""

    def __init__(self, capacity: int, alignment: int, extent_bytes: int) -> None:
        self.outer = Allocator(capacity, alignment)
        self.extent_bytes = self.outer.aligned_size(extent_bytes)
        self._groups: dict[Hashable, list[_Extent]] = {}  # by offset
        self._extent_of: dict[int, _Extent] = {}  # region offset -> its extent
        self._live: dict[int, int] = {}  # region offset -> aligned size
        self._used = 0

    @property
    def capacity(self) -> int:
        return self.outer.capacity

    @property
    def alignment(self) -> int:
        return self.outer.alignment

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    def aligned_size(self, nbytes: int) -> int:
        return self.outer.aligned_size(nbytes)

    def largest_free(self) -> int:
        inside = (e.space.largest_free() for es in self._groups.values() for e in es)
        return max(self.outer.largest_free(), max(inside, default=0))

    def extents(self, group: Hashable) -> list[tuple[int, int]]:
        """``(offset, size)`` of the group's extents, by offset."""
        return [(e.offset, e.space.capacity) for e in self._groups.get(group, [])]

    def allocate(self, nbytes: int, group: Hashable = None) -> int | None:
        need = self.outer.checked_size(nbytes)
        ext = self._room(self._groups.get(group, []), need) or self._new_extent(group, need)
        if ext is None:  # the arena has no free extent left: any extent with room will do
            ext = self._room([e for es in self._groups.values() for e in es], need)
        if ext is None:
            return None
        rel = ext.space.allocate(need)
        assert rel is not None
        offset = ext.offset + rel
        self._extent_of[offset] = ext
        self._live[offset] = need
        self._used += need
        return offset

    @staticmethod
    def _room(extents: list[_Extent], need: int) -> _Extent | None:
        """The lowest extent that fits ``need`` bytes: reads stay low and together."""
        return next((e for e in extents if e.space.largest_free() >= need), None)

    def _new_extent(self, group: Hashable, need: int) -> _Extent | None:
        size = max(self.extent_bytes, need)
        offset = self.outer.allocate(size)
        if offset is None and size > need:
            size = need  # room for the region alone, in an extent of its own
            offset = self.outer.allocate(size)
        if offset is None:
            return None
        ext = _Extent(offset, Allocator(size, self.alignment), group)
        extents = self._groups.setdefault(group, [])
        extents.append(ext)
        extents.sort(key=lambda e: e.offset)
        return ext

    def free(self, offset: int) -> int:
        size = self._live.pop(offset, None)
        if size is None:
            raise ValueError(f"no live allocation at offset {offset}")
        ext = self._extent_of.pop(offset)
        ext.space.free(offset - ext.offset)
        self._used -= size
        if ext.space.used_bytes == 0:
            self.outer.free(ext.offset)
            extents = self._groups[ext.group]
            extents.remove(ext)
            if not extents:
                del self._groups[ext.group]
        return size

    def allocations(self) -> list[tuple[int, int]]:
        """``(offset, aligned size)`` of every live region, by offset."""
        return sorted(self._live.items())
