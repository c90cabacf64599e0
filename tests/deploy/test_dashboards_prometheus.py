"""Every dashboard expression against real data: the stack (kv-host-store, a CPU worker, the
gateway) runs as processes, a real Prometheus scrapes all three every second, traffic goes
through the gateway, then each expression must return at least one series.

Panels over metrics that no service exports yet carry ``dhisparse_requires`` (the feature that
will export them); those expressions are skipped with that reason. When the feature lands, drop
the marker in deploy/grafana/dashboards.py and this test covers the panel.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from dhisparse import metrics
from tests.conftest import free_port
from tests.deploy.conftest import ROOT, find_tool
from tests.deploy.dashboards import TYPES, Query, instantiate, queries

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
MODEL = "tiny-glm"
RATE_INTERVAL = "30s"
REQUESTS = 12


@dataclass
class Stack:
    gateway: str  # base URL
    prometheus: str  # base URL
    ports: dict[str, int]
    requests_sent: int

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    # the services run this checkout's code, whichever checkout the console script came from
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait_http(url: str, procs: list[subprocess.Popen], logs: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                tails = "\n".join(
                    f"--- {f.name}\n{f.read_text()[-2000:]}" for f in logs.glob("*.log")
                )
                pytest.fail(
                    f"{p.args[:2]} exited with {p.returncode} before {url} answered\n{tails}"
                )
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{url} did not answer within {timeout:.0f} s")


def _prometheus_config(ports: dict[str, int]) -> dict:
    """Scrapes the three services every second, each with the `component` label the chart's
    ServiceMonitors attach."""

    def job(component: str, port: int) -> dict:
        return {
            "job_name": component,
            "static_configs": [
                {"targets": [f"127.0.0.1:{port}"], "labels": {"component": component}}
            ],
        }

    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            job("gateway", ports["gateway"]),
            job("worker", ports["worker_metrics"]),
            job("kv-host-store", ports["store_metrics"]),
        ],
    }


async def _traffic(base: str) -> int:
    """Completions and chat completions, plain and streamed, some concurrent. Returns the number
    of worker requests (n choices count n times)."""
    sent = 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:

        async def completion(i: int) -> int:
            body = {"model": MODEL, "prompt": f"request {i}: hello", "max_tokens": 8 + i % 5}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return 1

        async def chat(i: int, n: int = 1) -> int:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"say something {i}"}],
                "max_tokens": 6,
                "n": n,
            }
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return n

        async def streamed(i: int) -> int:
            body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 10, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for _ in r.aiter_lines():
                    pass
            return 1

        jobs = []
        for i in range(REQUESTS):
            jobs.append([completion, chat, streamed][i % 3](i))
        jobs.append(chat(REQUESTS, n=2))
        sent += sum(await asyncio.gather(*jobs))
        # An unknown model is a client error, not a finished request.
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code in (400, 404)
    return sent


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = find_tool("prometheus")
    tmp = tmp_path_factory.mktemp("stack")
    ports = {
        k: free_port()
        for k in (
            "store", "store_metrics", "worker", "worker_metrics", "gateway", "prometheus", "redis"
        )
    }  # fmt: skip
    arena = Path("/dev/shm") / f"dhisparse-test-{uuid.uuid4().hex[:12]}"
    dhisparse = str(BIN / "dhisparse")
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, DHISPARSE_GATEWAY_LOG_LEVEL="warning")
    try:
        # the gateway's ledger and its replicas' affinity feed, as the chart deploys them
        redis = find_tool("redis-server")
        procs.append(
            _start(
                [redis, "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no"],
                tmp / "redis.log",
            )
        )  # fmt: skip
        procs.append(
            _start(
                [
                    dhisparse, "kv-host-store",
                    "--host", "127.0.0.1",
                    "--port", str(ports["store"]),
                    "--metrics-port", str(ports["store_metrics"]),
                    "--arena-path", str(arena),
                    "--capacity", "64MiB",
                ],
                tmp / "kv-host-store.log",
            )
        )  # fmt: skip
        procs.append(
            _start(
                [
                    dhisparse, "worker",
                    "--host", "127.0.0.1",
                    "--model", MODEL,
                    "--device", "cpu",
                    "--port", str(ports["worker"]),
                    "--metrics-port", str(ports["worker_metrics"]),
                    "--kv-store", f"127.0.0.1:{ports['store']}",
                    "--kv-pool-mib", "256",
                    "--mode", "adaptive",  # hierarchy and residency panels need their traffic
                    "--drafter", "dflash", "--spec-width", "4",  # and speculation
                    "--worker-id", "worker-0",
                ],
                tmp / "worker.log",
            )
        )  # fmt: skip
        procs.append(
            _start(
                [
                    dhisparse, "gateway",
                    "--host", "127.0.0.1",
                    "--port", str(ports["gateway"]),
                    "--workers", f"127.0.0.1:{ports['worker']}",
                    "--model", MODEL,
                    "--redis-url", f"redis://127.0.0.1:{ports['redis']}/0",
                ],
                tmp / "gateway.log",
                env,
            )
        )  # fmt: skip
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(_prometheus_config(ports)))
        procs.append(
            _start(
                [
                    prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                    "--log.level=warn",
                ],
                tmp / "prometheus.log",
            )
        )
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        prom = f"http://127.0.0.1:{ports['prometheus']}"
        _wait_http(f"http://127.0.0.1:{ports['store_metrics']}/metrics", procs, tmp)
        _wait_http(f"http://127.0.0.1:{ports['worker_metrics']}/metrics", procs, tmp)
        _wait_http(f"{gateway}/health", procs, tmp)
        _wait_http(f"{prom}/-/ready", procs, tmp)

        s = Stack(gateway, prom, ports, requests_sent=0)
        s.requests_sent = asyncio.run(_traffic(gateway))
        # Wait until Prometheus has scraped the finished requests, then a few more scrapes so
        # that every rate() window holds samples from after the traffic.
        deadline = time.monotonic() + 60
        done = f'sum(dhisparse:request_success_total{{component="gateway", model="{MODEL}"}})'
        while time.monotonic() < deadline:
            result = s.query(done)
            if result and float(result[0]["value"][1]) >= s.requests_sent:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus never saw {s.requests_sent} finished requests")
        time.sleep(4)
        yield s
    finally:
        _stop(procs)
        arena.unlink(missing_ok=True)


def test_every_target_is_up(stack: Stack) -> None:
    up = {r["metric"]["job"]: r["value"][1] for r in stack.query("up")}
    assert up == {"gateway": "1", "worker": "1", "kv-host-store": "1"}


def test_metric_names_arrive_as_defined(stack: Stack) -> None:
    """Every service serves the text format, so ``dhisparse:`` names are stored as defined
    (prometheus_client's OpenMetrics writer would mangle them, client_python#1177)."""
    mangled = stack.query('count by (job) ({__name__=~"dhisparse_.+"})')
    assert not mangled, f"series stored under mangled names: {mangled}"


def test_latency_histograms_use_vllm_buckets(stack: Stack) -> None:
    def les(name: str, component: str) -> list[float]:
        rows = stack.query(f'{{__name__="{name}_bucket", component="{component}"}}')
        return sorted(float(r["metric"]["le"]) for r in rows if r["metric"]["le"] != "+Inf")

    for component in ("gateway", "worker"):
        assert les(metrics.TIME_TO_FIRST_TOKEN, component) == list(metrics.TTFT_BUCKETS)
        assert les(metrics.TIME_PER_OUTPUT_TOKEN, component) == list(metrics.TPOT_BUCKETS)
        assert les(metrics.E2E_REQUEST_LATENCY, component) == list(metrics.E2E_BUCKETS)


def test_gateway_and_worker_series_carry_the_model_label(stack: Stack) -> None:
    rows = stack.query('{__name__=~"dhisparse:.+", component=~"gateway|worker"}')
    assert rows
    unlabelled = sorted({r["metric"]["__name__"] for r in rows if "model" not in r["metric"]})
    assert not unlabelled, f"series without a model label: {unlabelled}"
    assert {r["metric"]["model"] for r in rows} == {MODEL}


def test_exported_types_match_the_dashboards_assumptions(stack: Stack) -> None:
    r = httpx.get(f"{stack.prometheus}/api/v1/metadata", timeout=10).json()
    assert r["status"] == "success"
    seen = {}
    for name, entries in r["data"].items():
        if name.startswith(metrics.PREFIX) and not name.endswith("_created"):
            seen[name.removesuffix("_total")] = {e["type"] for e in entries}
    assert seen
    for name, kinds in seen.items():
        assert name in TYPES, f"{name} is exported but not named in dhisparse/metrics.py"
        assert kinds == {TYPES[name]}, (
            f"{name}: exported as {kinds}, dashboards assume {TYPES[name]}"
        )


@pytest.mark.parametrize("service", ["gateway", "worker", "kv-host-store"])
def test_container_health_check_passes(stack: Stack, service: str) -> None:
    env = dict(
        os.environ,
        DHISPARSE_GATEWAY_PORT=str(stack.ports["gateway"]),
        DHISPARSE_WORKER_PORT=str(stack.ports["worker"]),
        DHISPARSE_KV_STORE_METRICS_PORT=str(stack.ports["store_metrics"]),
    )
    r = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "healthcheck.py"), service],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("q", queries(), ids=lambda q: q.id)
def test_dashboard_expression_returns_series(stack: Stack, q: Query) -> None:
    result = stack.query(instantiate(q.expr, RATE_INTERVAL))
    if q.requires:
        note = " (it returns series now: drop the marker)" if result else ""
        pytest.skip(f"{q.panel!r} needs the {q.requires!r} feature{note}")
    assert result, f"{q.dashboard} / {q.panel!r} returned no series:\n{q.expr}"
