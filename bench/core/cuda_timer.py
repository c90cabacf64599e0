"""Device time of a small kernel call, for the kernel benchmarks: ``inner`` calls captured in
one CUDA graph (or launched eagerly) between two CUDA events, so launch overhead does not
hide the kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_timer(fn: Callable[[], object], inner: int, graph: bool) -> Callable[[], float]:
    """A function returning the device ms of one call of ``fn`` (``inner`` calls per event
    pair, in one CUDA graph replay unless ``graph`` is False)."""
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()  # warm-up: compile, autotune caches, cuBLAS workspaces
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        launch = g.replay
    else:
        fn()

        def launch() -> None:
            for _ in range(inner):
                fn()

    def once() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / inner

    return once
