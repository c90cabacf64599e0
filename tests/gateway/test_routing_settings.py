"""Routing policy, settings and the CLI, without a server."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from services.gateway import (
    GatewaySettings,
    LocalLedger,
    PrefixAffinityRouter,
    memory_admission,
    prefix_affinity,
)
from services.gateway import cli as gateway_cli
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import (
    AdmissionJob,
    ImmediateAdmission,
    LeastLoadedRouter,
    NoWorkerAvailable,
    WorkerStatus,
)

from .conftest import DHISPARSE


def ws(address: str, running: int = 0, healthy: bool = True, **kw: int) -> WorkerStatus:
    return WorkerStatus(address=address, healthy=healthy, num_running=running, **kw)


def test_least_loaded_healthy_worker_wins() -> None:
    router = LeastLoadedRouter()
    workers = [ws("a", 5), ws("b", 2, num_waiting=4), ws("c", 3), ws("d", 0, healthy=False)]
    assert router.pick(workers, ()) == "c"
    assert router.pick(workers, {"c"}) == "a"
    assert router.pick([ws("d", healthy=False)], ()) is None


def test_the_ledgers_admitted_share_ranks_first() -> None:
    router = LeastLoadedRouter()
    workers = [
        ws("a", 0, kv_capacity_bytes=100, admitted_bytes=50),
        ws("b", 9, kv_capacity_bytes=1000, admitted_bytes=100),
        ws("c", 0, kv_capacity_bytes=100, admitted_bytes=90),
    ]
    assert router.rank(workers, ()) == ["b", "a", "c"]
    assert router.rank(workers, {"b"}) == ["a", "c"]
    assert router.rank([], ()) == []


def test_ties_rotate() -> None:
    router = LeastLoadedRouter()
    workers = [ws("a"), ws("b"), ws("c")]
    assert {router.pick(workers, ()) for _ in range(3)} == {"a", "b", "c"}


def test_load_estimate_counts_requests_since_the_poll() -> None:
    # Polled with 2 running of which 1 was ours; since then we started 3 more.
    assert ws("a", 2, in_flight=4, in_flight_at_poll=1).estimated_load == 5
    # Ours finished since the poll.
    assert ws("a", 2, in_flight=0, in_flight_at_poll=2).estimated_load == 0


async def test_immediate_admission() -> None:
    admission = ImmediateAdmission()
    job = AdmissionJob("r", prompt_tokens=3, max_tokens=4)
    lease = await admission.acquire(job, lambda: [ws("a", 1), ws("b")])
    assert lease.worker == "b"
    lease.release()
    lease.release()  # idempotent
    with pytest.raises(NoWorkerAvailable):
        await admission.acquire(job, lambda: [ws("a")], exclude=["a"])


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DHISPARSE_GATEWAY_WORKERS", "10.0.0.1:1, 10.0.0.2:2")
    monkeypatch.setenv("DHISPARSE_GATEWAY_PORT", "9000")
    monkeypatch.setenv("DHISPARSE_GATEWAY_API_KEY", "k")
    s = GatewaySettings()
    assert s.workers == ["10.0.0.1:1", "10.0.0.2:2"]
    assert (s.port, s.api_key, s.host) == (9000, "k", "127.0.0.1")
    shipped = s.model_dir()  # the default: the shipped model's directory
    assert shipped is not None and (shipped / "config.json").exists()
    assert GatewaySettings(model="tiny-glm").model_dir() is None  # a preset: byte tokenizer
    with pytest.raises(ValueError, match="host:port"):
        GatewaySettings(workers="nope")  # type: ignore[arg-type]


def test_cli_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DHISPARSE_GATEWAY_PORT", "9000")
    monkeypatch.setenv("DHISPARSE_GATEWAY_MAX_N", "3")
    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    args = parser.parse_args(["--port", "9100", "--workers", "h:1,h:2"])
    captured: dict[str, object] = {}

    def fake_run(app: object, **kw: object) -> None:
        captured.update(kw, app=app)

    monkeypatch.setattr("uvicorn.run", fake_run)
    assert gateway_cli.main(args) == 0
    assert captured["port"] == 9100
    settings = captured["app"].state.ctx.settings  # type: ignore[attr-defined]
    assert settings.workers == ["h:1", "h:2"]
    assert settings.max_n == 3


def test_admission_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    flags = ["--redis-url", "redis://r:6379/0", "--ledger-prefix", "p", "--lease-ttl-s", "3"]
    flags += ["--max-queue", "0", "--queue-deadline-s", "2.5", "--admission-poll-s", "0.01"]
    flags += ["--worker-dead-after-s", "7", "--kv-page-size", "64", "--redis-max-connections", "4"]
    flags += ["--health-interval-s", "0.25"]
    captured: dict[str, object] = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: captured.update(app=app))
    assert gateway_cli.main(parser.parse_args(flags)) == 0
    s = captured["app"].state.ctx.settings  # type: ignore[attr-defined]
    assert (s.redis_url, s.ledger_prefix, s.lease_ttl_s, s.max_queue) == (
        "redis://r:6379/0",
        "p",
        3,
        0,
    )
    assert (s.queue_deadline_s, s.admission_poll_s, s.worker_dead_after_s) == (2.5, 0.01, 7)
    assert (s.kv_page_size, s.redis_max_connections, s.health_interval_s) == (64, 4, 0.25)
    admission = captured["app"].state.ctx.pool.admission  # type: ignore[attr-defined]
    assert type(admission.ledger).__name__ == "RedisLedger"
    assert admission.cfg.max_queue == 0 and admission.sizer.page_size == 64
    monkeypatch.setenv("DHISPARSE_GATEWAY_REDIS_URL", "")
    assert type(memory_admission(GatewaySettings(), GatewayMetrics()).ledger) is LocalLedger


def test_dhisparse_gateway_help() -> None:
    out = subprocess.run(
        [str(DHISPARSE), "gateway", "--help"], capture_output=True, text=True, check=True
    )
    assert "--workers" in out.stdout and "--api-key" in out.stdout


def test_prefix_affinity_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    flags = ["--prefix-affinity-weight", "0.25", "--prefix-affinity-max-pages", "64"]
    flags += ["--prefix-affinity-index-pages", "1000", "--kv-page-size", "32"]
    captured: dict[str, object] = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: captured.update(app=app))
    assert gateway_cli.main(parser.parse_args(flags)) == 0
    pool = captured["app"].state.ctx.pool  # type: ignore[attr-defined]
    cfg = pool.affinity.cfg
    assert (cfg.weight, cfg.max_pages, cfg.index_pages, cfg.default_page_size) == (
        0.25,
        64,
        1000,
        32,
    )
    assert isinstance(pool.admission.router, PrefixAffinityRouter)
    assert pool.admission.router.affinity is pool.affinity  # one index: read and recorded
    # off by flag, or by the environment: the least-loaded router and no index
    assert gateway_cli.main(parser.parse_args(["--no-prefix-affinity"])) == 0
    pool = captured["app"].state.ctx.pool  # type: ignore[attr-defined]
    assert pool.affinity is None and isinstance(pool.admission.router, LeastLoadedRouter)
    monkeypatch.setenv("DHISPARSE_GATEWAY_PREFIX_AFFINITY", "false")
    assert prefix_affinity(GatewaySettings()) is None
    monkeypatch.setenv("DHISPARSE_GATEWAY_PREFIX_AFFINITY", "true")
    assert prefix_affinity(GatewaySettings()) is not None
    with pytest.raises(ValueError):
        GatewaySettings(prefix_affinity_weight=-1)
