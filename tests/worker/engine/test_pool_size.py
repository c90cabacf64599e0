"""The KV pool when none is given: on a GPU a share of the memory free once the model is
loaded (here the free bytes are given, as the engine's ``device_free_bytes`` reads them on a
GPU), on a CPU a fixed size; the engine logs what it chose; a group's ranks agree on one size
(a real two-rank gloo group)."""

from __future__ import annotations

import logging

import pytest

from services.worker.engine.config import (
    CPU_KV_POOL_MIB,
    GPU_KV_POOL_SHARE,
    EngineConfig,
    auto_kv_pool_mib,
    device_free_bytes,
    with_sized_pool,
)
from services.worker.engine.engine import Engine
from services.worker.parallel.comm import LOCAL
from tests.group import run_group

GIB = 1 << 30


def test_the_pool_is_a_share_of_the_free_device_memory() -> None:
    assert auto_kv_pool_mib(None) == CPU_KV_POOL_MIB  # a CPU: today's fixed size
    assert auto_kv_pool_mib(10 * GIB) == GPU_KV_POOL_SHARE * 10 * 1024
    assert auto_kv_pool_mib(GIB + 12345) == int(GPU_KV_POOL_SHARE * (GIB + 12345)) >> 20
    assert 0 < GPU_KV_POOL_SHARE < 1  # room stays for activations and graphs
    assert device_free_bytes("cpu") is None


def test_an_explicit_pool_wins_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="services.worker.engine.config"):
        cfg = with_sized_pool(EngineConfig(kv_pool_mib=48), LOCAL, 10 * GIB)
    assert cfg.kv_pool_mib == 48
    assert "KV pool: 48 MiB (--kv-pool-mib)" in caplog.text


def test_a_gpu_without_a_pool_size_gets_a_share_of_its_free_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="services.worker.engine.config"):
        cfg = with_sized_pool(EngineConfig(device="cuda:0", kv_pool_mib=None), LOCAL, 20 * GIB)
    assert cfg.kv_pool_mib == auto_kv_pool_mib(20 * GIB)
    assert f"KV pool: {cfg.kv_pool_mib:.0f} MiB (auto: 80% of the 20480 MiB free on cuda:0" in (
        caplog.text
    )


def test_an_engine_on_a_cpu_without_a_pool_size_keeps_the_cpu_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="services.worker.engine.config"):
        engine = Engine(EngineConfig(model="tiny-glm", mode="resident", kv_pool_mib=None))
    try:
        assert engine.cfg.kv_pool_mib == CPU_KV_POOL_MIB
        assert engine.kv.cfg.kv_pool_bytes == int(CPU_KV_POOL_MIB) << 20
        assert "KV pool: 256 MiB (auto: the CPU default" in caplog.text
    finally:
        engine.close()


def _rank_pool(comm, free: list[int]) -> float | None:
    cfg = EngineConfig(device="cuda:0", kv_pool_mib=None)
    return with_sized_pool(cfg, comm, free[comm.rank]).kv_pool_mib


def test_a_groups_ranks_size_one_pool_from_the_least_free_memory() -> None:
    sizes = run_group(_rank_pool, 2, [12 * GIB, 9 * GIB])
    assert sizes == [auto_kv_pool_mib(9 * GIB)] * 2
