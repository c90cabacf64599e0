"""``bench adoption``'s arithmetic over the streams it times: each stream's delay from the kill to
its next chunk, and the usual gap between chunks; when a trial may start and when it kills (the
stack itself runs in ``tests/e2e/test_peer_adoption.py``)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from bench.adoption import Killer, delays, serving, usual_gap


def _stream(started: float, times: list[float]) -> dict:
    return {"started": started, "chunk_times_s": times}


def test_delays_are_each_streams_longest_wait_from_the_kill_on() -> None:
    held = _stream(100.0, [0.1, 0.2, 0.3, 2.3, 2.4])  # the victim's: 2 s without a chunk
    # the victim's too, two chunks it sent before it died arriving after the kill
    buffered = _stream(100.0, [0.1, 0.36, 0.37, 1.9, 2.0])
    other = _stream(100.05, [0.1, 0.2, 0.36, 0.46, 0.5])
    ended = _stream(99.0, [0.1, 0.2])  # over before the kill
    got = delays([held, buffered, other, ended], kill_at=100.35)
    assert got[0] == pytest.approx(1.95) and got[1] == pytest.approx(1.53)
    assert got[2] == pytest.approx(0.1) and got[3] is None


def test_usual_gap_is_the_median_chunk_gap() -> None:
    assert usual_gap([_stream(0, [0.0, 0.1, 0.2, 5.0]), _stream(0, [1.0, 1.1])]) == pytest.approx(
        0.1
    )
    assert usual_gap([_stream(0, [1.0])]) == 0.0


class _Stack:
    """What ``serving`` and ``Killer`` read of an ``UpStack``: its log, the PIDs ``up``
    started, metrics (unreachable here: every sample reads 0)."""

    worker_metrics = "http://127.0.0.1:9/metrics"

    def __init__(self, log: Path, pids: dict[str, list[int]]) -> None:
        self.log, self._pids = log, pids

    def pids(self, name: str) -> list[int]:
        return self._pids.get(name, [])

    def metric(self, url: str, name: str, **labels: str) -> float | None:
        raise httpx.ConnectError("no metrics here")


def test_a_killed_worker_does_not_serve_before_up_has_started_its_successor(
    tmp_path: Path,
) -> None:
    log = tmp_path / "up.log"
    log.write_text("worker worker-0 serving glm-dsa-mini\n")
    stack = _Stack(log, {"worker-0": [11]})
    assert serving(stack, 0, dead=set())  # type: ignore[arg-type]
    # killed, and up has not noticed yet: its last PID is still the dead one
    assert not serving(stack, 0, dead={11})  # type: ignore[arg-type]
    stack._pids["worker-0"] = [11, 12]  # the successor started, not serving yet
    assert not serving(stack, 0, dead={11})  # type: ignore[arg-type]
    log.write_text(log.read_text() + "worker worker-0 serving glm-dsa-mini\n")
    assert serving(stack, 0, dead={11})  # type: ignore[arg-type]


def test_the_kill_waits_until_every_stream_has_its_first_chunk(tmp_path: Path) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        stack = _Stack(tmp_path / "up.log", {"worker-0": [victim.pid], "worker-1": [1]})
        dead: set[int] = set()
        killer = Killer(stack, at=3, n=3, dead=dead)  # type: ignore[arg-type]
        for c in (1, 2, 3, 4):
            killer(0, c)  # stream 0 past chunk 3, stream 2 still waiting for its first
        killer(1, 1)
        assert killer.kill is None and victim.poll() is None
        killer(2, 1)
        assert killer.kill is not None and killer.kill["after_chunk"] == 4
        assert victim.wait(timeout=10) == -signal.SIGKILL and dead == {victim.pid}
        killer(0, 5)  # once only
        assert dead == {victim.pid}
    finally:
        victim.kill()
        victim.wait()
