"""Runs a matrix at the engine level (in-process engines) or the HTTP level (the real stack),
one engine (or stack) per engine key, its runs in order, under an overall time limit."""

from __future__ import annotations

import asyncio
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.core import provenance
from bench.core.clock import OwnClock
from bench.core.lockstep import lockstep
from services.worker.engine.config import EngineConfig

from .config import EngineKey, Load, RunSpec
from .engines import build_engine, engine_config, pool_bytes
from .loop import ClosedLoop, closed_loop
from .setup import BENCH_GLM, Sizing, Target
from .summary import summarize

OnRun = Callable[[RunSpec, dict | None, str | None], None]  # (run, metrics, skipped because)


def by_engine(runs: list[RunSpec]) -> list[tuple[EngineKey, list[RunSpec]]]:
    """Runs grouped by engine key, in first-appearance order."""
    groups: dict[EngineKey, list[RunSpec]] = {}
    for r in runs:
        groups.setdefault(r.key, []).append(r)
    return list(groups.items())


class Deadline:
    """Stops starting work that would end past ``limit_s`` after ``start``."""

    def __init__(self, limit_s: float | None, per_run_s: float) -> None:
        self.start = time.monotonic()
        self.limit_s = limit_s
        self.per_run_s = per_run_s

    def allows(self, runs: int = 1, extra_s: float = 0.0) -> bool:
        if self.limit_s is None:
            return True
        left = self.limit_s - (time.monotonic() - self.start)
        return left >= runs * self.per_run_s + extra_s


@dataclass(frozen=True)
class Bench:
    """What every run of a benchmark shares."""

    target: Target
    prefixes: dict[int, list[list[int]]]  # input length -> prepared prompts
    sizing: Sizing
    load: Load
    device: str
    drafter_dir: str
    spec_width: int
    durable: bool | None = None  # None: the engine's default (on with a host store)

    def config(self, key: EngineKey, pool: int | None = None) -> EngineConfig:
        return engine_config(self.target, key, self.sizing, self.device, self.drafter_dir,
                             self.spec_width, pool, self.durable)  # fmt: skip

    @property
    def warmup_prompts(self) -> list[list[int]]:
        return self.prefixes[max(self.prefixes)][:2]

    def build(self, key: EngineKey, store) -> tuple:
        """(engine, what it was built with), warmed up."""
        return build_engine(self.target, key, self.sizing, self.device, self.drafter_dir,
                            self.spec_width, self.warmup_prompts, store, self.durable)  # fmt: skip

    def metrics(self, res, eng) -> dict:
        return summarize(res, eng.kv.row_bytes, self.sizing.page_size, self.load.output_len)

    def close(self, engines: list) -> None:
        for eng in engines:
            eng.close()
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


ENGINE_SETUP_S = 10.0  # what building and warming up one engine may take
STACK_SETUP_S = 30.0  # ... and starting one stack


def engine_level(
    b: Bench, runs: list[RunSpec], deadline: Deadline, on_run: OnRun, lockstep: bool = False
) -> list[dict]:
    """Returns what each engine was built with; reports every run through ``on_run``. The
    hierarchy engines share one host store (its arena is mapped and pinned once), each as its
    own owner, as workers share a node's. With ``lockstep`` every engine exists at once and
    the runs of each input length and concurrency step in turn (``_lockstep_runs``); else each
    engine runs its runs, one engine after the other."""
    from services.worker.hierarchy.local_store import LocalHostStore

    engines = []
    store = None
    if any(r.key.mode != "resident" for r in runs):
        store = LocalHostStore(b.sizing.host_arena_bytes)
    try:
        if lockstep:
            return _lockstep_runs(b, runs, deadline, on_run, store)
        for key, group in by_engine(runs):
            if not deadline.allows(1, ENGINE_SETUP_S):
                for r in group:
                    on_run(r, None, "time limit")
                continue
            engines.append(_engine_runs(b, key, group, deadline, on_run, store))
    finally:
        if store is not None:
            store.close()
    return engines


def _engine_runs(b: Bench, key: EngineKey, group: list[RunSpec], deadline: Deadline,
                 on_run: OnRun, store) -> dict:  # fmt: skip
    eng, info = b.build(key, store)
    try:
        for r in group:
            if not deadline.allows():
                on_run(r, None, "time limit")
                continue
            res = closed_loop(eng, b.prefixes[r.input_len], r.concurrency, b.load, r.name)
            on_run(r, b.metrics(res, eng), None)
    finally:
        b.close([eng])
    return info


def _lockstep_runs(
    b: Bench, runs: list[RunSpec], deadline: Deadline, on_run: OnRun, store
) -> list[dict]:
    """The runs that share an input length and a concurrency run in lockstep
    (``bench/core/lockstep.py``), each on its own clock: the host's slow phases fall on all the
    engines compared alike, and no run's latencies count the others' steps."""
    built: dict[EngineKey, tuple] = {}
    try:
        for key, _ in by_engine(runs):
            if deadline.allows(1, ENGINE_SETUP_S):
                built[key] = b.build(key, store)
        points: dict[tuple[int, int], list[RunSpec]] = {}
        for r in runs:
            points.setdefault((r.input_len, r.concurrency), []).append(r)
        for group in points.values():
            todo = [r for r in group if r.key in built]
            if not deadline.allows(len(todo)):
                todo = []
            for r in group:
                if r not in todo:
                    on_run(r, None, "time limit")
            loops = [
                ClosedLoop(built[r.key][0], b.prefixes[r.input_len], r.concurrency, b.load,
                           r.name, OwnClock())
                for r in todo
            ]  # fmt: skip
            lockstep(loops)
            for r, loop in zip(todo, loops, strict=True):
                on_run(r, b.metrics(loop.result(), built[r.key][0]), None)
    finally:
        b.close([eng for eng, _ in built.values()])
    return [info for _, info in built.values()]


def http_level(
    b: Bench, runs: list[RunSpec], deadline: Deadline, on_run: OnRun, log_dir: Path
) -> list[dict]:
    """The same runs over HTTP: one stack per engine key, on loopback."""
    from .http_loop import http_closed_loop
    from .stack import Stack

    provenance.include_modules(provenance.STACK_MODULES)

    stacks = []
    with tempfile.TemporaryDirectory(prefix="dhisparse-bench-model-") as tmp:
        model_arg = b.target.spec
        if model_arg == BENCH_GLM:  # the worker process loads it from a directory
            from services.worker.weights.model_io import save_pretrained

            save_pretrained(b.target.model, tmp)
            model_arg = tmp
        for key, group in by_engine(runs):
            if not deadline.allows(1, STACK_SETUP_S):
                for r in group:
                    on_run(r, None, "time limit")
                continue
            pool, fixed = pool_bytes(b.target, b.config(key), b.sizing)
            cfg = b.config(key, pool)
            host = b.sizing.host_arena_bytes
            queue = 4 * max(r.concurrency for r in group)
            with Stack(cfg, model_arg, host, log_dir, max_queue=queue) as s:
                stacks.append({"engine": key.name, "pool_bytes": pool, "fixed_bytes": fixed,
                               "drafter_source": cfg.speculation.drafter, "host_store_bytes": host,
                               "durable_sessions": cfg.durable})  # fmt: skip
                _warm(s, b.target.name, b.warmup_prompts, 2 * b.spec_width + 2)
                for r in group:
                    if not deadline.allows():
                        on_run(r, None, "time limit")
                        continue
                    m = asyncio.run(http_closed_loop(
                        s.base, s.worker_metrics, b.target.name, b.prefixes[r.input_len],
                        r.concurrency, b.load, key.mode,
                    ))  # fmt: skip
                    on_run(r, m, None)
                    time.sleep(0.5)  # let the stack finish aborting the last run's streams
    return stacks


def _warm(stack, model: str, prompts: list[list[int]], tokens: int) -> None:
    """Short requests through the whole stack: kernels compile before anything is timed."""
    import httpx

    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(stack.base + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
