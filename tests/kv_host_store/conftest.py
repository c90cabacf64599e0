"""Fixtures for the host store: unique arena paths under /dev/shm, an in-process server, and a
real `dhisparse kv-host-store` subprocess. Everything is removed afterwards, processes by PID."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.kv_host_store.client import KVHostStoreClient
from services.kv_host_store.server import KVHostStoreServer
from services.kv_host_store.settings import KVHostStoreSettings
from services.kv_host_store.store import HostStore

DHISPARSE = Path(sys.executable).with_name("dhisparse")
ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"listening grpc=\S+:(\d+) metrics=\S+:(\d+)")
CAPACITY = 64 << 20
ALIGN = 4096


class Clock:
    """A store's clock that moves only when a test sets ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> HostStore:
    """An in-process store of 64 pages of ``ALIGN`` bytes on ``clock``, orphans kept 30 s."""
    return HostStore(64 * ALIGN, ALIGN, orphan_ttl_s=30.0, clock=clock)


@pytest.fixture
def arena_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"dhisparse-test-{uuid.uuid4().hex}"
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture
async def server(arena_path: Path) -> AsyncIterator[KVHostStoreServer]:
    """A store served in this process's event loop, on free ports."""
    settings = KVHostStoreSettings(
        port=0, metrics_port=0, arena_path=arena_path, capacity=CAPACITY, shutdown_grace_s=0.5
    )
    srv = KVHostStoreServer(settings)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@dataclass
class StoreProcess:
    proc: subprocess.Popen[str]
    target: str  # gRPC host:port
    metrics_url: str
    arena_path: Path
    log: list[str]  # stderr lines so far

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout)


def start_store_process(arena_path: Path, *extra: str, timeout: float = 60.0) -> StoreProcess:
    """Runs `dhisparse kv-host-store` on free ports; returns once it logged its ports."""
    cmd = [str(DHISPARSE), "kv-host-store", "--port", "0", "--metrics-port", "0"]
    cmd += ["--arena-path", str(arena_path), "--capacity", str(CAPACITY), *extra]
    # the store runs this checkout's code, whichever checkout the console script was installed from
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def drain() -> None:  # keeps the pipe from filling up for the process's whole life
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"kv-host-store exited early:\n{''.join(log)}")
            if m := READY.search(line):
                port, metrics_port = int(m[1]), int(m[2])
                return StoreProcess(
                    proc,
                    f"127.0.0.1:{port}",
                    f"http://127.0.0.1:{metrics_port}/metrics",
                    arena_path,
                    log,
                )
    except BaseException:
        kill_process(proc)
        raise


def kill_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def store_process(arena_path: Path) -> Iterator[StoreProcess]:
    """A real store process; terminated (by PID) and its arena removed afterwards."""
    sp = start_store_process(arena_path)
    try:
        yield sp
    finally:
        kill_process(sp.proc)


@contextmanager
def store_client(name: str) -> Iterator[KVHostStoreClient]:
    """A client of a ``dhisparse kv-host-store`` process over a fresh arena in /dev/shm
    (``name`` in its file's name); the process is killed and the arena removed after."""
    from services.kv_host_store import KVHostStoreClient

    arena = Path("/dev/shm") / f"dhisparse-test-{name}-{uuid.uuid4().hex}"
    store = start_store_process(arena)
    client = KVHostStoreClient(store.target)
    try:
        yield client
    finally:
        client.close()
        kill_process(store.proc)
        arena.unlink(missing_ok=True)
