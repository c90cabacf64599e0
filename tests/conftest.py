"""Shared test set-up. Without a GPU, TRITON_INTERPRET must be set before any @triton.jit module
is imported, so kernels run on the CPU under the interpreter."""

from __future__ import annotations

import os
import random
import socket

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker process gets its share of the cores, and so does every process
# a test starts (a bench, a worker, a gateway): OpenMP threads beyond it spin-wait on cores the
# other xdist worker is busy on, which made a bench run five times slower beside it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
os.environ["OMP_NUM_THREADS"] = str(_THREADS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_GIVEN: set[int] = set()
_SLICE = 12000  # ports below the ephemeral range, shared out among the xdist workers


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(also: tuple[int, ...] = ()) -> int:
    """A port that is free now, below the kernel's ephemeral range (outgoing connections take
    their source ports from it, so no client socket can take it between this call and the
    server's bind), in this xdist worker's own slice (two workers never pick the same one)
    and not handed out before by this process. ``also``: offsets from it of ports a process
    derives from it (``dhisparse up``'s worker i listens on port + i, its metrics on + 10 i),
    free and handed out with it."""
    low = _ephemeral_low()
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    span = _SLICE // _WORKERS
    base = low - _SLICE + (worker % _WORKERS) * span
    if base < 1024:  # no room below the range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    offsets = (0, *also)
    for _ in range(10 * span):
        p = base + random.randrange(span - max(offsets))
        ports = [p + d for d in offsets]
        if any(q in _GIVEN for q in ports) or not all(map(_bindable, ports)):
            continue
        _GIVEN.update(ports)
        return p
    raise RuntimeError(f"no free port in {base}..{base + span - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def port() -> int:
    return free_port()
