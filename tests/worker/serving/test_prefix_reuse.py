"""Prefix reuse over the hierarchy: a conversation's next turn (its first turn's prompt, the
answer and a new question) imports the pages the first turn left in the node's host store and
computes only its new tokens, with the greedy tokens of the same prompt served with no cache.

Engines share one ``LocalHostStore`` as workers of one node share the store process (the
real store logic in this process, as the durable-session tests run it). Under batch-invariant
numerics (``batch_invariant.py``) rows do not depend on how a prompt was split into passes, so
equality there is exact; the trained model runs the ordinary numerics."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from dhisparse import metrics as m
from services.kv_host_store.metrics import build_registry
from services.worker.cli import add_arguments, settings_from_args
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.prefix_setup import off_reason
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.metrics import WorkerMetrics, config_labels
from services.worker.request.request import Request, SamplingParams
from services.worker.serving.device_prefix import DevicePrefixReuse
from services.worker.speculative.config import SpeculationConfig
from tests.worker.engine.batch_invariant import batch_invariant
from tests.worker.mtp_fixture import record_drafts

TRAINED = "models/glm-dsa-mini"
SOURCE = Path(__file__).resolve().parents[3] / "services/kv_host_store/intervals.py"
ANSWER = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


def make(store: LocalHostStore, owner: str, **kw) -> Engine:
    base = dict(model="tiny-glm", mode="hisparse", kv_pool_mib=48, max_num_seqs=4)
    cfg = EngineConfig(**{**base, "max_model_len": 512, "owner": owner, **kw})
    engine = Engine(cfg, host=(store, store.mapping))
    HostLink(store, owner, 30.0, engine.kv.host_backups).register()
    return engine


def run(engine: Engine, prompt: list[int], params: SamplingParams = ANSWER) -> Request:
    before = engine.stats.prefill_tokens_computed
    (req,) = engine.generate([prompt], params)
    req.computed = engine.stats.prefill_tokens_computed - before  # type: ignore[attr-defined]
    return req


def second_turn(first: Request, question: list[int]) -> list[int]:
    return [*first.prompt_ids, *first.output_ids, *question]


@pytest.mark.parametrize(
    "mode,kv_cache_dtype", [("hisparse", "auto"), ("adaptive", "auto"), ("adaptive", "fp8")]
)
def test_the_next_turn_computes_only_its_new_tokens_with_the_uncached_tokens(
    store: LocalHostStore, mode: str, kv_cache_dtype: str
) -> None:
    """Turn 1 on worker w0, turn 2 on worker w1 of the same node: w1 imports what w0 left
    (in fp8, packed rows and keys, copied as they are)."""
    kw = dict(mode=mode, kv_cache_dtype=kv_cache_dtype)
    with batch_invariant():
        w0, w1 = make(store, "w0", **kw), make(store, "w1", **kw)
        first = run(w0, list(range(10, 100)))
        assert w0.scheduler.prefix is not None and w0.scheduler.prefix.stats.left == 1
        prompt = second_turn(first, [7, 8, 9, 10, 11])
        turn = run(w1, prompt)
        ref = run(make(store, "ref", prefix_cache=False, **kw), prompt)
    assert turn.output_ids == ref.output_ids
    assert ref.computed == len(prompt) and turn.computed <= 0.1 * len(prompt)
    stats = w1.scheduler.prefix.stats
    assert (stats.hits, stats.hit_tokens) == (1, len(prompt) - turn.computed)
    assert turn.output().cached_prompt_tokens == stats.hit_tokens
    assert stats.hit_tokens % 16 == 0  # whole pages


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_requests_arriving_together_compute_a_shared_system_prompt_once(
    store: LocalHostStore, mode: str
) -> None:
    """Four requests with one 256-token system prompt arrive at once; a step prefills one of
    them. Its prompt is published as soon as it is computed, and the others import the system
    prompt's pages and compute only their own tokens, with the uncached tokens."""
    system = [3 + i * 7 % 250 for i in range(256)]
    prompts = [system + [5 + s, 9, 4 + 3 * s, 11] * 5 for s in range(4)]
    kw = dict(mode=mode, max_prefill_tokens=len(prompts[0]))
    with batch_invariant():
        engine = make(store, "w0", **kw)
        outs = engine.generate(prompts, ANSWER)
        ref = make(store, "ref", prefix_cache=False, **kw).generate(prompts, ANSWER)
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]
    stats = engine.scheduler.prefix.stats
    assert stats.published == 1 and stats.hits == 3
    assert engine.stats.prefill_tokens_computed == len(prompts[0]) + 3 * (len(prompts[0]) - 256)


def test_adaptive_mode_brings_an_imported_prefix_back_to_the_device(store: LocalHostStore) -> None:
    """In adaptive mode the pages of an imported prefix are optional history like a prefill's:
    while memory is spare they are refilled from the host between steps, and the resolver
    reads them on the device (not through the hot cache and host misses), with the uncached
    tokens."""
    with batch_invariant():
        w0 = make(store, "w0", mode="adaptive")
        first = run(w0, [3 + i % 250 for i in range(290)])
        prompt = second_turn(first, [7, 8, 9, 10])
        w1 = make(store, "w1", mode="adaptive")
        turn = run(w1, prompt)
        ref = run(make(store, "ref", mode="adaptive", prefix_cache=False), prompt)
    assert turn.output_ids == ref.output_ids
    assert turn.computed < 0.1 * len(prompt)
    stats = w1.kv.payload.residency.stats
    imported_pages = (len(prompt) - turn.computed) // w1.cfg.page_size
    # every source's imported pages, refilled (none were evicted: memory is spare)
    assert stats.repopulated_pages >= imported_pages * w1.kv.payload.store.num_sources
    census = w1.kv.payload.census
    assert census is not None and census.host < census.direct


@pytest.mark.parametrize("drafter", [None, "mtp"])
def test_the_trained_model_with_a_prefix_hit_gives_the_uncached_tokens(
    store: LocalHostStore, drafter: str | None
) -> None:
    """The shipped trained model (it writes Python), ordinary numerics: a three-turn
    conversation in tokens, each turn a short addition to a long history; plainly, and
    speculating with its MTP layer as ``make run`` does."""
    kw = dict(model=TRAINED, mode="adaptive", max_model_len=1024, kv_pool_mib=160, max_num_seqs=2)
    if drafter is not None:
        kw["speculation"] = SpeculationConfig(drafter, 4)
    engine = make(store, "w0", **kw)
    tok = engine.tokenizer
    short = replace(ANSWER, max_tokens=12)
    first = run(engine, tok.encode(SOURCE.read_text()[:900]), short)
    second = run(engine, second_turn(first, tok.encode("\n\ndef merge(")), short)
    third_prompt = second_turn(second, tok.encode("\n\nclass Range:"))
    third = run(engine, third_prompt, short)
    ref = make(store, "ref", prefix_cache=False, **kw)
    assert second.output_ids == run(ref, second.prompt_ids, short).output_ids
    assert third.output_ids == run(ref, third_prompt, short).output_ids
    assert second.computed <= 0.1 * len(second.prompt_ids)
    assert third.computed <= 0.1 * len(third_prompt)
    assert engine.scheduler.prefix.stats.hits == 2


def test_a_salted_mismatch_never_shares(store: LocalHostStore) -> None:
    """Other weights (the preset's seed) or another KV dtype: the same tokens find nothing."""
    w0 = make(store, "w0")
    first = run(w0, list(range(10, 80)))
    prompt = second_turn(first, [1, 2, 3])
    for other in (make(store, "seed", seed=1), make(store, "fp8", kv_cache_dtype="fp8")):
        turn = run(other, prompt)
        assert other.scheduler.prefix.stats.hits == 0 and turn.computed == len(prompt)
    assert run(make(store, "same"), prompt).computed < len(prompt)


def test_cached_prefixes_outlive_the_worker_that_left_them(store: LocalHostStore) -> None:
    w0 = make(store, "w0")
    first = run(w0, list(range(10, 150)))
    del w0  # dies without releasing anything; the store owns what it left
    w1 = make(store, "w0")  # its successor, a new generation of the same worker id
    prompt = second_turn(first, [4, 5])
    with batch_invariant():
        turn = run(w1, prompt)
        ref = run(make(store, "ref", prefix_cache=False), prompt)
    assert turn.output_ids == ref.output_ids and turn.computed <= 0.1 * len(prompt)


def test_the_arena_full_of_cached_prefixes_evicts_no_live_row() -> None:
    """A small arena: a long request decodes while one short request after another finishes
    and leaves its pages, far more than the arena holds. Cached prefixes are evicted; the long
    request's rows never are (its tokens equal a run alone), and it still finds its regions."""
    store = LocalHostStore(2 << 20)
    try:
        long_prompt = list(range(150, 250))
        with batch_invariant():
            alone = run(make(store, "ref", prefix_cache=False), long_prompt, _long())
            w0 = make(store, "w0")
            live = w0.add_request("live", long_prompt, _long())
            w0.step()
            gen = w0.kv.host_backups.generation

            def where() -> list[tuple[str, int, int]]:
                return [(r.region_id, r.offset, r.nbytes) for r in store.lookup("live", "w0", gen)]

            held = where()
            short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            for i in range(24):
                prompt = [i, *((100 + 5 * i + j) % 256 for j in range(64))]
                w0.add_request(f"s{i}", prompt, short)
                while w0.request(f"s{i}") is not None:
                    w0.step()
                    assert where() == held
            while w0.has_work():
                w0.step()
        s = store.stats()
        assert w0.scheduler.prefix.stats.left > s.prefix_records and s.prefix_evictions > 0
        assert live.output_ids == alone.output_ids
    finally:
        store.close()


def test_a_drafter_with_a_context_of_its_own_drafts_after_a_hit_as_without(
    store: LocalHostStore,
) -> None:
    """The shipped model's DFlash2 (a draft ring of the target's features at the last W = 256
    positions): a next turn that adds W tokens or more imports every cached page, and its
    prefill gives the ring what the uncached request's did: every proposal after the hit
    equals the uncached engine's, and so does every token."""
    spec = SpeculationConfig(f"{TRAINED}/drafters/dflash2", 4)
    kw = dict(model=TRAINED, mode="adaptive", max_model_len=1024, kv_pool_mib=160,
              max_num_seqs=2, speculation=spec)  # fmt: skip
    drafts: dict[str, dict[tuple[int, int], list[int]]] = {}
    short = replace(ANSWER, max_tokens=12)

    def build(owner: str, **more) -> Engine:
        engine = make(store, owner, **{**kw, **more})
        record_drafts(engine, drafts.setdefault(owner, {}))
        return engine

    with batch_invariant():
        w0 = build("w0")
        text = w0.tokenizer.encode(SOURCE.read_text())
        first = run(w0, text[:64], short)
        prompt = second_turn(first, text[64:320])
        w1 = build("w1")
        turn = run(w1, prompt, short)
        alone = run(build("ref", prefix_cache=False), prompt, short)
    assert len(prompt) - len(first.prompt_ids) - len(first.output_ids) >= 256
    stats = w1.scheduler.prefix.stats
    cached = (len(first.prompt_ids) + len(first.output_ids) - 1) // 16 * 16
    assert (stats.hits, stats.hit_tokens) == (1, cached)
    assert turn.computed == len(prompt) - cached
    assert turn.output_ids == alone.output_ids
    assert drafts["w1"] and drafts["w1"] == drafts["ref"]


def test_a_short_turn_leaves_the_drafters_context_to_compute(store: LocalHostStore) -> None:
    """A turn adding fewer tokens than the drafter's window W imports only the pages before its
    last W tokens (the prefill computes the rest, the drafter's context among them), with the
    uncached tokens."""
    kw = dict(speculation=SpeculationConfig("dflash", 4))
    with batch_invariant():
        w0, w1 = make(store, "w0", **kw), make(store, "w1", **kw)
        first = run(w0, [10 + i % 250 for i in range(390)])
        prompt = second_turn(first, [7, 8, 9, 10, 11])
        turn = run(w1, prompt)
        alone = run(make(store, "ref", prefix_cache=False, **kw), prompt)
    window = w1.speculator.drafter.context_window
    stats = w1.scheduler.prefix.stats
    assert 0 < stats.hit_tokens == (len(prompt) - window) // 16 * 16
    assert stats.hit_tokens < (len(first.prompt_ids) + len(first.output_ids) - 1) // 16 * 16
    assert turn.output_ids == alone.output_ids


def _long() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


def test_what_turns_prefix_reuse_off(store: LocalHostStore) -> None:
    on = make(store, "w0")
    assert off_reason(on.cfg, on.kv) is None
    assert off_reason(replace(on.cfg, prefix_cache=False), on.kv) == "--no-prefix-cache"
    resident = Engine(EngineConfig(mode="resident", kv_pool_mib=48, max_model_len=512))
    assert isinstance(resident.scheduler.prefix, DevicePrefixReuse)  # device pages shared
    assert off_reason(resident.cfg, resident.kv) is None
    dflash = make(store, "dflash", speculation=SpeculationConfig("dflash", 4))
    assert dflash.scheduler.prefix is not None and off_reason(dflash.cfg, dflash.kv) is None
    assert dflash.scheduler.prefix.context == dflash.speculator.drafter.context_window > 0
    v4 = make(store, "v4", model="tiny-dsv4")  # token rings: their rows go with a prefix
    assert v4.scheduler.prefix is not None and off_reason(v4.cfg, v4.kv) is None
    no_store = Engine(EngineConfig(mode="hisparse", kv_pool_mib=48, max_model_len=512))
    assert no_store.scheduler.prefix is None
    assert "durable sessions" in off_reason(no_store.cfg, no_store.kv)
    no_store.close()


def test_a_request_asking_for_prompt_logprobs_computes_its_whole_prompt(
    store: LocalHostStore,
) -> None:
    w0 = make(store, "w0")
    first = run(w0, list(range(10, 80)))
    prompt = second_turn(first, [1, 2])
    scored = run(w0, prompt, replace(ANSWER, max_tokens=2, prompt_logprobs=0))
    assert scored.computed == len(prompt)


def test_no_prefix_cache_on_the_command_line_turns_it_off() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert settings_from_args(p.parse_args([])).engine_config().prefix_cache is True
    off = settings_from_args(p.parse_args(["--no-prefix-cache"]))
    assert off.prefix_cache is False and off.engine_config().prefix_cache is False


def test_the_metrics_count_hits_and_the_store_exports_what_it_holds(
    store: LocalHostStore,
) -> None:
    w0 = make(store, "w0")
    metrics = WorkerMetrics("t")
    metrics.describe(w0)
    first = run(w0, list(range(10, 80)))
    metrics.on_step(w0, [])
    prompt = second_turn(first, [1, 2])
    turn = run(w0, prompt)
    metrics.on_step(w0, [])

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model": "t", **labels})

    assert sample(m.WORKER_CONFIG_INFO, **_info(w0)) == 1
    assert sample(f"{m.PREFIX_CACHE_QUERIES}_total") == 2
    assert sample(f"{m.PREFIX_CACHE_HITS}_total") == 1
    assert sample(f"{m.PREFIX_CACHE_HIT_TOKENS}_total") == len(prompt) - turn.computed
    assert sample(f"{m.PREFIX_CACHE_LEFT}_total", outcome="cached") == 2
    assert sample(f"{m.PREFILL_TOKENS_COMPUTED}_total") == first.computed + turn.computed
    exported = build_registry(store.store)
    held = store.stats()
    assert exported.get_sample_value(m.HOST_STORE_PREFIX_RECORDS) == held.prefix_records == 1
    assert exported.get_sample_value(m.HOST_STORE_PREFIX_BYTES) == held.prefix_bytes > 0
    assert exported.get_sample_value(f"{m.HOST_STORE_PREFIX_EVICTIONS}_total") == 0


def _info(engine: Engine) -> dict[str, str]:
    labels = config_labels(engine)
    assert labels["prefix_cache"] == "on"
    return labels
