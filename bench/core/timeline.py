"""Stamps of where the host is during an engine step: wrapped calls stamp their start and end
(``name>``, ``<name``), a replayed CUDA graph also its device time (events)."""

from __future__ import annotations

import statistics
import time

import torch

from services.worker.kv.batch import ForwardBatch


class Timeline:
    """Stamps (name, perf_counter) of the wrapped calls; the last replay's device events."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []
        self.events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def stamp(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            self.stamp(name + ">")
            try:
                return fn(*a, **kw)
            finally:
                self.stamp("<" + name)

        setattr(owner, attr, timed)

    def wrap_replay(self) -> None:
        replay = torch.cuda.CUDAGraph.replay

        def timed(graph) -> None:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            self.stamp("replay>")
            replay(graph)
            self.stamp("<replay")
            e1.record()
            self.events = (e0, e1)

        torch.cuda.CUDAGraph.replay = timed  # type: ignore[method-assign]

    def wrap_build(self) -> None:
        build = ForwardBatch.build

        def timed(*a, **kw):
            self.stamp("batch>")
            try:
                return build(*a, **kw)
            finally:
                self.stamp("<batch")

        ForwardBatch.build = staticmethod(timed)  # type: ignore[method-assign]

    def since(self, first: float) -> dict[str, float]:
        """Milliseconds from ``first`` (a perf_counter) to each stamp; a name stamped several
        times keeps its last."""
        return {k: (t - first) * 1e3 for k, t in self.marks}


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of each key over the rows that have it, in the order of the first row."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
