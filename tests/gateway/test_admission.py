"""Admission by memory without a server: sizing by the capacity model, the FIFO wait, 429/503/
400, cancellation, lease renewal and dead workers, over the in-process ledger."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import pytest

from dhisparse import metrics as names
from dhisparse.capacity import (
    Deployment,
    build_plan,
    profile_from_model_config,
    required_bytes,
    session_bytes,
)
from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import parse_config, topology
from dhisparse.family.hf_dir import read_config
from dhisparse.family.parallel_layout import ParallelConfig
from dhisparse.family.presets import preset_topology
from services.gateway.admission import AdmissionConfig, MemoryAdmission
from services.gateway.ledger import Candidate, Ledger, LocalLedger
from services.gateway.metrics import GatewayMetrics
from services.gateway.redis_ledger import RedisLedger
from services.gateway.routing import (
    AdmissionJob,
    AdmissionRejected,
    NoWorkerAvailable,
    WorkerStatus,
)
from services.gateway.sizing import SessionSizer, capacity_mode
from tests.fixtures import CONFIGS

MODEL = "tiny-glm"
CONFIG = preset_topology(MODEL)
CONFIG_JSON = json.dumps(CONFIG.to_dict())
PROMPT, MAX_TOKENS = 40, 60  # a job of 100 tokens
NEED = required_bytes(profile_from_model_config(CONFIG, page_size=16), 100, "resident")


def worker(address: str, sessions: int = 2, **kw: object) -> WorkerStatus:
    """A healthy tiny-glm worker with room for ``sessions`` jobs of 100 tokens."""
    fields: dict[str, object] = {
        "healthy": True,
        "kv_capacity_bytes": sessions * NEED,
        "max_num_seqs": 32,
        "model_name": MODEL,
        "mode": "resident",
        "config_json": CONFIG_JSON,
        **kw,
    }
    return WorkerStatus(address, **fields)  # type: ignore[arg-type]


def job(name: str, prompt: int = PROMPT, max_tokens: int = MAX_TOKENS) -> AdmissionJob:
    return AdmissionJob(name, prompt, max_tokens, MODEL)


def make(
    workers: Sequence[WorkerStatus], **config: float
) -> tuple[MemoryAdmission, GatewayMetrics, list[WorkerStatus]]:
    metrics = GatewayMetrics()
    admission = MemoryAdmission(
        LocalLedger(),
        AdmissionConfig(**config),
        metrics=metrics,  # type: ignore[arg-type]
    )
    return admission, metrics, list(workers)


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_sizing_follows_the_capacity_model() -> None:
    sizer = SessionSizer(page_size=16)
    profile = profile_from_model_config(CONFIG, page_size=16)
    for tokens in (1, 100, 1000):
        assert sizer.required_bytes(worker("a"), tokens) == required_bytes(
            profile, tokens, "resident"
        )
        hierarchy = required_bytes(profile, tokens, "hierarchy")
        assert sizer.required_bytes(worker("a", mode="hisparse"), tokens) == hierarchy
        assert sizer.required_bytes(worker("a", mode="adaptive"), tokens) == hierarchy
    assert sizer.required_bytes(worker("a", config_json=""), 100) is None
    assert sizer.required_bytes(worker("a", config_json='{"name": "x"}'), 100) is None


def test_sizing_counts_the_mtp_layer_a_worker_serves() -> None:
    """A worker serving --drafter mtp reports its topology with the MTP layer (one more
    source and producer, lagging by one token): the session needs that source's rows and keys
    too, exactly what the capacity model gives for the topology."""
    cfg = parse_config(read_config(CONFIGS / "glm-5.2"))
    alone, served = topology(cfg, "glm-5.2"), topology(cfg, "glm-5.2", mtp=True)
    sizer = SessionSizer(page_size=64)
    for mode, kind in (("resident", "resident"), ("hisparse", "hierarchy")):

        def need(t: ModelConfig, mode: str = mode) -> int | None:
            w = worker("a", mode=mode, config_json=json.dumps(t.to_dict()))
            return sizer.required_bytes(w, 4096)

        block = 1 if kind == "hierarchy" else 0  # keys reserved for a verification block
        profile = profile_from_model_config(served, page_size=64)
        assert need(served) == required_bytes(profile, 4096 + block, kind)
        assert need(served) > need(alone)


async def test_admits_at_once_on_the_least_admitted_worker() -> None:
    admission, metrics, workers = make([worker("a"), worker("b")])
    await admission.observe(workers)
    first = await admission.acquire(job("1"), lambda: workers)
    second = await admission.acquire(job("2"), lambda: workers)
    assert {first.worker, second.worker} == {"a", "b"}
    count = sample(metrics, names.ALLOCATION_WAIT + "_count", model=MODEL)
    assert count == 2
    assert sample(metrics, names.ALLOCATION_WAIT + "_sum", model=MODEL) < 0.05  # type: ignore[operator]
    usage = await admission.ledger.usage(["a", "b"])
    assert usage["a"].admitted_bytes == usage["b"].admitted_bytes == NEED
    first.release()
    first.release()  # idempotent
    second.release()
    await admission.close()
    assert admission.live_leases == 0


async def test_waiters_are_admitted_in_fifo_order_when_capacity_returns() -> None:
    admission, metrics, workers = make([worker("a")], poll_s=10)  # only a release wakes them
    await admission.observe(workers)
    held = [await admission.acquire(job(f"h{i}"), lambda: workers) for i in range(2)]
    order: list[str] = []

    async def wait(name: str) -> None:
        lease = await admission.acquire(job(name), lambda: workers)
        order.append(name)
        await asyncio.sleep(0.01)
        lease.release()

    tasks = []
    for name in ("w1", "w2", "w3"):
        tasks.append(asyncio.create_task(wait(name)))
        await asyncio.sleep(0.01)
    assert admission.queue_depth(MODEL) == 3
    assert sample(metrics, names.QUEUE_DEPTH, model=MODEL) == 3
    held[0].release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["w1", "w2", "w3"]
    assert admission.queue_depth(MODEL) == 0
    waited = sample(metrics, names.ALLOCATION_WAIT + "_sum", model=MODEL)
    assert waited is not None and waited > 0.01
    held[1].release()
    await admission.close()


async def test_queue_full_is_429_and_the_deadline_is_503() -> None:
    admission, metrics, workers = make([worker("a", sessions=1)], max_queue=1, queue_deadline_s=0.3)
    await admission.observe(workers)
    held = await admission.acquire(job("h"), lambda: workers)
    start = time.monotonic()
    queued = asyncio.create_task(admission.acquire(job("q"), lambda: workers))
    await asyncio.sleep(0.05)
    with pytest.raises(AdmissionRejected) as full:
        await admission.acquire(job("x"), lambda: workers)
    assert (full.value.status, full.value.reason, full.value.retry_after_s) == (
        429,
        "queue-full",
        1,
    )
    with pytest.raises(AdmissionRejected) as late:
        await queued
    elapsed = time.monotonic() - start
    assert (late.value.status, late.value.reason) == (503, "deadline")
    assert 0.3 <= elapsed < 0.6
    rejected = names.REQUESTS_REJECTED + "_total"
    assert sample(metrics, rejected, model=MODEL, reason="queue-full", status="429") == 1
    assert sample(metrics, rejected, model=MODEL, reason="deadline", status="503") == 1
    # Capacity that returns before the deadline admits the waiter.
    queued = asyncio.create_task(admission.acquire(job("q2"), lambda: workers))
    await asyncio.sleep(0.1)
    held.release()
    (await asyncio.wait_for(queued, 1)).release()
    await admission.close()


async def test_without_a_queue_a_full_cluster_is_429_at_once() -> None:
    admission, _, workers = make([worker("a", sessions=1)], max_queue=0)
    await admission.observe(workers)
    held = await admission.acquire(job("h"), lambda: workers)
    with pytest.raises(AdmissionRejected) as e:
        await admission.acquire(job("x"), lambda: workers)
    assert (e.value.status, e.value.reason) == (429, "no-capacity")
    held.release()
    await admission.close()


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    admission, _, workers = make([worker("a", sessions=1)], max_queue=2)
    await admission.observe(workers)
    held = await admission.acquire(job("h"), lambda: workers)
    first = asyncio.create_task(admission.acquire(job("1"), lambda: workers))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(admission.acquire(job("2"), lambda: workers))
    await asyncio.sleep(0.02)
    assert admission.queue_depth(MODEL) == 2
    first.cancel()  # the client went away
    await asyncio.sleep(0.02)
    assert admission.queue_depth(MODEL) == 1
    # There is room in the queue again.
    third = asyncio.create_task(admission.acquire(job("3"), lambda: workers))
    await asyncio.sleep(0.02)
    held.release()
    lease = await asyncio.wait_for(second, 1)
    assert not third.done()
    lease.release()
    (await asyncio.wait_for(third, 1)).release()
    await admission.close()
    assert (await admission.ledger.usage(["a"]))["a"].admitted_bytes == 0


async def test_a_request_no_worker_can_hold_is_400_at_once() -> None:
    admission, metrics, workers = make([worker("a", sessions=2), worker("b", sessions=3)])
    await admission.observe(workers)
    with pytest.raises(AdmissionRejected) as e:
        await admission.acquire(job("big", prompt=100, max_tokens=1000), lambda: workers)
    assert (e.value.status, e.value.reason) == (400, "too-large")
    # The longest context the largest worker holds: 3 sessions of 100 tokens, in pages of 16.
    sizer = SessionSizer()
    longest = int(e.value.message.split("maximum context length is ")[1].split()[0])
    assert sizer.required_bytes(workers[1], longest) <= 3 * NEED  # type: ignore[operator]
    assert sizer.required_bytes(workers[1], longest + 1) > 3 * NEED  # type: ignore[operator]
    assert "However, you requested 1100 tokens (100 in the messages, 1000 in the" in e.value.message
    rejected = names.REQUESTS_REJECTED + "_total"
    assert sample(metrics, rejected, model=MODEL, reason="too-large", status="400") == 1
    await admission.close()


async def test_a_data_parallel_group_admits_a_request_within_one_ranks_pool() -> None:
    # 4 sessions' bytes over 2 serving ranks: 2 per rank. A job of 3 sessions' bytes fits the
    # group's sum but no rank, so it is too large; one of 2 fits, and the group holds 2 of them.
    group = worker("dp", sessions=4, serving_ranks=2)
    assert group.request_capacity_bytes == 2 * NEED
    admission, _metrics, workers = make([group])
    await admission.observe(workers)
    with pytest.raises(AdmissionRejected) as e:
        await admission.acquire(job("big", prompt=100, max_tokens=200), lambda: workers)
    assert (e.value.status, e.value.reason) == (400, "too-large")
    longest = int(e.value.message.split("maximum context length is ")[1].split()[0])
    sizer = SessionSizer()
    assert sizer.required_bytes(group, longest) <= 2 * NEED  # type: ignore[operator]
    assert sizer.required_bytes(group, longest + 1) > 2 * NEED  # type: ignore[operator]
    one_rank = int(sizer.required_bytes(group, 200) or 0)
    assert one_rank <= 2 * NEED
    leases = [
        await admission.acquire(job(f"fits-{i}", prompt=100, max_tokens=100), lambda: workers)
        for i in range(2)
    ]
    assert {lease.worker for lease in leases} == {"dp"}
    for lease in leases:
        lease.release()
    await admission.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
@pytest.mark.parametrize("dp", [False, True], ids=["tp", "dp-attention"])
async def test_a_worker_spanning_gpus_admits_the_sessions_its_plan_gives(
    dp: bool, mode: str
) -> None:
    """A worker over 2 GPUs reports (GetLoad) one GPU's pool under TP, whose ranks all store
    every session (the MLA latent row is one head, replicated), and its ranks' pools summed
    under DP attention, with 2 serving ranks. The gateway charges a session its bytes on one
    GPU (the latent row once) against one rank's account, so it admits exactly the sessions
    ``dhisparse plan`` gives the layout per worker: one pool's under TP, two under DP."""
    cfg = ParallelConfig(2, data_parallel_attention=dp)
    profile = profile_from_model_config(CONFIG, page_size=16)
    kind = capacity_mode(mode)
    pool = 5 * NEED + NEED // 2  # per GPU
    plan = build_plan(profile, 100, deployment=Deployment(pool_bytes=pool, gpus=2), layouts=[cfg])
    planned = plan.layouts[0].admitted(kind, None)
    assert planned is not None and planned.per_worker == planned.per_gpu * (2 if dp else 1)
    group = worker("w", mode=mode, kv_capacity_bytes=pool * cfg.serving_ranks,
                   serving_ranks=cfg.serving_ranks)  # fmt: skip
    # a session's bytes as the gateway sizes them: the plan's per GPU (in the hierarchy, the
    # verification block's one more index key falls in the last key page at 100 tokens)
    assert SessionSizer().required_bytes(group, 100) == session_bytes(profile, 100, kind).total
    admission, _metrics, workers = make([group], max_queue=0)
    await admission.observe(workers)
    held = [
        await admission.acquire(job(f"r{i}"), lambda: workers) for i in range(planned.per_worker)
    ]
    with pytest.raises(AdmissionRejected) as e:
        await admission.acquire(job("one-more"), lambda: workers)
    assert (e.value.status, e.value.reason) == (429, "no-capacity")
    assert sorted(lease.rank or 0 for lease in held) == sorted(
        r for r in range(cfg.serving_ranks) for _ in range(planned.per_gpu)
    )
    for lease in held:
        lease.release()
    await admission.close()


@pytest.mark.parametrize("kind", ["local", "redis"])
async def test_a_data_parallel_groups_leases_hold_room_on_the_rank_they_name(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Each rank of a data-parallel group is an account of its own in the ledger (the
    in-process one, or Redis shared by replicas): a lease holds room on one rank and names
    it. Each rank holds one large job but not a large and a small one: with both large jobs
    admitted, the group's free sum would hold a small one, yet no rank can, so it waits, and
    is admitted on the rank whose large job ends."""
    sizer = SessionSizer()
    small, large = job("small"), job("large", prompt=100, max_tokens=200)
    probe = worker("probe")
    need_small = int(sizer.required_bytes(probe, small.context_tokens) or 0)
    need_large = int(sizer.required_bytes(probe, large.context_tokens) or 0)
    per_rank = need_large + need_small - 1
    group = worker("dp", serving_ranks=2, kv_capacity_bytes=2 * per_rank, max_num_seqs=8)
    assert 2 * (per_rank - need_large) >= need_small  # the sum would admit it
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        ledger: Ledger = RedisLedger(server.url, prefix=server.prefix())
    else:
        ledger = LocalLedger()
    admission = MemoryAdmission(ledger, AdmissionConfig(poll_s=0.01))
    workers = [group]
    await admission.observe(workers)
    # admitted concurrently, they take different ranks (the ledger's choice is atomic)
    held = list(await asyncio.gather(*(admission.acquire(large, lambda: workers) for _ in "ab")))
    assert sorted((lease.worker, lease.rank) for lease in held) == [("dp", 0), ("dp", 1)]
    held.sort(key=lambda lease: lease.rank or 0)
    usage = await ledger.usage(["dp/dp0", "dp/dp1"])
    assert [usage[k].admitted_bytes for k in ("dp/dp0", "dp/dp1")] == [need_large] * 2
    assert [usage[k].capacity_bytes for k in ("dp/dp0", "dp/dp1")] == [per_rank] * 2
    assert [usage[k].max_sessions for k in ("dp/dp0", "dp/dp1")] == [4, 4]
    waiting = asyncio.create_task(admission.acquire(small, lambda: workers))
    await asyncio.sleep(0.1)
    assert not waiting.done() and admission.queue_depth(MODEL) == 1
    held[1].release()
    admitted = await asyncio.wait_for(waiting, 5)
    assert (admitted.worker, admitted.rank) == ("dp", 1)
    usage = await ledger.usage(["dp/dp0", "dp/dp1"])
    assert [usage[k].admitted_bytes for k in ("dp/dp0", "dp/dp1")] == [need_large, need_small]
    # the router and the gauges see the group as the sum of its ranks
    summed = admission.leases.usage("dp")
    assert summed is not None and summed.admitted_bytes == need_large + need_small
    held[0].release()
    admitted.release()
    await admission.close()


async def test_no_worker_to_admit_on() -> None:
    admission, _, _ = make([])
    with pytest.raises(NoWorkerAvailable):
        await admission.acquire(job("1"), lambda: [worker("a", healthy=False)])
    with pytest.raises(NoWorkerAvailable, match="capacity"):
        await admission.acquire(job("1"), lambda: [worker("a", config_json="")])
    with pytest.raises(NoWorkerAvailable):
        await admission.acquire(job("1"), lambda: [worker("a")], exclude=["a"])
    await admission.close()


async def test_a_retry_goes_to_the_front_of_the_queue() -> None:
    a, b = worker("a", sessions=1), worker("b", sessions=1)
    admission, _, workers = make([a, b], poll_s=10)
    await admission.observe(workers)
    held = [await admission.acquire(job(f"h{i}"), lambda: workers) for i in range(2)]
    waiting = asyncio.create_task(admission.acquire(job("w"), lambda: workers))
    await asyncio.sleep(0.02)
    # A request whose first worker ("b") failed before its first token tries again.
    retry = asyncio.create_task(admission.acquire(job("r"), lambda: workers, exclude=["b"]))
    await asyncio.sleep(0.02)
    assert admission.queue_depth(MODEL) == 2
    held[0].release()  # frees "a"
    lease = await asyncio.wait_for(retry, 1)
    assert lease.worker == "a" and not waiting.done()
    lease.release()
    (await asyncio.wait_for(waiting, 1)).release()
    held[1].release()
    await admission.close()


async def test_leases_are_renewed_while_held_and_reclaimed_when_not() -> None:
    admission, _, workers = make([worker("a")], lease_ttl_s=0.15)
    await admission.start()
    await admission.observe(workers)
    lease = await admission.acquire(job("1"), lambda: workers)
    # A lease recorded by a gateway that died: nobody renews it.
    assert await admission.ledger.acquire("orphan", [Candidate("a", NEED)], 0.15)
    await asyncio.sleep(0.5)
    await admission.observe(workers)  # a poll reclaims what expired
    usage = (await admission.ledger.usage(["a"]))["a"]
    assert (usage.sessions, usage.admitted_bytes) == (1, NEED)
    lease.release()
    await admission.close()


async def test_a_dead_workers_leases_are_released_after_the_grace() -> None:
    admission, metrics, workers = make([worker("a"), worker("b")], worker_dead_after_s=0.2)
    await admission.observe(workers)
    leases = [await admission.acquire(job(str(i)), lambda: workers) for i in range(4)]
    assert {lease.worker for lease in leases} == {"a", "b"}
    down = [worker("a", healthy=False), workers[1]]
    await admission.observe(down)
    assert (await admission.ledger.usage(["a"]))["a"].sessions == 2  # within the grace
    await asyncio.sleep(0.25)
    await admission.observe(down)
    usage = await admission.ledger.usage(["a", "b"])
    assert (usage["a"].sessions, usage["b"].sessions) == (0, 2)
    assert admission.live_leases == 2
    free = sample(metrics, names.FREE_CAPACITY_BYTES, model=MODEL, worker="a")
    assert free == 2 * NEED
    assert sample(metrics, names.ADMITTED_SESSIONS, model=MODEL, worker="b") == 2
    assert sample(metrics, names.ADMITTED_BYTES, model=MODEL, worker="b") == 2 * NEED
    for lease in leases:
        lease.release()
    await admission.close()


class SlowLedger(LocalLedger):
    async def acquire(self, lease_id, candidates, ttl_s):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.05)
        return await super().acquire(lease_id, candidates, ttl_s)


async def test_cancelling_during_the_ledger_call_leaks_nothing() -> None:
    ledger = SlowLedger()
    admission = MemoryAdmission(ledger, AdmissionConfig())
    workers = [worker("a")]
    await admission.observe(workers)
    task = asyncio.create_task(admission.acquire(job("1"), lambda: workers))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)  # the ledger call finished after the cancel
    assert (await ledger.usage(["a"]))["a"].sessions == 0
    await admission.close()


def test_sizing_uses_the_workers_reported_kv_layout() -> None:
    """A bf16 worker with 64-row pages, B = 128 and a 128-row tail is sized as exactly that."""
    import json

    layout = {"kv_dtype_bytes": 2, "page_size": 64, "hot_cache_rows": 128, "tail_rows": 128}
    sizer = SessionSizer(page_size=16)
    w = worker("a", mode="hisparse", kv_layout_json=json.dumps(layout))
    profile = profile_from_model_config(
        CONFIG, kv_dtype_bytes=2, page_size=64, hot_cache_rows=128, tail_pages=2
    )
    for tokens in (100, 5000):
        assert sizer.required_bytes(w, tokens) == required_bytes(profile, tokens, "hierarchy")
    default = sizer.required_bytes(worker("a", mode="hisparse"), 5000)
    assert sizer.required_bytes(w, 5000) != default


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_the_index_keys_the_gateway_sizes_are_the_pages_a_worker_admission_takes(
    mode: str,
) -> None:
    """A hierarchy worker lays index keys in pages of its payload pool and reports how many
    keys a page holds; the gateway then sizes a session's keys to exactly the pages the
    worker's admission reserves for them."""
    from dhisparse.capacity import session_bytes
    from services.gateway.sizing import capacity_mode
    from services.worker.kv.config import KVCacheConfig
    from services.worker.serving.cache import KVCache

    kv = KVCache(
        CONFIG,
        KVCacheConfig(
            mode=mode, page_size=16, max_slots=2, max_model_len=6000, kv_pool_bytes=16 << 20,
            host_arena_bytes=32 << 20, max_prefill_tokens=512,
        ),
    )  # fmt: skip
    try:
        layout = kv.layout()
        assert layout["index_key_page_rows"] == 16 * CONFIG.d_kv // CONFIG.d_index
        w = worker("a", mode=mode, kv_layout_json=json.dumps(layout))
        profile = SessionSizer()._build_profile(w.config_json, w.kv_layout_json)
        page_bytes = kv.payload.store.page_bytes
        for tokens in (100, 1000, 5000):
            sized = session_bytes(profile, tokens, capacity_mode(mode)).index_keys
            assert sized == kv.index_keys.pages_for(tokens) * page_bytes
        # what the gateway charges covers the keys an admission of that budget reserves
        # (a verification block beyond it), whichever page boundary the budget ends near
        for budget in range(3990, 4010):
            keys = kv.admission_pages(None, budget, budget) - kv.payload.required_pages
            tokens = budget + layout["spec_block"]
            assert SessionSizer().required_bytes(w, budget) == required_bytes(
                profile, tokens, "hierarchy"
            )
            assert session_bytes(profile, tokens, "hierarchy").index_keys == keys * page_bytes
    finally:
        kv.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_an_fp8_worker_is_sized_in_its_packed_bytes(mode: str) -> None:
    """A worker with ``kv_cache_dtype="fp8"`` reports packed rows (100 B for the tiny preset)
    and keys (36 B; 40 in the hierarchy modes, padded to whole keys per page of rows): the
    gateway sizes exactly those, as it sizes the index-key pages an admission takes."""
    from dhisparse.capacity import session_bytes
    from services.gateway.sizing import capacity_mode
    from services.worker.kv.config import KVCacheConfig
    from services.worker.serving.cache import KVCache

    def cache(kv_cache_dtype: str) -> KVCache:
        return KVCache(
            CONFIG,
            KVCacheConfig(
                mode=mode, page_size=16, max_slots=2, max_model_len=6000, kv_pool_bytes=16 << 20,
                host_arena_bytes=32 << 20, max_prefill_tokens=512, kv_cache_dtype=kv_cache_dtype,
            ),
        )  # fmt: skip

    kv, plain = cache("fp8"), cache("auto")
    try:
        layout = kv.layout()
        assert layout["kv_cache_dtype"] == "fp8" and layout["row_bytes"] == 100
        w = worker("a", mode=mode, kv_layout_json=json.dumps(layout))
        w_plain = worker("a", mode=mode, kv_layout_json=json.dumps(plain.layout()))
        profile = SessionSizer()._build_profile(w.config_json, w.kv_layout_json)
        assert {s.row_bytes for s in profile.sources} == {100}
        assert {g.key_bytes for g in profile.indexers} == {layout["index_key_bytes"]}
        for tokens in (100, 1000, 5000):
            fp8_need = SessionSizer().required_bytes(w, tokens)
            assert fp8_need < SessionSizer().required_bytes(w_plain, tokens)
            if mode != "resident":
                page_bytes = kv.payload.store.page_bytes
                sized = session_bytes(profile, tokens, capacity_mode(mode)).index_keys
                assert sized == kv.index_keys.pages_for(tokens) * page_bytes
    finally:
        kv.close()
        plain.close()
