"""The stack's processes as benchmarks start them on loopback: free ports, waiting until a
process is ready (failing at once when it exits), and stopping processes by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dhisparse import up

HOST = "127.0.0.1"
_GIVEN: set[int] = set()  # the ports free_port handed out in this process


def free_port() -> int:
    """A port free now and not handed out before by this process: the kernel may give
    consecutive binds to port 0 the same port, and a stack's processes need one each."""
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def port_open(port: int) -> bool:
    return up.port_open(HOST, port)


def wait_ready(
    ready: Callable[[], bool],
    what: str,
    procs: Sequence[subprocess.Popen],
    log: Path,
    timeout: float,
) -> None:
    """Returns once ``ready()``; raises, with the log's tail, when one of ``procs`` exits first
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: a stack process exited; log:\n{log.read_text()[-4000:]}")
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready in {timeout:.0f} s; log:\n{log.read_text()[-4000:]}")


def stop(procs: Sequence[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM to each, last started first; then SIGKILL whatever did not exit, by PID."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
