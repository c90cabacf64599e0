"""Worker metrics sample the census (a device read) at most every ``sample_every_s`` and when
the engine runs out of work; the counters end exact."""

from __future__ import annotations

import pytest
import torch

from dhisparse import metrics as m
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.heap import GcPauses
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.metrics import WorkerMetrics
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig


def _rows(metrics: WorkerMetrics) -> float:
    return sum(
        metrics.registry.get_sample_value(f"{m.RESOLVER_ROWS}_total", {"model": "t", "path": p})
        or 0.0
        for p in ("direct", "hot", "host")
    )


def test_the_census_is_sampled_and_exact_once_idle() -> None:
    engine = Engine(
        EngineConfig(
            model="tiny-glm", mode="hisparse", kv_pool_mib=48, max_num_seqs=2, max_model_len=512
        )
    )
    metrics = WorkerMetrics("t", sample_every_s=3600.0)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"r{i}", torch.randint(0, 256, (300,), generator=g).tolist(), params)
    outs = engine.step()
    metrics.on_step(engine, outs)  # the first step samples
    first = _rows(metrics)
    for _ in range(4):
        metrics.on_step(engine, engine.step())
    assert _rows(metrics) == first  # not sampled again within the interval
    while engine.has_work():
        metrics.on_step(engine, engine.step())
    c = engine.kv.payload.census
    assert _rows(metrics) == c.direct + c.hot + c.host > first  # sampled once idle: exact
    engine.close()


def test_decode_passes_are_counted_by_path() -> None:
    """Every decode step's pass is counted once; off a GPU there are no graphs, so all eager."""
    engine = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=16, max_num_seqs=3))
    metrics = WorkerMetrics("t")
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    for i, n in enumerate((20, 45, 33)):
        engine.add_request(f"r{i}", list(range(n)), params)
    while engine.has_work():
        metrics.on_step(engine, engine.step())

    def passes(path: str) -> float:
        return metrics.registry.get_sample_value(
            f"{m.DECODE_PASSES}_total", {"model": "t", "path": path}
        )

    assert engine.stats.decode_steps >= 6
    assert passes("eager") == engine.stats.decode_steps
    assert passes("graph") == passes("capture") == 0
    assert metrics.registry.get_sample_value(m.CUDA_GRAPHS, {"model": "t"}) == 0
    engine.close()


def test_engine_seconds_are_exported_by_phase() -> None:
    """The engine's wall seconds by phase, and prefix reuse's (the default engine's device
    prefixes: admissions look up, finished requests leave pages), are the scheduler's and the
    engine's own totals."""
    engine = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=16, max_num_seqs=2))
    metrics = WorkerMetrics("t")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, n in enumerate((30, 17)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), params)
    while engine.has_work():
        metrics.on_step(engine, engine.step())

    def seconds(name: str, label: str, value: str) -> float:
        return metrics.registry.get_sample_value(f"{name}_total", {"model": "t", label: value})

    want = {
        "schedule": engine.scheduler.schedule_s,
        "prefill": engine.stats.prefill_s,
        "decode": engine.stats.decode_s,
    }
    for phase, value in want.items():
        assert value > 0
        assert seconds(m.ENGINE_SECONDS, "phase", phase) == pytest.approx(value)
    assert engine.scheduler.prefix is not None
    for op, value in (("import", engine.scheduler.import_s), ("leave", engine.scheduler.leave_s)):
        assert 0 < value < engine.scheduler.schedule_s + engine.stats.decode_s
        assert seconds(m.PREFIX_CACHE_SECONDS, "op", op) == pytest.approx(value)
    engine.close()


def test_collector_pauses_are_exported() -> None:
    """A collection between steps shows up in the pause counter (its generation) and the
    longest-pause gauge; the counter only ever grows by what the collector took."""
    import gc

    engine = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=16, max_num_seqs=2))
    metrics = WorkerMetrics("t")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("r", list(range(12)), params)
    metrics.on_step(engine, engine.step())

    def paused(gen: int) -> float:
        return metrics.registry.get_sample_value(
            f"{m.GC_PAUSE_SECONDS}_total", {"model": "t", "generation": str(gen)}
        )

    before = [paused(g) for g in range(3)]
    recorded = GcPauses.process().seconds[2]
    gc.collect()  # a full collection
    took = GcPauses.process().seconds[2] - recorded
    assert took > 0
    while engine.has_work():
        metrics.on_step(engine, engine.step())
    assert paused(2) - before[2] >= took
    assert all(paused(g) >= before[g] for g in range(3))
    longest = metrics.registry.get_sample_value(m.GC_PAUSE_MAX_SECONDS, {"model": "t"})
    assert longest >= took
    engine.close()


def _config_info(metrics: WorkerMetrics) -> dict[str, str]:
    """The labels of the one ``worker_config_info`` sample (its value is 1)."""
    (family,) = [f for f in metrics.registry.collect() if f.name == m.WORKER_CONFIG_INFO]
    (sample,) = family.samples
    assert sample.value == 1
    return dict(sample.labels)


def test_the_chosen_configuration_is_exported_with_why_graphs_are_off() -> None:
    engine = Engine(
        EngineConfig(
            model="tiny-glm",
            mode="adaptive",
            kv_pool_mib=48,
            max_num_seqs=2,
            speculation=SpeculationConfig("dflash"),
        )
    )
    metrics = WorkerMetrics("t")
    metrics.describe(engine)
    assert _config_info(metrics) == {
        "model": "t",
        "device": "cpu",
        "mode": "adaptive",
        "kv_cache_dtype": "auto",
        "cuda_graphs": "off",
        "graphs_off_reason": "device cpu is not a GPU",
        "graph_capture": "second",
        "drafter": "dflash",
        "durable_sessions": "off",  # a private arena dies with the process: nothing to resume
        "prefix_cache": "off",  # no host store to leave pages in
    }
    engine.close()


@pytest.mark.gpu
def test_graphs_off_say_why() -> None:
    """A GPU engine with graphs turned off exports why; one with them on (a model with
    compressed, windowed sources too) exports none."""
    engine = Engine(EngineConfig(model="tiny-glm", device="cuda", kv_pool_mib=256,
                                 graphs=GraphConfig(False)))  # fmt: skip
    metrics = WorkerMetrics("t")
    metrics.describe(engine)
    info = _config_info(metrics)
    assert info["cuda_graphs"] == "off" and "--no-cuda-graphs" in info["graphs_off_reason"]
    engine.close()
    cuda = Engine(EngineConfig(model="tiny-dsv4", device="cuda", kv_pool_mib=256))
    metrics = WorkerMetrics("u")
    metrics.describe(cuda)
    assert _config_info(metrics)["cuda_graphs"] == "on"
    assert cuda.graphs_off_reason is None
    cuda.close()
