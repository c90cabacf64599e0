"""Fixtures for the gateway: a real `dhisparse worker` process (tiny-glm on CPU), gateway apps
driven in-process through httpx's ASGI transport, and a real `dhisparse gateway` process for the
official openai client. Processes are started on free ports and stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI

from dhisparse.rpc import worker_pb2, worker_pb2_grpc
from services.gateway import GatewaySettings, create_app

DHISPARSE = Path(sys.executable).with_name("dhisparse")
MODEL = "tiny-glm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def start_worker(log: Path) -> WorkerProcess:
    """Starts `dhisparse worker` (tiny-glm, CPU) on a free port; returns once Health says ok.
    The caller stops it with ``kill_process``."""
    port = free_port()
    cmd = [str(DHISPARSE), "worker", "--model", MODEL, "--device", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        _wait_until(lambda: _worker_healthy(address), proc, log, "worker", timeout=180)
    except BaseException:
        kill_process(proc)
        raise
    return WorkerProcess(proc, address)


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


@pytest.fixture(scope="module")
def live_gateway(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """`dhisparse gateway` as a real uvicorn server on a free port."""
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    cmd = [str(DHISPARSE), "gateway", "--workers", worker.address, "--model", MODEL]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_until(healthy, proc, log, "gateway", timeout=60)
        yield GatewayProcess(proc, base_url)
    finally:
        kill_process(proc)


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
