"""A worker's start-up time: from its outermost process's start (inherited by a group's ranks)
to now, as ``ModelInfo.startup_s`` reports it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from services.worker import startup


def test_a_process_measures_from_its_own_start(monkeypatch) -> None:
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the marks stay in this test
    os.environ.pop(startup.STARTED_ENV, None)
    t0 = startup.process_start()
    assert t0 <= time.time() and time.time() - t0 < 24 * 3600
    assert abs(startup.startup_seconds() - (time.time() - t0)) < 1.0


def test_children_measure_from_the_mark_their_parent_set(monkeypatch) -> None:
    """``mark_start`` in the supervisor: a rank spawned later counts the supervisor's time."""
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the marks stay in this test
    os.environ.pop(startup.STARTED_ENV, None)
    startup.mark_start()
    mark = float(os.environ[startup.STARTED_ENV])
    assert mark == startup.process_start()
    os.environ[startup.STARTED_ENV] = repr(time.time() - 30.0)  # a supervisor 30 s old
    startup.mark_start()  # set once: a later call keeps the outer mark
    assert float(os.environ[startup.STARTED_ENV]) != mark
    code = "from services.worker import startup; print(startup.startup_seconds())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=os.environ.copy())  # fmt: skip
    assert 30.0 <= float(out.stdout) < 60.0
