"""The tail (DESIGN §3): per request and source, the newest rows in a ring of T rows.

Row s of a source lives at ring slot ``s mod T`` (``SourceGeometry.ring_loc``); T is one page
plus a verification block, rounded up to whole pages, so a decode step or a verify round of
K_max queries writes its rows there and they resolve directly for as long as nothing later
overwrote their slot. A slot's *ring history* ``tail_hi`` is one past the highest row ever
written to its ring: rows ``>= tail_hi - T`` are valid there, even after a verify round wrote
rows it did not commit. A prefill chunk longer than T goes to scratch instead; its newest T
rows then enter the ring at commit (``keep_newest``). An adopted session's ring is refilled
from its host backup (``refill``). The tail is required memory: never reclaimed, never lent."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.host_backup import HostBackups


def tail_rows(page: int, block: int) -> int:
    """T: one page plus a verification block of ``block`` rows, in whole pages."""
    return -(-(page + block) // page) * page


def keep_newest(
    rows: torch.Tensor,
    geo: SourceGeometry,
    slot: int,
    span: tuple[int, int],
    locations: Callable[[int, int], torch.Tensor],
) -> None:
    """After a scratch chunk of ``span`` = rows [lo, new) of one source: copies its newest (at
    most T) rows into the slot's ring. ``locations(a, b)``: where the chunk's rows [a, b) are
    in ``rows`` (the device store)."""
    lo, new = span
    first = max(lo, new - geo.ring)
    keep = torch.arange(first, new, device=rows.device)
    rows[geo.ring_loc(torch.full_like(keep, slot), keep)] = rows[locations(first, new)]


def refill(
    rows: torch.Tensor, geo: SourceGeometry, host: HostBackups, slot: int, source: int, end: int
) -> None:
    """Fills the ring of an adopted slot's ``source`` with its rows below ``end`` (at most T)
    from their host backups."""
    ring = torch.arange(max(0, end - geo.ring), end, device=rows.device)
    if len(ring):
        backup = host.rows_view(slot, source, int(ring[0]), end)
        rows[geo.ring_loc(torch.full_like(ring, slot), ring)] = backup.to(rows.device)
