"""The page-table lookup of a paged pool: ``loc = table[slot, row // PAGE] * PAGE + row % PAGE``
for each row (``-1`` rows map to ``-1``), the row's slot that of its group of ``PER`` rows
(see ``page_locations.py``, which launches it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_locations_kernel(
    table_ptr, stride_table,
    slot_ptr, row_ptr, out_ptr,
    M, PER,
    PAGE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    row = tl.load(row_ptr + offs, mask=mask, other=-1).to(tl.int64)
    slot = tl.load(slot_ptr + offs // PER, mask=mask, other=0).to(tl.int64)
    seen = mask & (row >= 0)
    r = tl.maximum(row, 0)
    page = tl.load(table_ptr + slot * stride_table + r // PAGE, mask=seen, other=0)
    loc = tl.where(seen, page * PAGE + r % PAGE, -1)
    tl.store(out_ptr + offs, loc, mask=mask)
