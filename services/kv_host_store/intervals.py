"""Merged, sorted row intervals: the durable rows of a region.

MarkDurable calls can arrive out of order and overlap (copies complete in any order, retries
repeat); keeping the set merged makes "is row s durable" and the durable count cheap.
"""

from __future__ import annotations

from services.kv_host_store.records import RowRange


def add_range(ranges: tuple[RowRange, ...], start: int, end: int) -> tuple[RowRange, ...]:
    """``ranges ∪ [start, end)``, merged: sorted, disjoint, and no two touching.

    ``ranges`` must already be merged (the invariant this function keeps); ``start < end``.
    """
    if start >= end:
        raise ValueError(f"empty range [{start}, {end})")
    if ranges and ranges[-1].start <= start:  # at or after the last range: every step's rows
        last = ranges[-1]
        if start > last.end:
            return (*ranges, RowRange(start, end))
        if end <= last.end:
            return ranges
        return (*ranges[:-1], RowRange(last.start, end))
    out: list[RowRange] = []
    placed = False
    for r in ranges:
        if r.end < start:  # wholly before, not touching
            out.append(r)
        elif r.start > end:  # wholly after, not touching
            if not placed:
                out.append(RowRange(start, end))
                placed = True
            out.append(r)
        else:  # overlaps or touches: absorb it
            start, end = min(start, r.start), max(end, r.end)
    if not placed:
        out.append(RowRange(start, end))
    return tuple(out)


def covered(ranges: tuple[RowRange, ...]) -> int:
    """Rows covered by merged ``ranges``."""
    return sum(r.rows for r in ranges)


def contains(ranges: tuple[RowRange, ...], start: int, end: int) -> bool:
    """Whether every row of ``[start, end)`` lies in merged ``ranges``."""
    return any(r.start <= start and end <= r.end for r in ranges)
