"""The start-up warm-up (``engine.warm_up``): a two-turn synthetic conversation through an idle
engine, its second turn importing the first's pages where prefix reuse is on (the node's host
store in the hierarchy modes, shared device pages in resident mode) and computing only the
rest; nothing of it left running; a client's greedy tokens afterwards those of a fresh engine;
an engine with requests, or too short a context, left alone (and why); the second turn under
a grammar; the worker's metrics counting from after it; the setting's default (on a GPU)."""

from __future__ import annotations

import pytest

from dhisparse import metrics as m
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.warm_up import DECODE_TOKENS, skip_reason, turn_lengths, warm_up
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.metrics import WorkerMetrics
from services.worker.request.request import SamplingParams
from services.worker.settings import WorkerSettings

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 for i in range(150)]


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


def make(mode: str, store: LocalHostStore | None, owner: str = "w", **kw) -> Engine:
    """tiny-glm with prefill chunks of 64 tokens (the warm-up's first turn spans two)."""
    base = dict(model="tiny-glm", mode=mode, kv_pool_mib=16, max_num_seqs=4, max_model_len=512,
                max_prefill_tokens=64, owner=owner)  # fmt: skip
    cfg = EngineConfig(**{**base, **kw})
    if store is None:
        return Engine(cfg)
    engine = Engine(cfg, host=(store, store.mapping))
    HostLink(store, owner, 30.0, engine.kv.host_backups).register()
    return engine


@pytest.mark.parametrize("mode", ["resident", "adaptive", "hisparse"])
def test_the_second_turn_imports_the_first_and_nothing_stays(mode: str, store) -> None:
    engine = make(mode, None if mode == "resident" else store)
    first, added = turn_lengths(engine)
    assert first == 64 + 3 * 16 + 5 and added == 2 * 16 + 7
    done = warm_up(engine)
    assert done is not None and done.requests == 2
    assert done.prompt_tokens == first + (first + DECODE_TOKENS + added)
    # the second turn computed its new tokens and what its last page began, not the first turn's
    computed = engine.prefill_tokens_computed
    assert first < computed < first + DECODE_TOKENS + added + 16
    assert engine.scheduler.prefix.stats.hits == 1
    assert engine.grammar_masks.started  # the second turn decoded under a grammar
    assert not engine.has_work() and engine.request_ids() == []
    engine.close()


@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_a_client_after_it_gets_a_fresh_engines_tokens(mode: str, store) -> None:
    host = None if mode == "resident" else store
    warm = make(mode, host, owner="warm")
    assert warm_up(warm) is not None
    (after,) = warm.generate([PROMPT], GREEDY)
    fresh = make(mode, host, owner="fresh")
    (want,) = fresh.generate([PROMPT], GREEDY)
    assert after.output_ids == want.output_ids
    warm.close()
    fresh.close()


def test_an_engine_with_requests_or_a_short_context_is_left_alone(store) -> None:
    engine = make("adaptive", store)
    req = engine.add_request("client", PROMPT, GREEDY)
    assert skip_reason(engine) == "sessions resumed" and warm_up(engine) is None
    assert engine.request_ids() == ["client"] and req.output_ids == []
    engine.close()
    short = make("resident", None, max_model_len=32)
    assert turn_lengths(short) is None and warm_up(short) is None
    assert skip_reason(short) == "the context is too short"
    short.close()


def test_the_metrics_count_from_after_it(store) -> None:
    engine = make("adaptive", store)
    assert warm_up(engine) is not None
    metrics = WorkerMetrics("t")
    metrics.start_after(engine)

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": "t", **labels})

    assert value(f"{m.PREFILL_TOKENS_COMPUTED}_total") == 0
    assert value(f"{m.PREFIX_CACHE_HITS}_total") == 0
    assert value(f"{m.DECODE_PASSES}_total", path="eager") == 0
    assert value(f"{m.ENGINE_SECONDS}_total", phase="prefill") == 0
    assert value(f"{m.TIME_TO_FIRST_TOKEN}_count") == 0
    engine.add_request("client", PROMPT, GREEDY)
    while engine.has_work():
        metrics.on_step(engine, engine.step())
    assert value(f"{m.PREFILL_TOKENS_COMPUTED}_total") == len(PROMPT)
    assert value(f"{m.DECODE_PASSES}_total", path="eager") == GREEDY.max_tokens - 1
    assert value(f"{m.TIME_TO_FIRST_TOKEN}_count") == 1
    engine.close()


def test_on_by_default_on_a_gpu() -> None:
    assert WorkerSettings().warms_up("cuda:0") and not WorkerSettings().warms_up("cpu")
    assert WorkerSettings(warmup=True).warms_up("cpu")
    assert not WorkerSettings(warmup=False).warms_up("cuda")


async def test_a_worker_started_warm_serves_a_fresh_engines_tokens(port: int, caplog) -> None:
    """``start_server`` with ``warmup``: warmed before it serves (logged), and a client's
    greedy tokens those of an offline engine."""
    import logging

    import grpc

    from dhisparse.rpc import worker_pb2 as pb
    from dhisparse.rpc import worker_pb2_grpc as pb_grpc
    from services.worker.server import start_server

    settings = WorkerSettings(model="tiny-glm", port=port, metrics_port=0, worker_id="w0",
                              kv_pool_mib=8, mode="resident", max_prefill_tokens=64,
                              warmup=True)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="services.worker.server"):
        server, engine = await start_server(settings)
    assert any("warmed up in" in r.getMessage() for r in caplog.records)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.WorkerStub(channel)
        params = pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ids: list[int] = []
        async for resp in stub.Generate(
            pb.GenerateRequest(request_id="c", prompt_token_ids=PROMPT, sampling=params)
        ):
            ids.extend(resp.token_ids)
    finally:
        await channel.close()
        await server.stop(grace=None)
        engine.shutdown()
    offline = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=8, mode="resident"))
    (want,) = offline.generate([PROMPT], GREEDY)
    assert ids == want.output_ids
    offline.close()
