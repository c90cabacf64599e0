"""Where optional pages' rows live, and publishing them: the tensors behind residency's page
moves. Every move handles a batch of pages in one copy (one launch, one completion ticket)
and one map write per source."""

from __future__ import annotations

import torch

from services.worker.kv.residency.pages import OptPage
from services.worker.kv.transfers import to_device


def page_rows(payload, pgs: list[OptPage]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device store rows, host arena element offsets) of every row of ``pgs``."""
    p, dev = payload.page, payload.device
    meta = to_device([(pg.page, pg.slot, pg.source, pg.index) for pg in pgs], dev)
    offs = torch.arange(p, device=dev)
    rows = (meta[:, 0:1] * p + offs).reshape(-1)
    base = payload.host.base[meta[:, 1], meta[:, 2]]  # element base of each region
    host = (base.unsqueeze(1) + (meta[:, 3:4] * p + offs) * payload.store.shape[1]).reshape(-1)
    return rows, host


def publish(payload, pgs: list[OptPage], hide: bool = False) -> None:
    """Sets (or, with ``hide``, clears) the pages in their slots' optional maps."""
    by_source: dict[int, list[OptPage]] = {}
    for pg in pgs:
        by_source.setdefault(pg.source, []).append(pg)
    for source, group in by_source.items():
        slots, index, value = to_device(
            [
                [pg.slot for pg in group],
                [pg.index for pg in group],
                [-1 if hide else pg.page for pg in group],
            ],
            payload.device,
        )
        payload.geo[source].opt_map[slots, index] = value.to(torch.int32)


def import_pages(
    payload, source: int, slot: int, first: int, pages: list[int], src: torch.Tensor
) -> None:
    """Resident-first: copies a prefill's rows (at device locations ``src``) of history pages
    ``first ..`` into the physical ``pages`` in one copy, and publishes them (the map write is
    stream-ordered after the copy)."""
    p, dev = payload.page, payload.device
    phys = to_device(pages, dev)
    payload.store[(phys.unsqueeze(1) * p + torch.arange(p, device=dev)).reshape(-1)] = (
        payload.store[src]
    )
    payload.geo[source].opt_map[slot, first : first + len(pages)] = phys.to(torch.int32)
