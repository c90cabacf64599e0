"""``bench adoption``'s arithmetic over the streams it times: each stream's delay from the kill to
its next chunk, and the usual gap between chunks (the stack itself runs in
``tests/e2e/test_peer_adoption.py``)."""

from __future__ import annotations

import pytest

from bench.adoption import delays, usual_gap


def _stream(started: float, times: list[float]) -> dict:
    return {"started": started, "chunk_times_s": times}


def test_delays_count_from_the_kill_to_each_streams_next_chunk() -> None:
    held = _stream(100.0, [0.1, 0.2, 0.3, 2.3, 2.4])  # the victim's: 2 s without a chunk
    other = _stream(100.05, [0.1, 0.2, 0.36, 0.46])
    ended = _stream(99.0, [0.1, 0.2])  # over before the kill
    got = delays([held, other, ended], kill_at=100.35)
    assert got[0] == pytest.approx(1.95) and got[1] == pytest.approx(0.06)
    assert got[2] is None


def test_usual_gap_is_the_median_chunk_gap() -> None:
    assert usual_gap([_stream(0, [0.0, 0.1, 0.2, 5.0]), _stream(0, [1.0, 1.1])]) == pytest.approx(
        0.1
    )
    assert usual_gap([_stream(0, [1.0])]) == 0.0
