"""The resolver, plain torch: the reference the Triton kernel is checked against.

For one source and the whole batch it turns selected row positions into pool locations:
(1) rows in the chunk, the tail ring or a ready optional-history page resolve directly; (2) the rest look up the hot cache —
hits are stamped with this call's tick, which also protects them from eviction in this call;
(3) misses take the least recently used unprotected entries (empty ones first), evicting what
those held, and are copied from the host backup; when a verification round's union outgrows the
unprotected entries, the overflow goes to the request's staging rows for this call (eq. 11); a request's queries
(several when verifying a speculative block) are served in order, so a row missed by one query
is copied once and hits for the next. Locations come back in selection order."""

from __future__ import annotations

import torch

from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.hot_cache import HotCache
from services.worker.hierarchy.plan import ChunkPlan
from services.worker.hierarchy.staging import StagingOverflow


def resolve_ref(
    sel: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    plan: ChunkPlan,
    geo: SourceGeometry,
    hot: HotCache,
    clock: int | torch.Tensor,
    pool: torch.Tensor,
    host: torch.Tensor,
    host_base: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sel: [N, k] row positions (-1 pads) of the batch's query tokens, request r owning tokens
    cu[r]..cu[r+1] (cu: [R + 1] int64); slots: [R]; pool: [P, d] device rows; host: flat typed host arena;
    host_base: [max_slots] element offset of each slot's region for this source.
    Returns locations [N, k] int64 (-1 kept) and the census tensor; updates ``hot`` and
    ``pool``."""
    d = pool.shape[1]
    locs = torch.full_like(sel, -1)
    cu = cu.tolist()
    direct_n = hot_n = host_n = copied = 0
    for r in range(len(cu) - 1):
        a, b = cu[r], cu[r + 1]
        slot = int(slots[r])
        rows = sel[a:b]
        valid = rows >= 0
        req = torch.full_like(rows, r)
        direct, dloc = geo.direct(rows, req, slots, plan)
        cand = valid & ~direct
        h = hot.map[slot, rows.clamp(min=0)].long()
        hit = cand & (h >= 0)
        hot.stamp[slot, h[hit]] = clock
        direct_n += int(direct.sum())
        hot_n += int(hit.sum())
        host_n += int((cand & ~hit).sum())
        staged = 0  # staging rows used by this request in this call
        for j in range(b - a):
            miss = cand[j] & (hot.map[slot, rows[j].clamp(min=0)] == -1)
            mrows = rows[j][miss]
            m = mrows.numel()
            if m == 0:
                continue
            lru = hot.lru[slot].long()
            protected = hot.stamp[slot, lru] == clock
            free = lru[~protected]
            take = min(m, free.numel())
            over = mrows[take:]
            mrows = mrows[:take]
            if over.numel():
                # The round's union outgrew the hot cache: the overflow is served from the
                # request's staging rows for this call only (eq. 11); it never enters the cache.
                if staged + over.numel() > geo.stage_rows:
                    raise StagingOverflow(
                        f"{staged + over.numel()} rows overflow the hot cache of slot {slot}; "
                        f"staging holds {geo.stage_rows}"
                    )
                idx = torch.arange(staged, staged + over.numel(), device=sel.device)
                hot.map[slot, over] = (-2 - idx).to(hot.map.dtype)
                src = host_base[slot].item() + over.cpu().unsqueeze(1) * d + torch.arange(d)
                pool[geo.stage_loc(torch.full_like(idx, slot), idx)] = host[src].to(pool.device)
                staged += over.numel()
                copied += over.numel()
            if take == 0:
                continue
            victims = free[:take]  # the least recently used unselected entries, in LRU order
            old = hot.rows[slot, victims].long()
            hot.map[slot, old[old >= 0]] = -1
            hot.map[slot, mrows] = victims.to(hot.map.dtype)
            hot.rows[slot, victims] = mrows.to(hot.rows.dtype)
            hot.stamp[slot, victims] = clock
            # Untouched entries keep their order; used ones (earlier hits, then these) go last.
            hot.lru[slot] = torch.cat([free[take:], lru[protected], victims]).to(hot.lru.dtype)
            src = host_base[slot].item() + mrows.cpu().unsqueeze(1) * d + torch.arange(d)
            pool[geo.hot_loc(torch.full_like(victims, slot), victims)] = host[src].to(pool.device)
            copied += take
        # Hits move to the most recent end too (in their LRU order).
        lru = hot.lru[slot].long()
        used = hot.stamp[slot, lru] == clock
        hot.lru[slot] = torch.cat([lru[~used], lru[used]]).to(hot.lru.dtype)
        entry = hot.map[slot, rows.clamp(min=0)].long()
        slot_t = torch.full_like(rows, slot)
        hloc = geo.hot_loc(slot_t, entry.clamp(min=0))
        sloc = geo.stage_loc(slot_t, (-2 - entry).clamp(min=0))
        hloc = torch.where(entry <= -2, sloc, hloc)
        locs[a:b] = torch.where(direct, dloc, torch.where(valid, hloc, -1))
        staged_rows = rows[valid & ~direct & (entry <= -2)]
        hot.map[slot, staged_rows] = -1  # staging lasts for this call only
    census = torch.tensor([direct_n, hot_n, host_n, copied], dtype=torch.int64)
    return locs, census.to(sel.device)
