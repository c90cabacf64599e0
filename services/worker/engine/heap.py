"""The Python heap while serving: freezing what start-up built, and timing the collector.

A full (generation 2) collection walks every object the collector tracks, and a serving
process tracks many that live as long as it does: the model's modules, the graphs' pools, the
scheduler's tables. Walking them again and again stalls the step that triggers it by up to
several decode steps' time. ``freeze_heap`` moves everything alive after
start-up into the permanent generation, which collections skip, as vLLM and SGLang do after
their start-up; objects made while serving are still collected as before."""

from __future__ import annotations

import atexit
import gc
import time


def freeze_heap() -> int:
    """Collects once, then exempts every surviving object from later collections. Returns
    how many objects were frozen."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit, what start-up built is released as usual
    return gc.get_freeze_count()


class GcPauses:
    """Time the collector stops the process, per generation, from ``gc.callbacks`` (while
    open). The callback only adds numbers: it takes no lock, so it cannot deadlock with the
    code whose allocation set the collection off."""

    _process: GcPauses | None = None

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self.longest = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        dt = time.perf_counter() - self._start
        gen = info["generation"]
        self.seconds[gen] += dt
        self.count[gen] += 1
        self.longest = max(self.longest, dt)

    @property
    def total_s(self) -> float:
        return sum(self.seconds)

    @classmethod
    def process(cls) -> GcPauses:
        """The one recorder that stays open for the life of the process (the worker's
        metrics read it)."""
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def close(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)

    def __enter__(self) -> GcPauses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
