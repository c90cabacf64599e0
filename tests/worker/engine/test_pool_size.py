"""The KV pool when none is given: on a GPU a share of the memory free once the model is
loaded (here the free bytes are given, as the engine's ``device_free_bytes`` reads them on a
GPU), on a CPU a fixed size; the engine logs what it chose; a group's ranks agree on one size
(a real two-rank gloo group)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from dhisparse.family.presets import preset_topology
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
from services.worker.serving.cache import KVCache
from services.worker.serving.pool_size import pool_ceiling
from tests.group import run_group

GIB = 1 << 30


def test_the_pool_is_a_share_of_the_free_device_memory() -> None:
    assert auto_kv_pool_mib(None) == CPU_KV_POOL_MIB  # a CPU: room for sessions
    assert auto_kv_pool_mib(None, (100 << 20) + 1) == CPU_KV_POOL_MIB + 101  # beside the fixed
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


@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_an_engine_on_a_cpu_without_a_pool_size_has_the_cpu_default_room_for_sessions(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CPU the pool holds ``CPU_KV_POOL_MIB`` for sessions beside what does not grow with
    them (the hierarchy's staging, scratch and metadata), within what the seats can use."""
    cfg = EngineConfig(model="tiny-glm", mode=mode, kv_pool_mib=None, max_model_len=4096)
    with caplog.at_level(logging.INFO, logger="services.worker.engine.config"):
        engine = Engine(cfg)
    try:
        pool = engine.kv.cfg.kv_pool_bytes
        ceiling = pool_ceiling(engine.model_cfg, replace(engine.kv.cfg, kv_pool_bytes=0))
        room = pool - engine.kv.fixed_bytes()
        assert pool == int(engine.cfg.kv_pool_mib) << 20
        assert room >= (int(CPU_KV_POOL_MIB) << 20) - (1 << 20) or pool >= ceiling - (1 << 20)
        assert pool <= ceiling + (1 << 20)
        assert f"KV pool: {engine.cfg.kv_pool_mib:.0f} MiB (auto: the CPU default" in caplog.text
    finally:
        engine.close()


def _rank_pool(comm, free: list[int]) -> float | None:
    cfg = EngineConfig(device="cuda:0", kv_pool_mib=None)
    return with_sized_pool(cfg, comm, free[comm.rank]).kv_pool_mib


def test_a_groups_ranks_size_one_pool_from_the_least_free_memory() -> None:
    sizes = run_group(_rank_pool, 2, [12 * GIB, 9 * GIB])
    assert sizes == [auto_kv_pool_mib(9 * GIB)] * 2


def test_the_pool_stops_at_what_the_seats_can_use(caplog: pytest.LogCaptureFixture) -> None:
    ceiling = 700 << 20
    with caplog.at_level(logging.INFO, logger="services.worker.engine.config"):
        cfg = with_sized_pool(
            EngineConfig(device="cuda:0", kv_pool_mib=None), LOCAL, 80 * GIB, ceiling
        )
    assert cfg.kv_pool_mib == 700
    assert "KV pool: 700 MiB (auto: all that 32 seats of" in caplog.text
    # a ceiling above the share leaves the share
    cfg = with_sized_pool(EngineConfig(device="cuda:0", kv_pool_mib=None), LOCAL, GIB, 80 * GIB)
    assert cfg.kv_pool_mib == auto_kv_pool_mib(GIB)


@pytest.mark.parametrize("model", ["tiny-glm", "tiny-indexshare"])
def test_a_pool_at_the_ceiling_holds_every_seats_whole_context(model: str) -> None:
    """Resident serving at the ceiling seats every slot's whole context; the hierarchy modes
    build at it too (their hot caches and tails beside every context)."""
    base = EngineConfig(model=model, max_num_seqs=4, max_model_len=1024, kv_pool_mib=0)
    model_cfg = preset_topology(model)
    ceiling = pool_ceiling(model_cfg, base.kv_config(torch.float32))
    for mode in ("resident", "adaptive"):
        cfg = replace(base, mode=mode, kv_pool_mib=ceiling / (1 << 20)).kv_config(torch.float32)
        kv = KVCache(model_cfg, cfg)
        try:
            if mode == "resident":
                assert kv.tokens_capacity >= cfg.max_slots * cfg.max_model_len
            else:
                assert kv.tokens_capacity >= cfg.max_model_len - 1
        finally:
            kv.close()


@pytest.mark.parametrize("spec_block", [1, 5])
def test_a_pool_that_cannot_hold_the_fixed_allocations_is_refused_at_start_up(
    spec_block: int,
) -> None:
    """The hierarchy's fixed allocations include its staging for speculative verification: a
    pool too small for them is a start-up error naming the sizes, never a worker that starts
    with more required than its pool (so that every request would be refused); a pool that
    starts has its fixed allocations within it."""
    model_cfg = preset_topology("tiny-glm")
    base = EngineConfig(model="tiny-glm", mode="adaptive", max_num_seqs=8, max_model_len=2048)
    fixed = None
    for mib in (1, 2, 4, 8, 16, 32, 64):
        cfg = replace(base, kv_pool_mib=mib).kv_config(torch.float32)
        cfg = replace(cfg, spec_block=spec_block)
        try:
            kv = KVCache(model_cfg, cfg)
        except ValueError as e:
            assert "after fixed allocations" in str(e) and fixed is None
            continue
        try:
            mem = kv.memory()
            assert mem.required <= mem.capacity and mem.free > 0
            fixed = kv.fixed_bytes()
        finally:
            kv.close()
    assert fixed is not None
