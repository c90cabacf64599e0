"""What a forward pass leaves behind once its tokens are final: host backups of the committed
rows (in adaptive mode, a prefill's complete pages may stay on the device instead, as optional
history) and the newest rows in each tail ring."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dhisparse.family.config import ModelConfig
from services.worker.hierarchy import tail
from services.worker.hierarchy.device_store import DeviceStore
from services.worker.kv.pass_state import PassState
from services.worker.transfers import to_device

if TYPE_CHECKING:
    from services.worker.residency.residency import Residency


def commit_pass(
    cfg: ModelConfig,
    store: DeviceStore,
    state: PassState,
    residency: Residency | None,
    num_tokens: list[int],
    all_rows: torch.Tensor,
) -> None:
    """The first ``num_tokens[r]`` tokens of each request of ``state.batch`` are final: their
    complete rows written by this pass are backed up to the host (with ``residency``, a
    prefill's complete pages may instead stay on the device as optional history, backup
    deferred), and the newest rows stay in the tail ring.

    Decode and verify passes (the common case) back up every request's and source's rows in
    one scatter, ``keep`` = ``all_rows`` when every row they wrote is committed; a chunk in
    scratch, and with ``residency`` an imported chunk, takes the per-request path (optional
    history, ring). A prefill pass's plans span each request's rows from 0 (``prefill.py``):
    what it commits starts where its chunk does."""
    batch = state.batch
    assert batch is not None, "begin() the pass first"
    slots = list(batch.slot_ids)
    limit = [[-1] * len(slots) for _ in store.geo]  # rows < limit[s][r] go in the scatter
    marks = []
    whole = True  # every row this pass wrote is committed (a decode pass)
    for s, plan in enumerate(state.plans):
        committed = [cfg.rows_for_tokens(s, n) for n in num_tokens]
        whole = whole and committed == plan.hi
        for r, slot in enumerate(slots):
            lo, new = cfg.rows_for_tokens(s, batch.starts[r]), committed[r]
            if new <= lo:
                continue
            if plan.scratch[r] or (residency is not None and batch.imports(r)):
                whole = False
                _commit_chunk(store, state, residency, r, s, (lo, new))
            else:
                limit[s][r] = new
                marks.append((slot, s, lo, new))
            store.committed[slot][s] = new
    store.host.mark_durable_many(marks)
    written = [(s, *w) for s, w in state.written.items() if max(limit[s]) >= 0]
    if not written:
        return
    src = torch.cat([torch.full_like(w[2], w[0]) for w in written])
    w_slots, rows, locs = (torch.cat([w[i] for w in written]) for i in (1, 2, 3))
    if whole and len(rows) <= len(all_rows):  # nothing left out: no mask, no host copy
        keep = all_rows[: len(rows)]
    else:
        limits = to_device(limit, store.device)
        keep = rows < limits[src, state.req_of_slot()[w_slots]]
    dst = store.host.base[w_slots, src] + rows * store.row_elems
    store.backup(locs, dst, keep)


def _commit_chunk(
    store: DeviceStore,
    state: PassState,
    residency: Residency | None,
    r: int,
    s: int,
    span: tuple[int, int],
) -> None:
    """Rows ``span`` = [lo, new) of request r's source s from a prefill chunk: kept as optional
    history or backed up, and the chunk's newest rows into the ring when it was in scratch."""
    batch = state.batch
    assert batch is not None
    geo, plan = store.geo[s], state.plans[s]
    slot = batch.slot_ids[r]
    lo, new = span

    def rows_at(a: int, b: int) -> torch.Tensor:
        rows = torch.arange(a, b, device=store.device)
        return geo.direct(rows, torch.full_like(rows, r), batch.slots, plan)[1]

    backup = [(lo, new)]
    if residency is not None and batch.imports(r):  # imported history
        backup = residency.keep_imported(slot, s, lo, new, rows_at)
    for a, b in backup:
        store.host.write(slot, s, a, store.rows[rows_at(a, b)])
        store.host.mark_durable(slot, s, a, b)
    if plan.scratch[r]:  # the ring takes the chunk's newest rows
        store.tail_hi[slot][s] = new
        tail.keep_newest(store.rows, geo, slot, span, rows_at)
