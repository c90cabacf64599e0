"""Load-adaptive residency: eq. 3 and the residency invariant under churn with copy completions
in any order, eq. 4's reclaim, waiting exactly when optional pages cannot cover a deficit, and
logits bit-identical to resident serving throughout."""

from __future__ import annotations

import gc

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dhisparse.family.presets import preset, preset_topology
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig, ResidencyConfig
from services.worker.request.request import SamplingParams
from services.worker.residency.completions import ManualCompletions
from services.worker.residency.optional_history import page_key, page_of_key
from services.worker.residency.policy import (
    Holder,
    RoundRobin,
    reclaim_order,
    requests_to_reclaim,
)
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import build_model
from tests.worker.helpers import with_workspace

# ---- policy ------------------------------------------------------------------------------


def test_eq4_takes_the_first_q_requests_that_cover_the_deficit() -> None:
    hs = [Holder(0, 5, 0), Holder(1, 2, 1), Holder(2, 7, 2), Holder(3, 0, 3)]
    order = reclaim_order(hs, "oldest")
    assert [h.slot for h in order] == [0, 1, 2]  # holders of no pages are skipped
    assert [h.slot for h in requests_to_reclaim(order, 6)] == [0, 1]
    assert [h.slot for h in requests_to_reclaim(order, 7)] == [0, 1]
    assert [h.slot for h in requests_to_reclaim(order, 8)] == [0, 1, 2]
    assert requests_to_reclaim(order, 15) is None  # cannot be covered: the admission waits
    assert requests_to_reclaim(order, 0) == []
    largest = reclaim_order(hs, "largest")
    assert [h.slot for h in requests_to_reclaim(largest, 6)] == [2]
    assert [h.slot for h in reclaim_order(hs, "newest")] == [2, 1, 0]
    with pytest.raises(ValueError):
        reclaim_order(hs, "random")


def test_round_robin_is_bounded_and_fair() -> None:
    rr = RoundRobin()
    wants = {1: 5, 4: 5, 7: 5}
    first = rr.plan(wants, 4)
    assert sum(first.values()) == 4 and first == {1: 2, 4: 1, 7: 1}
    second = rr.plan(wants, 2)  # resumes after the last slot served
    assert second == {4: 1, 7: 1}
    assert rr.plan({1: 1}, 10) == {1: 1}
    assert rr.plan(wants, 0) == {}


# ---- the mechanism, under churn --------------------------------------------------------------

NAME = "tiny-glm"
SLOTS = 5
K = preset_topology(NAME).index_topk
MODEL = build_model(preset(NAME), seed=3)


def make_kv(mode: str, pool_bytes: int, device: str = "cpu", **extra) -> KVCache:
    residency = ResidencyConfig(
        reserve_pages=2, populate_pages=8, overlap_refills=extra.pop("overlap_refills", False)
    )
    cfg = KVCacheConfig(
        mode=mode, max_slots=SLOTS, max_model_len=512, page_size=16, kv_pool_bytes=pool_bytes,
        host_arena_bytes=16 << 20, max_prefill_tokens=512, hot_cache_rows=K,
        residency=residency, device=device, **extra,
    )  # fmt: skip
    return KVCache(preset_topology(NAME), with_workspace(preset_topology(NAME), cfg))


def adaptive_pool_bytes(device: str = "cpu", **extra) -> int:
    """A pool that holds the required pages of all slots and a little optional history, so
    admissions must reclaim (``extra``: e.g. ``kv_cache_dtype``, which sets the row bytes)."""
    probe = make_kv("adaptive", 64 << 20, device, **extra)
    row = probe.payload.store.row_bytes  # 320 in fp32, 100 packed in fp8
    fixed = (64 << 20) - probe.payload.store.pages.total * probe.payload.store.page * row
    per_request = probe.admission_pages(0, 20, 512)  # hot cache, tail and index keys
    probe.close()
    return fixed + (SLOTS * per_request + 2 + 40) * 16 * row


POOL = adaptive_pool_bytes()


class Churn(RuleBasedStateMachine):
    """Admissions, decode steps, completions and copy completions in random order, on an
    adaptive cache and a resident shadow fed the same batches."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = make_kv("adaptive", POOL)
        self.res = self.kv.payload.residency
        self.done = ManualCompletions()
        self.res.copies.completions = self.done
        self.shadow = make_kv("resident", 64 << 20)
        self.running: dict[int, list[int]] = {}  # slot -> tokens so far
        self.gen = torch.Generator().manual_seed(0)

    def teardown(self) -> None:
        self.kv.close()
        self.shadow.close()

    def _forward(self, slots: list[int], starts: list[int], chunks: list[list[int]]) -> None:
        ids = torch.tensor([t for c in chunks for t in c])
        outs = []
        for kv in (self.kv, self.shadow):
            batch = ForwardBatch.build(slots, starts, [len(c) for c in chunks], "cpu")
            hidden = MODEL(ids, batch, kv)
            kv.commit(batch, [s + len(c) for s, c in zip(starts, chunks, strict=True)])
            outs.append(MODEL.logits(hidden[batch.last_token_index]))
        assert torch.equal(outs[0], outs[1]), "adaptive logits differ from resident"
        for slot, nxt in zip(slots, outs[0].argmax(-1).tolist(), strict=True):
            self.running[slot].append(nxt)

    @precondition(lambda self: len(self.running) < SLOTS)
    @rule(length=st.integers(20, 140))
    def admit(self, length: int) -> None:
        slot = next(s for s in range(SLOTS) if s not in self.running)
        need = self.kv.admission_pages(slot, length, 512)
        room = self.res.room()
        holders = self.res.holders()
        deficit = need - room - self.res.retiring_pages
        ok = self.kv.admit(slot, f"r{slot}-{len(self.running)}", length, 512)
        assert ok == (need <= room), "admitted exactly when the page pool has room"
        if not ok:
            if deficit <= 0:  # pages already on their way back cover it
                assert self.res.last_reclaim == []
            elif sum(h.pages for h in holders) < deficit:  # cannot be covered: just wait
                assert self.res.last_reclaim is None
            else:  # exactly eq. 4's first q requests, in the reclaim order
                want = requests_to_reclaim(
                    reclaim_order(holders, self.res.cfg.reclaim_order), deficit
                )
                assert self.res.last_reclaim == [h.slot for h in want]
            return
        prompt = torch.randint(0, 256, (length,), generator=self.gen).tolist()
        assert self.shadow.admit(slot, f"s{slot}", length, 512)
        self.running[slot] = list(prompt)
        self._forward([slot], [0], [prompt])

    @precondition(lambda self: self.running)
    @rule()
    def decode(self) -> None:
        slots = sorted(self.running)
        starts = [len(self.running[s]) - 1 for s in slots]
        for kv in (self.kv, self.shadow):
            for s in slots:
                assert kv.ensure(s, len(self.running[s]))
        self._forward(slots, starts, [[self.running[s][-1]] for s in slots])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        slot = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[slot]
        self.kv.release(slot)
        self.shadow.release(slot)

    @precondition(lambda self: self.done.pending)
    @rule(data=st.data())
    def complete_copies(self, data) -> None:
        """Some of the copies in flight complete, in an order of hypothesis' choosing."""
        pending = list(self.done.pending)
        order = data.draw(st.permutations(pending))
        for ticket in order[: data.draw(st.integers(1, len(order)))]:
            self.done.complete(ticket)

    @rule()
    def maintain(self) -> None:
        self.kv.payload.residency.maintain()

    @invariant()
    def eq3_and_every_row_ready_or_backed(self) -> None:
        self.kv.payload.residency.check()
        mem = self.kv.memory()
        assert mem.required + mem.optional + mem.reserve <= mem.capacity


Churn.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
test_residency_churn = Churn.TestCase


def test_adaptive_keeps_history_reclaims_and_repopulates() -> None:
    """A scripted run: resident-first pages serve rows directly; an admission under pressure
    reclaims whole requests; freed memory is refilled; logits stay identical throughout."""
    scripted_run(MODEL, make_kv("adaptive", POOL), make_kv("resident", 64 << 20), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_refills_on_the_gpu_keep_logits_identical(overlap: bool) -> None:
    """The scripted run on the device, with CUDA-event completions: refill copies queued
    before the decode passes, or on a side stream beside them (``overlap_refills``)."""
    model = build_model(preset(NAME), seed=3, device="cuda")
    kv = make_kv("adaptive", POOL, "cuda", overlap_refills=overlap)
    scripted_run(model, kv, make_kv("resident", 64 << 20, "cuda"), "cuda")


def test_adaptive_in_fp8_gives_the_logits_of_resident_fp8() -> None:
    """The scripted run with packed FP8 rows and keys: reclaim, host reads and refills move
    packed bytes, so adaptive logits equal resident fp8 logits bit for bit."""
    fp8 = {"kv_cache_dtype": "fp8"}
    kv = make_kv("adaptive", adaptive_pool_bytes(**fp8), **fp8)
    assert kv.payload.store.rows.dtype == torch.uint8 and kv.payload.store.row_bytes == 100
    scripted_run(MODEL, kv, make_kv("resident", 64 << 20, **fp8), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_fp8_refills_on_the_gpu_keep_logits_identical(overlap: bool) -> None:
    """The fp8 scripted run on the device: Triton FP8 store and gather, CUDA-event
    completions, refills queued before the decode passes or beside them."""
    model = build_model(preset(NAME), seed=3, device="cuda")
    fp8 = {"kv_cache_dtype": "fp8"}
    kv = make_kv(
        "adaptive", adaptive_pool_bytes("cuda", **fp8), "cuda", overlap_refills=overlap, **fp8
    )
    scripted_run(model, kv, make_kv("resident", 64 << 20, "cuda", **fp8), "cuda")


def scripted_run(model, kv: KVCache, shadow: KVCache, device: str) -> None:
    res = kv.payload.residency
    gen = torch.Generator().manual_seed(1)
    tokens: dict[int, list[int]] = {}

    def forward(slots: list[int], chunks: list[list[int]]) -> None:
        starts = [len(tokens[s]) - len(c) for s, c in zip(slots, chunks, strict=True)]
        ids = torch.tensor([t for c in chunks for t in c], device=device)
        outs = []
        for cache in (kv, shadow):
            for s in slots:
                assert cache.ensure(s, len(tokens[s]))
            batch = ForwardBatch.build(slots, starts, [len(c) for c in chunks], device)
            hidden = model(ids, batch, cache)
            cache.commit(batch, [len(tokens[s]) for s in slots])
            outs.append(model.logits(hidden[batch.last_token_index]))
        assert torch.equal(outs[0], outs[1])
        for s, nxt in zip(slots, outs[0].argmax(-1).tolist(), strict=True):
            tokens[s].append(nxt)

    for slot in range(SLOTS):
        while not kv.admit(slot, f"r{slot}", 120, 512):
            kv.payload.residency.maintain()  # reclaim completes, then the admission goes through
        assert shadow.admit(slot, f"s{slot}", 120, 512)
        tokens[slot] = torch.randint(0, 256, (120,), generator=gen).tolist()
        forward([slot], [tokens[slot]])
        kv.payload.residency.check()
        for _ in range(3):
            forward(sorted(tokens), [[tokens[s][-1]] for s in sorted(tokens)])
            kv.payload.residency.maintain()
            kv.payload.residency.check()
    assert res.stats.reclaim_events > 0 and res.stats.reclaim_pages > 0
    direct_before = kv.payload.census.direct
    kv.release(0)
    shadow.release(0)
    del tokens[0]
    for _ in range(12):  # on a GPU a refill is published once its copy is seen complete
        kv.payload.residency.maintain()
        forward(sorted(tokens), [[tokens[s][-1]] for s in sorted(tokens)])
        kv.payload.residency.check()
    assert res.stats.repopulated_pages > 0
    assert kv.payload.census.direct > direct_before
    kv.close()
    shadow.close()


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_index_keys_take_pages_of_the_payload_pool(mode: str) -> None:
    """In the hierarchy modes the index keys live in pages of the payload's pool: an admission
    takes its hot cache, tail and the keys of its whole budget from one free list, the keys'
    memory is the pool's memory, eq. 3 counts them once, and a release gives all back."""
    kv = make_kv(mode, POOL)
    pages = kv.payload.store.pages
    free0 = pages.free
    need = kv.admission_pages(0, 100, 300)
    keys = kv.index_keys.pages_for(300 + kv.cfg.spec_block)
    assert need == kv.payload.required_pages + keys and keys > 0
    assert kv.admit(0, "a", 100, 300)
    assert pages.free == free0 - need
    store = kv.payload.store.rows
    lo, hi = (
        store.data_ptr(),
        store.data_ptr() + pages.total * kv.payload.store.page * store.shape[1] * 4,
    )
    for pool in kv.index_keys.pools.values():
        assert lo <= pool.data.data_ptr() < hi and pool.nbytes == 0
    mem = kv.memory()
    assert mem.required + mem.optional + mem.reserve + mem.free == mem.capacity
    held = (pages.total - pages.free) * kv.payload.store.page * store.shape[1] * 4
    assert mem.required + mem.optional - kv.fixed_bytes() == held  # keys counted once
    kv.release(0)
    kv.payload.residency.maintain()
    assert pages.free == free0
    kv.close()


def test_repopulation_leaves_the_queue_its_admission_pages() -> None:
    """Optional history may only grow into what the waiting requests will not take: with the
    queue noted as the scheduler notes it (after each step's admissions), neither resident-first
    imports nor refills take the queue's hot caches, tails and index keys, so every queued
    admission fits when its turn comes, without reclaiming anyone's history."""
    kv = make_kv("adaptive", POOL)
    res = kv.payload.residency
    gen = torch.Generator().manual_seed(7)
    need = kv.admission_pages(None, 512, 512)
    assert need > kv.payload.required_pages  # the index keys are part of it
    for slot in range(SLOTS):
        assert kv.admit(slot, f"r{slot}", 140, 512)
        kv.note_queue([512] * (SLOTS - 1 - slot))  # the requests still waiting
        prompt = torch.randint(0, 256, (140,), generator=gen).tolist()
        batch = ForwardBatch.build([slot], [0], [140], "cpu")
        MODEL(torch.tensor(prompt), batch, kv)
        kv.commit(batch, [140])
        for _ in range(3):
            kv.payload.residency.maintain()
            kv.payload.residency.check()
            assert res.room() >= need * (SLOTS - 1 - slot)
    assert res.stats.reclaim_events == 0
    # One finishes and a new request waits: the freed pages refill history, but only beyond
    # what the newcomer's admission takes.
    kv.release(0)
    kv.note_queue([512])
    for _ in range(3):
        kv.payload.residency.maintain()
        kv.payload.residency.check()
        assert res.room() >= need
    assert res.stats.repopulated_pages > 0
    assert kv.admit(0, "next", 140, 512)
    assert res.stats.reclaim_events == 0
    kv.close()


def test_refill_goes_only_to_requests_that_run_long_enough_to_pay_for_it() -> None:
    """A refilled page spares ~p·k/V host reads per decode step and costs p rows once: with
    the horizons noted as the scheduler notes them, requests with fewer than V/k steps left
    get none of the freed pages; the others get them all."""
    kv = make_kv("adaptive", POOL)
    res = kv.payload.residency
    gen = torch.Generator().manual_seed(11)
    for slot in range(SLOTS):
        assert kv.admit(slot, f"r{slot}", 140, 512)
        kv.note_queue([512] * (SLOTS - 1 - slot))  # history goes to the host: refills wanted
        batch = ForwardBatch.build([slot], [0], [140], "cpu")
        MODEL(torch.randint(0, 256, (140,), generator=gen), batch, kv)
        kv.commit(batch, [140])
        kv.payload.residency.maintain()
    kv.release(0)
    kv.note_queue([])
    payback = -(-140 // K)  # V/k decode steps
    short, long_ = [1, 3], [2, 4]
    kv.note_horizons(lambda: [(s, payback - 1) for s in short] + [(s, payback) for s in long_])
    wanted = {s: len(res.history.owner(res.history.current_id(s)).wanted) for s in range(1, SLOTS)}
    assert all(wanted[s] > 0 for s in range(1, SLOTS))
    # The waiting pages cost the garbage collector nothing: plain ints, none of them tracked
    # (tuples were: 88K of them made full collections the adaptive run's largest host cost).
    for s in range(1, SLOTS):
        keys = res.history.owner(res.history.current_id(s)).wanted
        assert all(type(key) is int and not gc.is_tracked(key) for key in keys)
        pages = [page_of_key(key) for key in keys]
        assert len(set(pages)) == len(pages)
        assert all(
            0 <= src < kv.payload.store.num_sources and 0 <= i < -(-140 // 16) for src, i in pages
        )
    for _ in range(4):
        kv.payload.residency.maintain()
        kv.payload.residency.check()
    for s in short:
        assert (
            len(res.history.owner(res.history.current_id(s)).wanted) == wanted[s]
        )  # nothing refilled
    for s in long_:
        assert len(res.history.owner(res.history.current_id(s)).wanted) < wanted[s]
    assert res.stats.repopulated_pages > 0
    kv.close()


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_a_huge_max_tokens_is_admitted_with_the_keys_the_pool_can_hold(mode: str) -> None:
    """Index keys are reserved for a request's whole budget, but never beyond what one request
    can hold in the pool: a budget of the whole context (the scheduler's largest) that the
    pool cannot hold is admitted (and would end where the pool does, as in resident serving)
    rather than refused forever."""

    def cache(pool_bytes: int) -> KVCache:
        cfg = KVCacheConfig(
            mode=mode, max_slots=2, max_model_len=8192, page_size=16, kv_pool_bytes=pool_bytes,
            host_arena_bytes=16 << 20, max_prefill_tokens=512, hot_cache_rows=K,
        )  # fmt: skip
        return KVCache(preset_topology(NAME), cfg)

    probe = cache(64 << 20)
    page_bytes = probe.payload.store.page_bytes
    fixed = (64 << 20) - probe.payload.store.pages.total * page_bytes
    required = probe.payload.required_pages
    probe.close()
    kv = cache(fixed + (required + 8) * page_bytes)  # a hot cache, a tail and 8 pages of keys
    assert 20 < kv.tokens_capacity < kv.cfg.max_model_len  # the pool, not the context, binds
    assert kv.admit(0, "huge", 20, kv.cfg.max_model_len)
    assert kv.index_keys.pages_needed(0, kv.tokens_capacity) == 0  # reserved up to the pool
    assert kv.payload.store.pages.free == 0
    kv.close()


@pytest.mark.parametrize("pool_mib", [3.0, 4.0])
def test_adaptive_engine_under_pressure_gives_resident_tokens(pool_mib: float) -> None:
    """Through the engine (maintenance runs while the device runs each decode pass): requests
    arriving mid-run make admissions reclaim whole requests' optional history, finishing ones
    free pages that are refilled, and every request's greedy tokens equal resident serving's."""
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 120, 450, 80, 260, 390)
    ]
    budgets = (40, 90, 30, 70, 50, 60)

    def run(mode: str, mib: float) -> tuple[Engine, list[list[int]]]:
        eng = Engine(
            EngineConfig(model=NAME, mode=mode, kv_pool_mib=mib, host_arena_mib=64, max_num_seqs=4,
                         max_model_len=1024, page_size=16, hot_cache_rows=64,
                         residency=ResidencyConfig(populate_pages=16), max_prefill_tokens=512)
        )  # fmt: skip
        reqs = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            if i == 3:  # the rest arrive while the first three decode
                for _ in range(12):
                    eng.step()
            params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
            reqs.append(eng.add_request(f"r{i}", prompt, params))
        while eng.has_work():
            eng.step()
        return eng, [r.output_ids for r in reqs]

    resident, ref = run("resident", 64)
    adaptive, got = run("adaptive", pool_mib)
    assert got == ref
    st = adaptive.kv.payload.residency.stats
    assert st.reclaim_events > 0 and st.reclaim_pages > 0 and st.repopulated_pages > 0
    resident.close()
    adaptive.close()


@pytest.mark.parametrize("resolver", ["torch", "triton"])
def test_warming_the_copies_launches_both_and_changes_nothing(resolver: str) -> None:
    """The refill and reclaim copies are launched once when the cache is built (their kernels
    built before serving, not on the first refill mid-run): the refill reads into a free page,
    the backup writes nothing, and the pool's free list, every other row and the host arena
    are as they were."""
    kv = make_kv("adaptive", POOL, resolver=resolver)
    res, p = kv.payload.residency, kv.payload.store
    gen = torch.Generator().manual_seed(11)
    p.rows.copy_(torch.randn(p.rows.shape, generator=gen).to(p.rows.dtype))
    arena = p.host.arena
    arena.copy_(torch.randn(arena.shape, generator=gen).to(arena.dtype))
    store0, arena0, free0 = p.rows.clone(), arena.clone(), list(p.pages._free)
    calls = []
    restore, backup = p.restore, p.backup
    p.restore = lambda *a: (calls.append("restore"), restore(*a))
    p.backup = lambda *a: (calls.append("backup"), backup(*a))
    res.warm_copies()
    assert calls == ["restore", "backup"]
    assert p.pages._free == free0
    page = free0[-1]  # the page it took: the next one handed out
    rows = torch.arange(page * p.page, (page + 1) * p.page)
    width = p.rows.shape[1]
    assert torch.equal(p.rows[rows], arena0[: p.page * width].view(p.page, width))
    other = torch.ones(len(p.rows), dtype=torch.bool)
    other[rows] = False
    assert torch.equal(p.rows[other], store0[other])
    assert torch.equal(arena, arena0)
    kv.close()


def test_page_keys_round_trip() -> None:
    for source, index in [(0, 0), (7, 255), (63, 2**31), (1, 2**32 - 1)]:
        assert page_of_key(page_key(source, index)) == (source, index)
    assert page_key(0, 5) != page_key(5, 0)
