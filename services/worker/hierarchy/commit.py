"""What a forward pass leaves behind once its tokens are final: host backups of the committed
rows (in adaptive mode, a prefill's complete pages may stay on the device instead, as optional
history) and the newest rows in each tail ring."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.transfers import to_device

if TYPE_CHECKING:
    from services.worker.hierarchy.payload import HierarchyPayload


def commit_pass(p: HierarchyPayload, batch: ForwardBatch, num_tokens: list[int]) -> None:
    """The first ``num_tokens[r]`` tokens of each request are final: their complete rows
    written by this pass are backed up to the host (in adaptive mode a prefill's complete
    pages may instead stay on the device as optional history, backup deferred), and the
    newest rows stay in the tail ring.

    Decode and verify passes (the common case) back up every request's and source's rows in
    one scatter; a prefill chunk takes the per-request path (optional history, ring)."""
    slots = list(batch.slot_ids)
    limit = [[-1] * len(slots) for _ in p.geo]  # rows < limit[s][r] go in the scatter
    marks = []
    whole = True  # every row this pass wrote is committed (a decode pass)
    for s, plan in enumerate(p.plans):
        committed = [p.rows_of_tokens(s, n) for n in num_tokens]
        whole = whole and committed == plan.hi
        for r, slot in enumerate(slots):
            lo, new = plan.lo[r], committed[r]
            if new <= lo:
                continue
            if plan.scratch[r] or (p.residency is not None and batch.starts[r] == 0):
                whole = False
                _commit_chunk(p, batch, r, slot, s, lo, new)
            else:
                limit[s][r] = new
                marks.append((slot, s, lo, new))
            p.committed[slot][s] = new
    p.host.mark_durable_many(marks)
    written = [(s, *w) for s, w in p.written.items() if max(limit[s]) >= 0]
    if not written:
        return
    src = torch.cat([torch.full_like(w[2], w[0]) for w in written])
    w_slots, rows, locs = (torch.cat([w[i] for w in written]) for i in (1, 2, 3))
    if whole and len(rows) <= len(p.all_rows):  # nothing left out: no mask, no host copy
        keep = p.all_rows[: len(rows)]
    else:
        limits = to_device(limit, p.device)
        keep = rows < limits[src, p.req_of_slot[w_slots]]
    dst = p.host.base[w_slots, src] + rows * p.store.shape[1]
    p.backup(p.store, locs, dst, keep, p.host.arena)


def _commit_chunk(
    p: HierarchyPayload, batch: ForwardBatch, r: int, slot: int, s: int, lo: int, new: int
) -> None:
    """Rows [lo, new) of request r's source s from a prefill chunk: kept as optional
    history or backed up, and the chunk's newest rows into the ring when it was in
    scratch."""
    geo, plan = p.geo[s], p.plans[s]

    def rows_at(a: int, b: int) -> torch.Tensor:
        rows = torch.arange(a, b, device=p.device)
        return geo.direct(rows, torch.full_like(rows, r), batch.slots, plan)[1]

    backup = [(lo, new)]
    if p.residency is not None and batch.starts[r] == 0:  # imported history
        backup = p.residency.keep_imported(slot, s, lo, new, rows_at)
    for a, b in backup:
        p.host.write(slot, s, a, p.store[rows_at(a, b)])
        p.host.mark_durable(slot, s, a, b)
    if plan.scratch[r]:  # the ring takes the chunk's newest rows
        p.ring_hi_of[slot][s] = new
        first = max(lo, new - p.ring)
        keep = torch.arange(first, new, device=p.device)
        ring = geo.ring_loc(torch.full_like(keep, slot), keep)
        p.store[ring] = p.store[rows_at(first, new)]
