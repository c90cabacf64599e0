"""How long this worker took to start: from its process's start (a group's supervisor's, for a
worker that spans ranks: the ranks inherit the mark) to serving. Reported to the gateway
(``ModelInfo.startup_s``), whose wait for a restarted worker follows it."""

from __future__ import annotations

import os
import time

STARTED_ENV = "DHISPARSE_WORKER_STARTED_AT"  # wall-clock seconds, set once per worker
_IMPORTED_AT = time.time()  # where /proc cannot say when the process started


def process_start(pid: int | str = "self") -> float:
    """Wall-clock seconds at which process ``pid`` (default this one) started (Linux: /proc;
    else, for this process, this module's import, a little later)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the fields after the command name (which may hold spaces), the 22nd is starttime
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def mark_start() -> None:
    """Records this process's start time for its children (a group's ranks), unless a parent
    already did: the worker's start-up then runs from the outermost process."""
    os.environ.setdefault(STARTED_ENV, repr(process_start()))


def startup_seconds() -> float:
    """Seconds since the worker's start (``mark_start``; else this process's own start)."""
    started = os.environ.get(STARTED_ENV)
    t0 = float(started) if started else process_start()
    return max(0.0, time.time() - t0)
