"""The worker's heap freeze and the collector-pause timer (``services/worker/engine/heap.py``)."""

from __future__ import annotations

import argparse
import gc
import weakref

from services.worker.cli import add_arguments, settings_from_args
from services.worker.engine.heap import GcPauses, freeze_heap


class Node:
    def __init__(self) -> None:
        self.ref = self  # a cycle: only the collector frees it


def test_freeze_exempts_what_exists_and_collects_what_comes_later() -> None:
    kept = [Node() for _ in range(100)]
    frozen_refs = [weakref.ref(n) for n in kept]
    try:
        assert freeze_heap() >= len(kept)
        del kept  # unreachable cycles now, which only a collection could free: it skips them
        with GcPauses() as pauses:
            later = [weakref.ref(Node()) for _ in range(50)]  # garbage made after the freeze
            assert gc.collect() >= 50
            assert all(r() is None for r in later)  # still collected
            assert all(r() is not None for r in frozen_refs)  # the frozen survived
            assert pauses.count[2] >= 1 and pauses.seconds[2] > 0  # ours, and maybe others
            assert pauses.longest <= pauses.total_s
        assert pauses._on not in gc.callbacks  # closed with the block
    finally:
        gc.unfreeze()
    gc.collect()
    assert all(r() is None for r in frozen_refs)  # unfrozen: collected as usual


def test_the_worker_freezes_unless_told_not_to() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert settings_from_args(p.parse_args([])).gc_freeze is True
    assert settings_from_args(p.parse_args(["--no-gc-freeze"])).gc_freeze is False
