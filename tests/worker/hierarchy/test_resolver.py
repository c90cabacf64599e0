"""The resolver: the Triton kernels equal the torch reference exactly (CPU interpreter here, the
GPU under @gpu), LRU semantics, and the census."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.hot_cache import HotCache
from services.worker.hierarchy.plan import ChunkPlan
from services.worker.hierarchy.resolver import resolve_ref
from services.worker.hierarchy.staging import StagingOverflow
from services.worker.kv.reports import Census

SLOTS, B, MAX_ROWS, D, RING, P = 4, 64, 600, 8, 24, 8
NUM_PAGES = 200


class World:
    """A page pool, a hot cache and a host arena with every row's bytes known. Hot-cache and
    tail pages are scattered over the pool; with ``optional`` some history pages are ready
    optional pages (holding their rows' bytes), as in adaptive serving."""

    def __init__(
        self, seed: int, device: str = "cpu", k: int = 16, optional: bool = False, stage: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = k
        stage_base = NUM_PAGES * P + 64
        self.geo = SourceGeometry.create(
            SLOTS, P, B, RING, NUM_PAGES * P, 64, MAX_ROWS, device, stage_base, stage
        )
        self.pool = torch.zeros(stage_base + SLOTS * stage, D, device=device)
        self.hot = HotCache(SLOTS, B, MAX_ROWS, device)
        self.host = torch.randn(SLOTS * MAX_ROWS * D, generator=g)
        self.host_base = (torch.arange(SLOTS, dtype=torch.int64) * MAX_ROWS * D).to(device)
        pages = torch.randperm(NUM_PAGES, generator=g).to(torch.int32)
        per = B // P + RING // P
        for slot in range(SLOTS):
            mine = pages[slot * per : (slot + 1) * per]
            self.geo.hot_pages[slot] = mine[: B // P].to(device)
            self.geo.tail_pages[slot] = mine[B // P :].to(device)
        if optional:  # every third history page of each slot is resident and ready
            free = pages[SLOTS * per :].tolist()
            for slot in range(SLOTS):
                for hp in range(0, MAX_ROWS // P, 3):
                    page = free.pop()
                    self.geo.opt_map[slot, hp] = page
                    base = slot * MAX_ROWS * D + hp * P * D
                    self.pool[page * P : page * P + P] = (
                        self.host[base : base + P * D].view(P, D).to(device)
                    )
        self.device = device
        self.g = g

    def selections(self, per_req: list[int], hist: list[int]) -> tuple[torch.Tensor, list[int]]:
        sel, cu = [], [0]
        for q, n in zip(per_req, hist, strict=True):
            for _ in range(q):
                rows = torch.randperm(n, generator=self.g)[: self.k]
                # Skewed towards a working set so that hits happen.
                hotset = torch.randperm(min(n, 40), generator=self.g)[: self.k // 2]
                rows = torch.unique(torch.cat([hotset, rows]))[: self.k]
                rows = rows[torch.randperm(len(rows), generator=self.g)]
                pad = torch.full((self.k - len(rows),), -1, dtype=torch.int64)
                sel.append(torch.cat([rows, pad]))
            cu.append(cu[-1] + q)
        return torch.stack(sel).to(self.device), cu


def run(world: World, fn, sel, cu, slots, plan, clock):
    cu_t = torch.tensor(cu, dtype=torch.int64, device=sel.device)
    return fn(sel, cu_t, slots, plan, world.geo, world.hot, clock, world.pool, world.host,
              world.host_base)  # fmt: skip


def expected_rows(world: World, sel: torch.Tensor, cu: list[int], slots: torch.Tensor, plan):
    """What attention must read: host row bytes, except direct rows (not tested here)."""
    out = torch.zeros(*sel.shape, D)
    for r in range(len(cu) - 1):
        for j in range(cu[r], cu[r + 1]):
            for i, s in enumerate(sel[j].tolist()):
                if s >= 0 and s < int(plan.ring_lo[r]):
                    base = int(world.host_base[int(slots[r])]) + s * D
                    out[j, i] = world.host[base : base + D]
    return out


CASES = [  # (seed, optional history, k, staging rows per slot)
    (0, False, 16, 0),
    (1, False, 16, 0),
    (2, True, 16, 0),
    (3, True, 16, 0),
    (4, False, 28, 4 * 28),  # 4-query unions of 28 outgrow B = 64: staging
    (5, True, 28, 4 * 28),
]


@pytest.mark.parametrize(("seed", "optional", "k", "stage"), CASES)
def test_triton_resolver_equals_reference(seed: int, optional: bool, k: int, stage: int) -> None:
    from services.worker.hierarchy.resolver_triton import resolve_triton

    ref = World(seed, optional=optional, k=k, stage=stage)
    tri = World(seed, optional=optional, k=k, stage=stage)
    g = torch.Generator().manual_seed(100 + seed)
    for clock in range(1, 7):
        slots = torch.tensor([3, 0, 2])
        hist = [int(torch.randint(60, MAX_ROWS, (1,), generator=g)) for _ in slots]
        per_req = [int(torch.randint(1, 5 if stage else 4, (1,), generator=g)) for _ in slots]
        sel, cu = ref.selections(per_req, hist)
        ring_lo = [h - RING for h in hist]
        plan = ChunkPlan.build([h - 1 for h in hist], hist, RING, "cpu")
        plan = ChunkPlan(**{**plan.__dict__, "ring_lo": torch.tensor(ring_lo)})
        tri.hot = copy.deepcopy(ref.hot)
        tri.pool = ref.pool.clone()
        l1, c1 = run(ref, resolve_ref, sel, cu, slots, plan, clock)
        l2, c2 = run(tri, resolve_triton, sel, cu, slots, plan, clock)
        assert torch.equal(l1, l2)
        assert torch.equal(c1, c2), (c1, c2)
        for name in ("map", "rows", "lru", "stamp"):
            assert torch.equal(getattr(ref.hot, name), getattr(tri.hot, name)), name
        assert torch.equal(ref.pool, tri.pool)
        # And both hand attention the right bytes.
        got = ref.pool[l1.clamp(min=0)]
        want = expected_rows(ref, sel, cu, slots, plan)
        hist_mask = (sel >= 0) & (
            sel < torch.tensor(ring_lo).repeat_interleave(torch.tensor(per_req)).unsqueeze(1)
        )
        assert torch.equal(got[hist_mask], want[hist_mask])


def test_census_adds_up_and_copies_each_distinct_row_once() -> None:
    w = World(0)
    slots = torch.tensor([1])
    # Three queries of one request selecting overlapping rows: 10 distinct rows, 3 shared.
    rows = [list(range(0, 16)), list(range(8, 24)), list(range(4, 20))]
    sel = torch.tensor(rows, dtype=torch.int64)
    plan = ChunkPlan.build([199], [200], RING, "cpu")
    locs, c = run(w, resolve_ref, sel, [0, 3], slots, plan, 1)
    census = Census.of(c)
    valid = int((sel >= 0).sum())
    assert census.direct + census.hot + census.host == valid
    assert census.copied == 24  # rows 0..23, each once although selected up to three times
    # Every query's location for a shared row is the same entry.
    loc_of = {}
    for j in range(3):
        for s, loc in zip(sel[j].tolist(), locs[j].tolist(), strict=True):
            assert loc_of.setdefault(s, loc) == loc


def test_lru_victims_are_least_recent_unselected_and_selected_rows_survive() -> None:
    w = World(1, k=8)
    slots = torch.tensor([0])
    plan = ChunkPlan.build([499], [500], RING, "cpu")
    # Fill all B entries: rows 0..63 over 8 calls (call c uses rows 8c..8c+7).
    for c in range(8):
        sel = torch.arange(8 * c, 8 * c + 8).unsqueeze(0)
        run(w, resolve_ref, sel, [0, 1], slots, plan, clock=c + 1)
    assert sorted(w.hot.rows[0].tolist()) == list(range(64))
    # Touch rows 0..7 again (now most recent), then miss 8 new rows while selecting rows 8..11:
    run(w, resolve_ref, torch.arange(0, 8).unsqueeze(0), [0, 1], slots, plan, clock=9)
    sel = torch.tensor([[8, 9, 10, 11, 100, 101, 102, 103]])
    run(w, resolve_ref, sel, [0, 1], slots, plan, clock=10)
    cached = set(w.hot.rows[0].tolist())
    # Selected rows 8..11 survive their own step; the victims are the least recently used
    # unselected rows: 12..15 (stamped at call 2), not rows 0..7 (call 9).
    assert {8, 9, 10, 11, 100, 101, 102, 103} <= cached
    assert not {12, 13, 14, 15} & cached
    assert set(range(0, 8)) <= cached and set(range(16, 64)) <= cached
    for s in (100, 101, 102, 103):
        e = int(w.hot.map[0, s])
        assert int(w.hot.rows[0, e]) == s
        loc = w.geo.hot_loc(torch.tensor(0), torch.tensor(e))
        assert torch.equal(w.pool[loc], w.host[s * D : s * D + D])


def test_staging_serves_the_overflow_within_its_reservation() -> None:
    w = World(2, k=40, stage=2 * 40)
    plan = ChunkPlan.build([499], [500], RING, "cpu")
    # Two queries whose union (80 rows) exceeds B = 64: 16 rows are staged, each copied once.
    sel = torch.stack([torch.arange(0, 40), torch.arange(40, 80)])
    locs, census = run(w, resolve_ref, sel, [0, 2], torch.tensor([0]), plan, clock=1)
    assert Census.of(census).copied == 80
    stage_lo = w.geo.stage_base
    staged = locs[(locs >= stage_lo)]
    assert 0 < staged.numel() <= 2 * 40 and int(staged.max()) < stage_lo + 80  # slot 0's rows
    for j in range(2):
        for s, loc in zip(sel[j].tolist(), locs[j].tolist(), strict=True):
            assert torch.equal(w.pool[loc], w.host[s * D : s * D + D])
    # A union larger than B plus the reservation fails loudly instead of overwriting.
    w2 = World(3, k=40, stage=10)
    with pytest.raises(StagingOverflow):
        run(w2, resolve_ref, sel, [0, 2], torch.tensor([0]), plan, clock=1)


def test_overflow_needs_staging() -> None:
    w = World(2, k=40)
    plan = ChunkPlan.build([499], [500], RING, "cpu")
    # Two queries whose union (80 rows) exceeds B = 64.
    sel = torch.stack([torch.arange(0, 40), torch.arange(40, 80)])
    with pytest.raises(StagingOverflow):
        run(w, resolve_ref, sel, [0, 2], torch.tensor([0]), plan, clock=1)


@pytest.mark.gpu
def test_triton_resolver_on_gpu_equals_reference() -> None:
    from services.worker.hierarchy.resolver_triton import resolve_triton

    for seed in range(3):
        ref, tri = World(seed), World(seed, device="cuda")
        tri.host = tri.host.pin_memory()
        slots = torch.tensor([2, 1])
        hist = [300, 500]
        sel, cu = ref.selections([2, 1], hist)
        plan = ChunkPlan.build([h - 1 for h in hist], hist, RING, "cpu")
        l1, c1 = run(ref, resolve_ref, sel, cu, slots, plan, 1)
        plan_d = ChunkPlan.build([h - 1 for h in hist], hist, RING, "cuda")
        l2, c2 = run(tri, resolve_triton, sel.cuda(), cu, slots.cuda(), plan_d, 1)
        torch.cuda.synchronize()
        assert torch.equal(l1, l2.cpu()) and torch.equal(c1, c2.cpu())
        assert torch.equal(ref.pool, tri.pool.cpu())
        for name in ("map", "rows", "lru", "stamp"):
            assert torch.equal(getattr(ref.hot, name), getattr(tri.hot, name).cpu())


def test_sorting_queued_reads_keeps_every_copy_and_orders_the_live_ones() -> None:
    from services.worker.hierarchy.read_order import sort_queued

    g = torch.Generator().manual_seed(7)
    for n, count in ((1, 1), (50, 0), (50, 17), (300, 300), (4096, 3000)):
        src = torch.randint(0, 1 << 40, (n + 5,), generator=g)
        dst = torch.randperm(n + 5, generator=g)
        pairs = sorted(zip(src[:count].tolist(), dst[:count].tolist(), strict=True))
        sort_queued(src, dst, torch.tensor(count), n)
        assert torch.equal(src[:count], torch.sort(src[:count]).values)
        assert sorted(zip(src[:count].tolist(), dst[:count].tolist(), strict=True)) == pairs


@pytest.mark.parametrize(("seed", "optional", "k", "stage"), CASES[::2])
def test_host_read_order_changes_no_byte(seed: int, optional: bool, k: int, stage: int) -> None:
    """Sorted by address, as queued, and the reference: the same locations, census, hot-cache
    state and pool, call after call."""
    from services.worker.hierarchy.resolver_triton import TritonResolver
    from services.worker.kv.config import HostReadOrder

    fns = (resolve_ref, TritonResolver(HostReadOrder(True)), TritonResolver(HostReadOrder(False)))
    worlds = [World(seed, optional=optional, k=k, stage=stage) for _ in fns]
    g = torch.Generator().manual_seed(200 + seed)
    for clock in range(1, 5):
        slots = torch.tensor([1, 3, 0, 2])
        hist = [int(torch.randint(60, MAX_ROWS, (1,), generator=g)) for _ in slots]
        per_req = [int(torch.randint(1, 5 if stage else 3, (1,), generator=g)) for _ in slots]
        sel, cu = worlds[0].selections(per_req, hist)
        plan = ChunkPlan.build([h - 1 for h in hist], hist, RING, "cpu")
        outs = [run(w, fn, sel, cu, slots, plan, clock) for w, fn in zip(worlds, fns, strict=True)]
        for (locs, census), w in zip(outs[1:], worlds[1:], strict=True):
            assert torch.equal(locs, outs[0][0]) and torch.equal(census, outs[0][1])
            assert torch.equal(w.pool, worlds[0].pool)
            for name in ("map", "rows", "lru", "stamp"):
                assert torch.equal(getattr(w.hot, name), getattr(worlds[0].hot, name)), name


@pytest.mark.gpu
def test_host_read_order_changes_no_byte_on_gpu() -> None:
    from services.worker.hierarchy.resolver_triton import TritonResolver
    from services.worker.kv.config import HostReadOrder

    for seed in range(3):
        ref = World(seed)
        worlds = [World(seed, device="cuda") for _ in range(2)]
        for w in worlds:
            w.host = w.host.pin_memory()
        fns = [TritonResolver(HostReadOrder(b)) for b in (True, False)]
        slots = torch.tensor([2, 1, 3])
        hist = [300, 500, 599]
        sel, cu = ref.selections([2, 1, 1], hist)
        plan = ChunkPlan.build([h - 1 for h in hist], hist, RING, "cpu")
        l0, c0 = run(ref, resolve_ref, sel, cu, slots, plan, 1)
        plan_d = ChunkPlan.build([h - 1 for h in hist], hist, RING, "cuda")
        for w, fn in zip(worlds, fns, strict=True):
            locs, census = run(w, fn, sel.cuda(), cu, slots.cuda(), plan_d, 1)
            torch.cuda.synchronize()
            assert torch.equal(l0, locs.cpu()) and torch.equal(c0, census.cpu())
            assert torch.equal(ref.pool, w.pool.cpu())
