"""The variants served side by side: one engine (one KV cache, one set of requests) and, per
variant, its own set of captured decode graphs. The ``unfused`` variant's steps (warm-up, graph
capture, every timed and profiled step) run their passes unfused, so its graphs hold the torch
forms; the ``fused`` variant's passes run fused, as an engine with ``--fused-kernels`` runs
them (``ModelPasses.fused``, set per variant).

One engine rather than one per variant: two KV caches of C requests at the context, beside
tens of GB of weights, do not fit one device at the larger C, and each would prefill every
request again. Each variant's step advances the same requests by one token, as lockstep of two
engines advances each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import DecodeGraphs
from services.worker.ops.fusion import kernel_fusion
from services.worker.request.request import SamplingParams

VARIANTS = ("fused", "unfused")


@dataclass
class Variant:
    name: str
    graphs: DecodeGraphs | None  # None: the engine runs eagerly (no graphs on this device)

    def kernels(self) -> AbstractContextManager[None]:
        return kernel_fusion(self.name == "fused")

    def counters(self) -> dict[str, int]:
        g = self.graphs
        return {} if g is None else {"replays": g.replays, "eager": g.eager, "captures": g.captures}


class Served:
    """``eng`` with each variant's graphs swapped in for its steps."""

    def __init__(self, eng: Engine, names: list[str]) -> None:
        self.eng = eng
        own = eng.passes.graphs
        cfg = eng.cfg
        self.variants = [
            Variant(n, None if own is None else own if i == 0 else DecodeGraphs(
                eng.model, eng.kv, cfg.max_num_seqs,
                consecutive=cfg.graphs.capture == "consecutive",
            ))
            for i, n in enumerate(names)
        ]  # fmt: skip
        self.cuda = eng.device.type == "cuda"

    @property
    def graphs(self) -> bool:
        return self.eng.passes.graphs is not None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.eng.device)

    @contextmanager
    def as_variant(self, v: Variant, eager: bool = False) -> Iterator[None]:
        """Within the block, ``eng.step()`` is ``v``'s (``eager``: its pass runs without graphs):
        its graphs, and its passes fused or not (``ModelPasses.fused``, which the engine's passes
        enter whatever surrounds them; the block's own ``kernel_fusion`` covers the rest)."""
        passes = self.eng.passes
        own = passes.fused
        passes.graphs = None if eager else v.graphs
        passes.fused = v.name == "fused"
        try:
            with v.kernels():
                yield
        finally:
            passes.graphs = self.variants[0].graphs
            passes.fused = own

    def step(self, v: Variant) -> None:
        with self.as_variant(v):
            self.eng.step()

    def timed_step(self, v: Variant) -> float:
        """Seconds of one synchronised step of ``v``."""
        self.sync()
        t0 = time.perf_counter()
        self.step(v)
        self.sync()
        return time.perf_counter() - t0

    def admit(self, prompts: list[list[int]], params: SamplingParams) -> float:
        """Adds a request per prompt and steps as variant 0 (whose graphs are the engine's own:
        the running requests' decode passes may capture some) until every request is
        prefilled; the seconds it took."""
        eng = self.eng
        first = len(eng.request_ids())
        self.sync()
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            eng.add_request(f"decode-{first + i}", prompt, params)
        while eng.num_waiting or any(r.num_computed == 0 for r in eng.scheduler.running):
            self.step(self.variants[0])
        self.sync()
        return time.perf_counter() - t0

    def keep(self, c: int) -> None:
        """Ends every request but the first ``c``."""
        for rid in self.eng.request_ids()[c:]:
            self.eng.abort(rid)
        running = self.eng.num_running
        if running != c:
            raise RuntimeError(f"{running} requests running, not the {c} asked for")
