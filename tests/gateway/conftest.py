"""Fixtures for the gateway: a real `dhisparse worker` process (tiny-glm on CPU), gateway apps
driven in-process through httpx's ASGI transport, real `dhisparse gateway` processes for the
official openai client and the multi-replica tests, and a real `redis-server` for the shared
ledger. Processes are started on free ports and stopped by PID."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from dhisparse.rpc import worker_pb2, worker_pb2_grpc
from services.gateway import GatewaySettings, create_app
from services.gateway.ledger import Candidate
from services.gateway.redis_ledger import RedisLedger
from tests.conftest import free_port

DHISPARSE = Path(sys.executable).with_name("dhisparse")
MODEL = "tiny-glm"
ROOT = Path(__file__).resolve().parents[2]


def checkout_env() -> dict[str, str]:
    """The environment of a service process: it runs this checkout's code, whichever checkout
    the console script was installed from."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def kill_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait_until(
    ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, what: str, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early ({proc.returncode}):\n{log.read_text()}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout}s:\n{log.read_text()}")


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    address: str

    def load(self) -> worker_pb2.LoadResponse:
        with grpc.insecure_channel(self.address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=5)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once the worker has no running or waiting request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = self.load()
            if load.num_running == 0 and load.num_waiting == 0:
                return True
            time.sleep(0.1)
        return False


def _worker_healthy(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=1)
            return resp.ok
    except grpc.RpcError:
        return False


def launch_worker(log: Path, *args: str) -> WorkerProcess:
    """Starts `dhisparse worker` (tiny-glm, CPU, resident mode, then ``args``) on a free port
    without waiting for it; see ``wait_worker``. The gateway's tests size admission against a
    resident worker's KV pool (small pools, exact page counts): ``args`` may name another mode."""
    port = free_port()
    cmd = [str(DHISPARSE), "worker", "--model", MODEL, "--device", "cpu", "--mode", "resident"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=checkout_env())
    return WorkerProcess(proc, f"127.0.0.1:{port}")


def wait_worker(wp: WorkerProcess, log: Path) -> WorkerProcess:
    """Returns once the worker's Health says ok; kills it if it never does."""
    try:
        _wait_until(lambda: _worker_healthy(wp.address), wp.proc, log, "worker", timeout=180)
    except BaseException:
        kill_process(wp.proc)
        raise
    return wp


def start_worker(log: Path, *args: str) -> WorkerProcess:
    """Starts `dhisparse worker` (tiny-glm, CPU) on a free port; returns once Health says ok.
    The caller stops it with ``kill_process``."""
    return wait_worker(launch_worker(log, *args), log)


@pytest.fixture(scope="session")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """The real worker, shared by the whole session; killed by PID at the end."""
    wp = start_worker(tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        yield wp
    finally:
        kill_process(wp.proc)


@contextlib.asynccontextmanager
async def gateway_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to ``app`` in-process, with the app's lifespan running (the
    ASGI transport does not run it by itself)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gateway", timeout=60
        ) as client:
            yield client


@pytest.fixture
def make_gateway(
    worker: WorkerProcess,
) -> Callable[..., contextlib.AbstractAsyncContextManager[httpx.AsyncClient]]:
    """``async with make_gateway(api_key=...) as client`` — a gateway on the real worker with
    settings overridden."""

    def make(**overrides: Any) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
        settings = GatewaySettings(
            **{"workers": [worker.address], "model": MODEL, "health_interval_s": 0.5, **overrides}
        )
        return gateway_client(create_app(settings))

    return make


@pytest.fixture
async def client(
    make_gateway: Callable[..., contextlib.AbstractAsyncContextManager[httpx.AsyncClient]],
) -> AsyncIterator[httpx.AsyncClient]:
    async with make_gateway() as c:
        yield c


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    base_url: str  # http://127.0.0.1:P
    ledger_prefix: str = ""  # its Redis ledger's, if any

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample of the gateway's /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return None


def launch_gateway(workers: list[str], log: Path, *args: str) -> GatewayProcess:
    """Starts `dhisparse gateway` (then ``args``) on a free port without waiting for it; see
    ``wait_gateway``."""
    port = free_port()
    cmd = [str(DHISPARSE), "gateway", "--workers", ",".join(workers), "--model", MODEL]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=checkout_env())
    prefix = args[args.index("--ledger-prefix") + 1] if "--ledger-prefix" in args else ""
    return GatewayProcess(proc, f"http://127.0.0.1:{port}", prefix)


def wait_gateway(gw: GatewayProcess, log: Path) -> GatewayProcess:
    """Returns once /health says a worker is up; kills the gateway if it never does."""

    def healthy() -> bool:
        try:
            return httpx.get(f"{gw.base_url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_until(healthy, gw.proc, log, "gateway", timeout=60)
    except BaseException:
        kill_process(gw.proc)
        raise
    return gw


def start_gateway(workers: list[str], log: Path, *args: str) -> GatewayProcess:
    """`dhisparse gateway` (then ``args``) as a real uvicorn server on a free port; returns once
    /health says a worker is up. The caller stops it with ``kill_process``."""
    return wait_gateway(launch_gateway(workers, log, *args), log)


@pytest.fixture(scope="module")
def live_gateway(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """`dhisparse gateway` as a real uvicorn server on a free port."""
    gw = start_gateway([worker.address], tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield gw
    finally:
        kill_process(gw.proc)


# --- Redis and small workers for admission ------------------------------------------------------
# A KV pool this small binds after a handful of short requests (tiny-glm, resident: ~2 KiB per
# token, so about 480 tokens in all).
SMALL_POOL_MIB = "1"


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    url: str

    def prefix(self) -> str:
        """A fresh ledger prefix: gateways that share one share capacity."""
        return f"test-{uuid.uuid4().hex[:8]}"


async def ledger_violations(
    r: Any, prefix: str, worker: str, within_capacity: bool = True
) -> list[str]:
    """How the Redis ledger's keys of ``worker`` (``ledger_scripts``) break its invariant, read
    in one MULTI: ``admitted`` is the leases' own bytes plus, once, every named block's
    (``shared``); it
    never exceeds the capacity (``within_capacity``: no lease was settled); each block counts
    the leases that name it; the expiry set holds exactly the leases. Empty when they hold."""
    keys = [f"{prefix}:{k}:{worker}" for k in ("worker", "leases", "expiry", "blocks", "named")]
    async with r.pipeline(transaction=True) as p:
        p.hgetall(keys[0]).hgetall(keys[1]).zrange(keys[2], 0, -1)
        p.hgetall(keys[3]).hgetall(keys[4])
        info, leases, expiring, blocks, named = await p.execute()
    if not info:
        return []
    naming: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for spec in named.values():
        for item in spec.split(","):
            key, size = item.split(":")
            naming[key] = naming.get(key, 0) + 1
            sizes[key] = int(size)
    counted = {k: int(v) for k, v in blocks.items() if not k.endswith("|b")}
    held = sum(int(v) for v in leases.values()) + sum(sizes.values())
    out = []
    over = within_capacity and held > int(info["capacity"])
    if held != int(info.get("admitted", 0)) or over:
        out.append(f"{worker}: held {held}, {info}, leases {leases}, blocks {blocks}")
    if sum(sizes.values()) != int(info.get("shared", 0)):
        out.append(f"{worker}: shared {info.get('shared')}, blocks named {named}")
    if counted != naming or set(named) - set(leases):
        out.append(f"{worker}: blocks {blocks} but leases name {named}")
    if set(expiring) != set(leases):
        out.append(f"{worker}: expiring {expiring}, leases {leases}")
    return out


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real `redis-server` on a free port, nothing persisted; killed by PID at the end."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run scripts/test-tools (make test runs it)")
    port = free_port()
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cmd += ["--daemonize", "no"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    try:
        _wait_until(ready, proc, log, "redis-server", timeout=30)
        yield RedisServer(proc, f"redis://127.0.0.1:{port}/0")
    finally:
        kill_process(proc)


@pytest.fixture(scope="session")
def small_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """Two real workers with a 1 MiB KV pool each, started side by side."""
    logs = [tmp_path_factory.mktemp("small-worker") / "worker.log" for _ in range(2)]
    procs = [launch_worker(log, "--kv-pool-mib", SMALL_POOL_MIB) for log in logs]
    try:
        yield [wait_worker(wp, log) for wp, log in zip(procs, logs, strict=True)]
    finally:
        for wp in procs:
            kill_process(wp.proc)


def sse_events(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, with the final ``[DONE]`` checked and dropped."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    frames = body.split("\n\n")
    assert frames[-1] == ""
    payloads = []
    for frame in frames[:-2]:
        assert frame.startswith("data: "), frame
        payloads.append(json.loads(frame[len("data: ") :]))
    return payloads


# Admission knobs of the tight gateway: two may wait, for at most this long.
TIGHT_QUEUE, TIGHT_DEADLINE_S = 2, 1.5


@pytest.fixture(scope="session")
def tight_gateway(
    redis_server: RedisServer,
    small_workers: list[WorkerProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """A gateway on the first small worker with a ledger of its own (nothing else admits
    there) and a tiny queue with a short deadline, for exact 429/503 checks."""
    args = ["--redis-url", redis_server.url, "--ledger-prefix", redis_server.prefix()]
    args += ["--max-queue", str(TIGHT_QUEUE), "--queue-deadline-s", str(TIGHT_DEADLINE_S)]
    args += ["--health-interval-s", "0.5"]
    log = tmp_path_factory.mktemp("tight-gateway") / "gateway.log"
    gw = start_gateway([small_workers[0].address], log, *args)
    try:
        yield gw
    finally:
        kill_process(gw.proc)


@contextlib.asynccontextmanager
async def capacity_held(
    redis_url: str, prefix: str, workers: list[str]
) -> AsyncIterator[RedisLedger]:
    """Takes all free capacity of ``workers`` in the ledger at ``prefix`` (as another gateway
    replica would) and gives it back on exit."""
    ledger = RedisLedger(redis_url, prefix=prefix)
    held: list[str] = []
    try:
        for w in workers:
            usage = (await ledger.usage([w]))[w]
            got = await ledger.acquire(f"holder-{w}", [Candidate(w, usage.free_bytes)], 120)
            assert got is not None and got.usage.free_bytes == 0, got
            held.append(w)
        yield ledger
    finally:
        for w in held:
            await ledger.release(w, f"holder-{w}")
        await ledger.close()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Returns once ``check()`` is true; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
