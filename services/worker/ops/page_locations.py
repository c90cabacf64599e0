"""A paged pool's locations of (slot, row) pairs in one kernel (``page_locations_kernel.py``),
in place of the torch form's clamp, divisions, table gather and select
(``page_locations_ref``): the same int64 locations, exactly."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.page_locations_kernel import page_locations_kernel

BLOCK = 1024


def _slots_for(slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``slots`` shaped to broadcast against ``rows``: [N] against rows [N, ...] gains trailing
    unit dims; a tensor of rows' shape is used as it is."""
    if slots.dim() < rows.dim():
        return slots.view(*slots.shape, *([1] * (rows.dim() - slots.dim())))
    return slots


def page_locations_ref(
    table: torch.Tensor, page: int, slots: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """table [slots, pages] int64 (-1: no page), slots [N] (or rows' shape), rows [N, ...]
    (``-1``: none) -> locations of rows' shape, ``-1`` where rows are."""
    r = rows.clamp(min=0)
    loc = table[_slots_for(slots, rows), r // page] * page + r % page
    return torch.where(rows >= 0, loc, torch.full_like(loc, -1))


def page_locations(
    table: torch.Tensor, page: int, slots: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``page_locations_ref``, one launch of static shape (capturable)."""
    if rows.dim() == 0 or slots.dim() not in (1, rows.dim()) or slots.shape[0] != rows.shape[0]:
        raise ValueError(f"slots {tuple(slots.shape)} do not index rows {tuple(rows.shape)}")
    if slots.dim() == rows.dim() and slots.shape != rows.shape:
        raise ValueError(f"slots {tuple(slots.shape)} and rows {tuple(rows.shape)} disagree")
    out = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
    m = rows.numel()
    if m == 0:
        return out
    per = 1 if slots.dim() == rows.dim() else m // rows.shape[0]
    grid = (triton.cdiv(m, BLOCK),)
    page_locations_kernel[grid](
        table, table.stride(0),
        slots.contiguous(), rows.contiguous(), out,
        m, per,
        PAGE=page, BLOCK=BLOCK,
    )  # fmt: skip
    return out
