"""``dhisparse up`` as a benchmark or an end-to-end test starts it: the command ``make run`` runs,
on free ports and a fresh arena path (so it can run beside others on one machine), every serving
setting its default unless ``flags`` say otherwise; stopped, and its children killed by PID,
however the run ends. ``bench/serving/stack.py`` starts the three services itself instead, with
every engine knob a benchmark sets."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.core.processes import HOST
from bench.core.processes import free_port as any_free_port

SERVING = "dhisparse is serving"  # what `up` prints once every child is ready


@dataclass
class UpStack:
    """A running ``dhisparse up``: the gateway at ``base``, worker 0's metrics at
    ``worker_metrics``, ``up``'s output (its children's too) in ``log``."""

    base: str
    worker_metrics: str
    log: Path

    def pids(self, name: str) -> list[int]:
        """PIDs ``up`` started for child ``name`` (``worker-0``, ``kv-host-store``), oldest
        first."""
        return [int(p) for p in re.findall(rf"\[up\] {name}: pid (\d+)", self.log.read_text())]

    def argv(self, name: str) -> list[str]:
        """The arguments ``up`` last started child ``name`` with (after the subcommand)."""
        found = re.findall(rf"\[up\] {name}: pid \d+: (.*)", self.log.read_text())
        return found[-1].split() if found else []

    def metric(self, url: str, name: str, **labels: str) -> float | None:
        """The first sample of ``name`` with ``labels`` at the Prometheus endpoint ``url``."""
        for line in httpx.get(url, timeout=5).text.splitlines():
            named = line.startswith(name + "{") or line.startswith(name + " ")
            if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return None

    def info(self, name: str) -> dict[str, str]:
        """The labels of the info gauge ``name`` at worker 0's metrics."""
        for line in httpx.get(self.worker_metrics, timeout=5).text.splitlines():
            if line.startswith(name + "{"):
                body = line[line.index("{") + 1 : line.rindex("}")]
                return dict(kv.split("=", 1) for kv in body.replace('"', "").split(","))
        raise LookupError(f"no {name} at {self.worker_metrics}")


def wait_serving(proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    """Until ``up`` says it serves; raises with its log if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while SERVING not in log.read_text():
        if proc.poll() is not None:
            raise RuntimeError(f"dhisparse up exited ({proc.returncode}):\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"stack did not come up in {timeout_s:.0f} s:\n{log.read_text()}")
        time.sleep(0.3)


def stop_stack(proc: subprocess.Popen, log: Path, arena: str) -> None:
    """Stops ``up``, then kills its children by PID whatever state it left them in."""
    children = [int(p) for p in re.findall(r"pid (\d+)", log.read_text())]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    Path(arena).unlink(missing_ok=True)


@contextlib.contextmanager
def up_stack(
    log: Path, *flags: str, env: dict[str, str] | None = None,
    free_port: Callable[[], int] = any_free_port, startup_s: float = 180,
) -> Iterator[UpStack]:  # fmt: skip
    """``dhisparse up`` on ports from ``free_port`` and a fresh arena path, restarts on, then
    ``flags``; ``env`` adds to the environment; output to ``log``. Stopped on exit."""
    http, worker, store, store_metrics, metrics = (free_port() for _ in range(5))
    arena = f"/dev/shm/dhisparse-up-{os.getpid()}-{http}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dhisparse.cli", "up", "--port", str(http),
             "--worker-port", str(worker), "--kv-store-port", str(store),
             "--kv-store-metrics-port", str(store_metrics), "--arena-path", arena,
             "--worker-metrics-port", str(metrics), *flags],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    try:
        wait_serving(proc, log, startup_s)
        yield UpStack(f"http://{HOST}:{http}", f"http://{HOST}:{metrics}/metrics", log)
    finally:
        stop_stack(proc, log, arena)
