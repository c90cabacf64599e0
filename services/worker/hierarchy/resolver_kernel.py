"""The fused resolver kernel (DESIGN §3): one program per request resolves its queries'
selections for one source in one launch: (1) rows in the chunk, the tail ring or a ready
optional page resolve directly; (2) the rest look up the hot cache through its dense reverse
map, hits stamped (protected); (3) per query in order, misses take the least recently used
unprotected entries (a prefix of the LRU list, found with one cumulative sum) and are queued
for the copy kernel, overflow going to the request's staging rows for this call; a row missed
by an earlier query of the request is a hit for later ones, so each distinct row is copied
once. Then (4) the entries this call used move to the LRU list's recent end, (5) locations are
written in selection order and (6) staged rows leave the map. Launched by
``resolver_triton.launch_resolve``, whole or in two launches (``PHASE`` 1: steps 1-3, which
finish the copy queue; 2: steps 4-6, which read only what step 3 left in the hot cache and
touch no pool row, so the copy may run beside them); semantics are ``resolver.resolve_ref``'s.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def resolve_kernel(
    sel_ptr,  # [N, K] int64
    stride_sel,
    cu_ptr,  # [R + 1] int64
    slots_ptr,  # [R] int64
    ring_lo_ptr,  # [R] int64
    chunk_lo_ptr,  # [R] int64
    in_scr_ptr,  # [R] int64 (0/1)
    scr_off_ptr,  # [R] int64
    map_ptr,  # [max_slots, max_rows] int16 | int32
    stride_map,
    rows_ptr,  # [max_slots, B] int32
    lru_ptr,  # [max_slots, B] int32, entries from least to most recently used
    stamp_ptr,  # [max_slots, B] int64
    host_base_ptr,  # [max_slots] int64 (strided)
    stride_hb,
    hot_pages_ptr,  # [max_slots, B / P] int32
    stride_hp,
    tail_pages_ptr,  # [max_slots, RING / P] int32
    stride_tp,
    opt_ptr,  # [max_slots, history pages] int32: ready optional pages (-1: none)
    stride_opt,
    victims_ptr,  # [R, BP] int32 scratch
    locs_ptr,  # [N, K] int64 out
    plan_src_ptr,  # [cap] int64 out: host element offset of each copy
    plan_dst_ptr,  # [cap] int64 out: pool row of each copy
    counters_ptr,  # [5] int64: direct, hot, host, copies queued, overflow
    clock_ptr,  # [] int64: this call's tick
    K,
    B,
    P,
    RING,
    SCRATCH_BASE,
    STAGE_BASE,
    STAGE_ROWS,
    D,
    KP: tl.constexpr,
    BP: tl.constexpr,
    HAS_OPT: tl.constexpr,
    PHASE: tl.constexpr,  # 0: the whole call; 1: (1)-(3), the queue; 2: what follows
):
    r = tl.program_id(0)
    slot = tl.load(slots_ptr + r)
    a = tl.load(cu_ptr + r)
    b = tl.load(cu_ptr + r + 1)
    ring_lo = tl.load(ring_lo_ptr + r)
    chunk_lo = tl.load(chunk_lo_ptr + r)
    in_scr_flag = tl.load(in_scr_ptr + r)
    scr_off = tl.load(scr_off_ptr + r)
    hbase = tl.load(host_base_ptr + slot * stride_hb)
    map_row = map_ptr + slot * stride_map
    rows_row = rows_ptr + slot * B
    lru_row = lru_ptr + slot * B
    stamp_row = stamp_ptr + slot * B
    victims_row = victims_ptr + r * BP
    hp_row = hot_pages_ptr + slot * stride_hp
    tp_row = tail_pages_ptr + slot * stride_tp
    opt_row = opt_ptr + slot * stride_opt
    offs_k = tl.arange(0, KP)
    kmask = offs_k < K
    offs_b = tl.arange(0, BP)
    bmask = offs_b < B
    clock = tl.load(clock_ptr)
    now = tl.full([KP], clock, tl.int64)

    if PHASE != 2:
        # (1)+(2): direct rows, and hot hits stamped: protected from this call's evictions.
        n_direct = tl.zeros([KP], tl.int64)
        n_hot = tl.zeros([KP], tl.int64)
        n_host = tl.zeros([KP], tl.int64)
        for j in range(a, b):
            s = tl.load(sel_ptr + j * stride_sel + offs_k, mask=kmask, other=-1)
            valid = s >= 0
            direct = valid & (s >= ring_lo)
            if HAS_OPT:
                direct |= valid & (tl.load(opt_row + s // P, mask=valid & ~direct, other=-1) >= 0)
            cand = valid & ~direct
            h = tl.load(map_row + s, mask=cand, other=-1).to(tl.int64)
            hit = cand & (h >= 0)
            tl.store(stamp_row + h, now, mask=hit)
            n_direct += direct.to(tl.int64)
            n_hot += hit.to(tl.int64)
            n_host += (cand & (h < 0)).to(tl.int64)
        tl.atomic_add(counters_ptr + 0, tl.sum(n_direct))
        tl.atomic_add(counters_ptr + 1, tl.sum(n_hot))
        tl.atomic_add(counters_ptr + 2, tl.sum(n_host))
        tl.debug_barrier()

        # (3): misses, query by query, into the least recently used unprotected entries; what
        # outgrows them goes to the request's staging rows for this call only (eq. 11).
        staged = 0
        for j in range(a, b):
            s = tl.load(sel_ptr + j * stride_sel + offs_k, mask=kmask, other=-1)
            cand = (s >= 0) & (s < ring_lo)
            if HAS_OPT:
                cand &= tl.load(opt_row + s // P, mask=cand, other=-1) < 0
            h = tl.load(map_row + s, mask=cand, other=-1).to(tl.int64)
            miss = cand & (h == -1)  # <= -2: already staged by an earlier query of this call
            nmiss = tl.sum(miss.to(tl.int32))
            if nmiss > 0:
                lru = tl.load(lru_row + offs_b, mask=bmask, other=0)
                prot = (tl.load(stamp_row + lru, mask=bmask, other=0) == clock) & bmask
                free = (~prot) & bmask
                frank = tl.cumsum(free.to(tl.int32), 0) - 1
                nfree = tl.sum(free.to(tl.int32))
                nprot = tl.sum(prot.to(tl.int32))
                victim = free & (frank < nmiss)
                ntake = tl.minimum(nmiss, nfree)
                tl.store(victims_row + frank, lru, mask=victim)
                prank = tl.cumsum(prot.to(tl.int32), 0) - 1
                keep_n = nfree - ntake
                newpos = tl.where(
                    victim, keep_n + nprot + frank, tl.where(prot, keep_n + prank, frank - ntake)
                )
                tl.debug_barrier()
                tl.store(lru_row + newpos, lru, mask=bmask)
                rank = tl.cumsum(miss.to(tl.int32), 0) - 1
                ok = miss & (rank < nfree)
                over = miss & (rank >= nfree)
                srank = staged + rank - nfree
                sok = over & (srank < STAGE_ROWS)
                tl.atomic_add(counters_ptr + 4, tl.sum((over & ~sok).to(tl.int64)))
                v = tl.load(victims_row + rank, mask=ok, other=0).to(tl.int64)
                old = tl.load(rows_row + v, mask=ok, other=-1)
                tl.store(map_row + old, tl.full([KP], -1, tl.int32).to(map_ptr.dtype.element_ty),
                         mask=ok & (old >= 0))  # fmt: skip
                tl.debug_barrier()
                tl.store(map_row + s, v.to(map_ptr.dtype.element_ty), mask=ok)
                tl.store(map_row + s, (-2 - srank).to(map_ptr.dtype.element_ty), mask=sok)
                tl.store(rows_row + v, s.to(tl.int32), mask=ok)
                tl.store(stamp_row + v, now, mask=ok)
                copy = ok | sok
                ncopy = tl.sum(copy.to(tl.int64))
                base = tl.atomic_add(counters_ptr + 3, ncopy)
                pos = base + tl.cumsum(copy.to(tl.int64), 0) - 1
                hot_dst = tl.load(hp_row + v // P, mask=ok, other=0).to(tl.int64) * P + v % P
                dst = tl.where(ok, hot_dst, STAGE_BASE + slot * STAGE_ROWS + srank)
                tl.store(plan_src_ptr + pos, hbase + s * D, mask=copy)
                tl.store(plan_dst_ptr + pos, dst, mask=copy)
                staged += tl.sum(over.to(tl.int32))
                tl.debug_barrier()

    if PHASE != 1:
        # Entries used by this call (hits included) move to the most recent end, in LRU order.
        lru = tl.load(lru_row + offs_b, mask=bmask, other=0)
        used = (tl.load(stamp_row + lru, mask=bmask, other=0) == clock) & bmask
        unused = (~used) & bmask
        n_unused = tl.sum(unused.to(tl.int32))
        newpos = tl.where(
            used,
            n_unused + tl.cumsum(used.to(tl.int32), 0) - 1,
            tl.cumsum(unused.to(tl.int32), 0) - 1,
        )
        tl.debug_barrier()
        tl.store(lru_row + newpos, lru, mask=bmask)
        tl.debug_barrier()

        # Locations in selection order.
        for j in range(a, b):
            s = tl.load(sel_ptr + j * stride_sel + offs_k, mask=kmask, other=-1)
            valid = s >= 0
            in_ring = valid & (s >= ring_lo)
            q = s % RING
            tp = tl.load(tp_row + q // P, mask=in_ring, other=0).to(tl.int64)
            loc = tp * P + q % P
            in_scr = in_ring & (in_scr_flag != 0) & (s >= chunk_lo)
            loc = tl.where(in_scr, SCRATCH_BASE + scr_off + (s - chunk_lo), loc)
            rest = valid & ~in_ring
            if HAS_OPT:
                op = tl.load(opt_row + s // P, mask=rest, other=-1).to(tl.int64)
                loc = tl.where(rest & (op >= 0), op * P + s % P, loc)
                rest &= op < 0
            h = tl.load(map_row + s, mask=rest, other=0).to(tl.int64)
            hp = tl.load(hp_row + h // P, mask=rest & (h >= 0), other=0).to(tl.int64)
            hloc = tl.where(h >= 0, hp * P + h % P, STAGE_BASE + slot * STAGE_ROWS + (-2 - h))
            loc = tl.where(rest, hloc, loc)
            tl.store(locs_ptr + j * stride_sel + offs_k, tl.where(valid, loc, -1), mask=kmask)
        tl.debug_barrier()

        # Staging lasts for this call only: staged rows leave the map.
        for j in range(a, b):
            s = tl.load(sel_ptr + j * stride_sel + offs_k, mask=kmask, other=-1)
            cand = (s >= 0) & (s < ring_lo)
            h = tl.load(map_row + s, mask=cand, other=-1)
            tl.store(map_row + s, tl.full([KP], -1, tl.int32).to(map_ptr.dtype.element_ty),
                     mask=cand & (h <= -2))  # fmt: skip
