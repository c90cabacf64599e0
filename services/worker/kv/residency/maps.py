"""Where optional pages' rows live, and publishing them: the tensors behind residency's page
moves. Every move handles a batch of pages in one copy (one launch, one completion ticket)
and one map write per source."""

from __future__ import annotations

import torch

from services.worker.kv.residency.pages import OptPage


def page_rows(payload, pgs: list[OptPage]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device store rows, host arena element offsets) of every row of ``pgs``."""
    p, dev = payload.page, payload.device
    meta = torch.tensor(
        [(pg.page, pg.slot, pg.source, pg.index) for pg in pgs], dtype=torch.int64
    ).to(dev)
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
    dev = payload.device
    for source, group in by_source.items():
        slots = torch.tensor([pg.slot for pg in group], dtype=torch.int64)
        index = torch.tensor([pg.index for pg in group], dtype=torch.int64)
        value = torch.tensor([-1 if hide else pg.page for pg in group], dtype=torch.int32)
        payload.geo[source].opt_map[slots.to(dev), index.to(dev)] = value.to(dev)


def import_pages(
    payload, source: int, slot: int, first: int, pages: list[int], src: torch.Tensor
) -> None:
    """Resident-first: copies a prefill's rows (at device locations ``src``) of history pages
    ``first ..`` into the physical ``pages`` in one copy, and publishes them (the map write is
    stream-ordered after the copy)."""
    p, dev = payload.page, payload.device
    phys = torch.tensor(pages, dtype=torch.int64, device=dev)
    payload.store[(phys.unsqueeze(1) * p + torch.arange(p, device=dev)).reshape(-1)] = (
        payload.store[src]
    )
    payload.geo[source].opt_map[slot, first : first + len(pages)] = phys.to(torch.int32)
