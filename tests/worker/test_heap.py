"""The worker's heap freeze and the collector-pause timer (``services/worker/engine/heap.py``)."""

from __future__ import annotations

import argparse
import gc

from services.worker.cli import add_arguments, settings_from_args
from services.worker.engine.heap import GcPauses, freeze_heap


class Node:
    def __init__(self) -> None:
        self.ref = self  # a cycle: only the collector frees it


def test_freeze_exempts_what_exists_and_collects_what_comes_later() -> None:
    kept = [Node() for _ in range(100)]
    try:
        frozen = freeze_heap()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        with GcPauses() as pauses:
            for _ in range(50):  # garbage made after the freeze is still collected
                Node()
            assert gc.collect() >= 50
            assert pauses.count[2] == 1 and pauses.seconds[2] > 0
            assert pauses.longest <= pauses.total_s
        assert pauses._on not in gc.callbacks  # closed with the block
        assert gc.get_freeze_count() == frozen  # the frozen survived the collection
    finally:
        gc.unfreeze()


def test_the_worker_freezes_unless_told_not_to() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert settings_from_args(p.parse_args([])).gc_freeze is True
    assert settings_from_args(p.parse_args(["--no-gc-freeze"])).gc_freeze is False
