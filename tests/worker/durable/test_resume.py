"""Durable sessions in process: an engine dropped mid-generation without releasing anything
(its process "died"; the host store and arena live on) is succeeded by a new engine of the same
worker id, which adopts the sessions, resumes them without recomputing a prompt and produces
exactly the tokens an uninterrupted run produces — greedy and seeded sampling, both presets
(tiny-dsv4 has a compressed, windowed source: its token ring comes from the manifest)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from services.kv_host_store.errors import FailedPrecondition
from services.worker.async_engine import AsyncEngine, SessionNotFound
from services.worker.durable.adoption import adopt_sessions
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.request.request import SamplingParams
from services.worker.request.stop import TextStream
from services.worker.speculative.config import SpeculationConfig

PROMPTS = [list(range(10, 50)), list(range(60, 85))]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=72, ignore_eos=True),
]


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


def make(
    store: LocalHostStore,
    model: str,
    mode: str = "hisparse",
    owner: str = "w0",
    kv_cache_dtype: str = "auto",
) -> Engine:
    cfg = EngineConfig(
        model=model, mode=mode, kv_pool_mib=48, max_num_seqs=4, max_model_len=512, owner=owner,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    engine = Engine(cfg, host=(store, store.mapping))
    HostLink(store, owner, 30.0, engine.kv.host_backups).register()
    return engine


def start(engine: Engine, steps: int) -> None:
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    for _ in range(steps):
        engine.step()


def successor(
    store: LocalHostStore, model: str, mode: str = "hisparse", kv_cache_dtype: str = "auto"
) -> Engine:
    engine = make(store, model, mode, kv_cache_dtype=kv_cache_dtype)
    report = adopt_sessions(engine, store, "w0", engine.kv.host_backups.generation)
    assert report.resumed == ["r0", "r1"] and not report.released
    return engine


@pytest.mark.parametrize(
    "model,mode",
    [("tiny-glm", "hisparse"), ("tiny-dsv4", "hisparse"), ("tiny-dsv4", "adaptive")],
)
def test_resumed_sessions_continue_token_for_token(store, model: str, mode: str) -> None:
    ref = make(store, model, mode, owner="ref")
    want = [r.output_ids for r in ref.generate(PROMPTS, PARAMS)]
    del ref
    first = make(store, model, mode)
    start(first, 25)
    del first  # dies: no release, no flush; the arena and the store outlive it
    second = successor(store, model, mode)
    reqs = [second.requests["r0"], second.requests["r1"]]
    assert [len(r.output_ids) for r in reqs] == [25, 25]
    while second.has_work():
        second.step()
    assert [r.output_ids for r in reqs] == want
    assert second.stats.prefill_tokens_computed == 0  # nothing of a prompt was recomputed
    assert second.stats.sessions_resumed == 2
    second.kv.host_backups.flush()
    assert store.stats().requests == 0 and store.stats().adoptions == 2  # finished: released


@pytest.mark.parametrize("model,mode", [("tiny-glm", "hisparse"), ("tiny-dsv4", "adaptive")])
def test_resumed_fp8_sessions_continue_token_for_token(store, model: str, mode: str) -> None:
    """``kv_cache_dtype="fp8"``: host backups and backed-up index keys are packed FP8 bytes;
    the successor reads them back as they were, so it gives the uninterrupted fp8 run's
    tokens (which differ from the serving dtype's: the rows are quantized)."""
    fp8 = {"kv_cache_dtype": "fp8"}
    ref = make(store, model, mode, owner="ref", **fp8)
    assert ref.kv.host_backups.row_bytes == 100 and ref.kv.host_backups.dtype == torch.uint8
    want = [r.output_ids for r in ref.generate(PROMPTS, PARAMS)]
    del ref
    first = make(store, model, mode, **fp8)
    start(first, 25)
    del first
    second = successor(store, model, mode, **fp8)
    reqs = [second.requests["r0"], second.requests["r1"]]
    while second.has_work():
        second.step()
    assert [r.output_ids for r in reqs] == want
    assert second.stats.prefill_tokens_computed == 0
    second.kv.host_backups.flush()
    assert store.stats().requests == 0 and store.stats().adoptions == 2


def test_an_fp8_session_is_not_resumed_by_a_worker_that_stores_another_dtype(store) -> None:
    first = make(store, "tiny-glm", kv_cache_dtype="fp8")
    start(first, 5)
    del first
    second = make(store, "tiny-glm")  # kv_cache_dtype auto
    report = adopt_sessions(second, store, "w0", second.kv.host_backups.generation)
    assert report.resumed == [] and sorted(report.released) == ["r0", "r1"]


def test_reattach_catches_the_caller_up(store) -> None:
    ref = make(store, "tiny-glm", owner="ref")
    (want,) = ref.generate(PROMPTS[:1], PARAMS[:1])
    first = make(store, "tiny-glm")
    start(first, 20)
    del first
    second = successor(store, "tiny-glm")
    received = 12  # the client got 12 tokens before the worker died; the manifest holds 20

    async def attach() -> list:
        eng = AsyncEngine(second, detached=["r0", "r1"], attach_timeout_s=30)
        try:
            with pytest.raises(SessionNotFound):
                async for _ in eng.resume("nope", 0):
                    pass
            return [o async for o in eng.resume("r0", received)]
        finally:
            eng.shutdown()

    outs = asyncio.run(attach())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == want.output_ids[received:]
    assert outs[0].cached_prompt_tokens == len(PROMPTS[0]) and outs[-1].finished
    sent = TextStream(second.tokenizer, PROMPTS[0])
    for t in want.output_ids[:received]:
        sent.push(t)
    full = want.text.detok.text[: want.text.emitted]
    assert full[: sent.emitted] + "".join(o.text for o in outs) == full


def test_a_session_nobody_reattaches_is_released(store) -> None:
    first = make(store, "tiny-glm")
    start(first, 5)
    del first
    second = successor(store, "tiny-glm")

    async def wait() -> None:
        eng = AsyncEngine(second, detached=["r0", "r1"], attach_timeout_s=0.3)
        try:
            deadline = time.monotonic() + 10
            while eng.detached or second.has_work():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            eng.shutdown()

    asyncio.run(wait())
    second.kv.host_backups.flush()
    assert store.stats().requests == 0


def test_a_torn_manifest_releases_the_session_and_a_live_owner_keeps_its_own(store) -> None:
    first = make(store, "tiny-glm")
    start(first, 5)
    other = make(store, "tiny-glm", owner="w1")  # a live worker on the same node
    assert adopt_sessions(other, store, "w1", other.kv.host_backups.generation).resumed == []
    with pytest.raises(FailedPrecondition, match="not adoptable"):
        store.adopt("r0", "w1", other.kv.host_backups.generation)
    manifest = first.kv.sessions.manifest_buffer(first.requests["r1"].slot).numpy()
    manifest[:, 20] ^= np.uint8(0xFF)  # both halves corrupt
    del first
    second = make(store, "tiny-glm")
    report = adopt_sessions(second, store, "w0", second.kv.host_backups.generation)
    assert report.resumed == ["r0"]
    assert "checksum mismatch" in report.released["r1"]
    assert [i.request_id for i in store.list_requests("w0")] == ["r0"]


class DeadStore:
    """A host store that stopped answering."""

    def __init__(self, store: LocalHostStore) -> None:
        self._store = store

    def allocate(self, *args, **kwargs):
        raise ConnectionError("UNAVAILABLE: failed to connect to all addresses")

    allocate_many = allocate

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_admissions_fail_fast_when_the_store_is_down_or_full(store) -> None:
    cfg = EngineConfig(model="tiny-glm", mode="hisparse", kv_pool_mib=48, max_num_seqs=4)
    engine = Engine(cfg, host=(DeadStore(store), store.mapping))
    engine.add_request("a", PROMPTS[0], PARAMS[0])
    (out,) = engine.step()
    assert out.finished and out.error is not None and out.error.code == "unavailable"
    assert "host KV store unavailable: UNAVAILABLE" in out.error.message
    assert not engine.has_work()

    tiny = LocalHostStore(64 << 10)  # too small for one session's regions
    try:
        engine = Engine(cfg, host=(tiny, tiny.mapping))
        engine.add_request("b", PROMPTS[0], PARAMS[0])
        (out,) = engine.step()
        assert out.error is not None and out.error.code == "resource_exhausted"
        assert "host KV store full" in out.error.message
    finally:
        tiny.close()


def test_durability_by_mode(store) -> None:
    assert Engine(EngineConfig(mode="resident", kv_pool_mib=8)).kv.sessions is None
    off = EngineConfig(mode="hisparse", kv_pool_mib=48, max_num_seqs=4, durable_sessions=False)
    assert Engine(off, host=(store, store.mapping)).kv.sessions is None
    # Adaptive residency keeps imported pages on the device and still backs them up at once.
    engine = make(store, "tiny-glm", mode="adaptive")
    engine.add_request("a", list(range(200)), PARAMS[0])
    engine.step()
    req = engine.requests["a"]
    residency = engine.kv.payload.residency
    assert residency.optional_pages > 0
    assert all(pg.backed for pg in residency.pages_of(req.slot).values())
    for s in range(len(engine.model_cfg.sources)):
        assert engine.kv.host_backups.durable(
            req.slot, s, 0, engine.kv.payload.store.committed[req.slot][s]
        )
    engine.kv.payload.residency.check()


def test_resume_under_speculative_decoding(store) -> None:
    """The drafter's context is not durable: a resumed session drafts from an empty context
    (acceptance recovers as it refills); verification keeps the target's greedy tokens."""
    cfg = EngineConfig(
        model="tiny-glm", mode="hisparse", kv_pool_mib=48, max_num_seqs=4, max_model_len=512,
        owner="w0", speculation=SpeculationConfig("dflash", width=4),
    )  # fmt: skip

    def engine() -> Engine:
        e = Engine(cfg, host=(store, store.mapping))
        HostLink(store, "w0", 30.0, e.kv.host_backups).register()
        return e

    (want,) = engine().generate(PROMPTS[:1], PARAMS[:1])
    first = engine()
    first.add_request("r0", PROMPTS[0], PARAMS[0])
    for _ in range(8):
        first.step()
    del first
    second = engine()
    assert adopt_sessions(second, store, "w0", second.kv.host_backups.generation).resumed == ["r0"]
    req = second.requests["r0"]
    while second.has_work():
        second.step()
    assert req.output_ids == want.output_ids
    assert second.stats.prefill_tokens_computed == 0


def test_a_request_started_over_replaces_its_resumed_copy(store) -> None:
    """A worker that died after a request's first step but before its first token reached
    the gateway: the gateway retries it from scratch under the same id."""
    first = make(store, "tiny-glm")
    start(first, 1)
    del first
    second = successor(store, "tiny-glm")

    async def again() -> list:
        eng = AsyncEngine(second, detached=["r0", "r1"], attach_timeout_s=30)
        try:
            return [o async for o in eng.generate("r0", PROMPTS[0], PARAMS[0])]
        finally:
            eng.shutdown()

    outs = asyncio.run(again())
    assert outs[-1].finished and outs[-1].completion_tokens == PARAMS[0].max_tokens
    # computed afresh, but for the pages of its prompt the aborted resumed copy left behind
    imported = second.scheduler.prefix.stats.hit_tokens
    assert imported == len(PROMPTS[0]) // 16 * 16
    assert second.stats.prefill_tokens_computed + imported == len(PROMPTS[0])
