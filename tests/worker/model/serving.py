"""Engines over a tiny checkpoint directory, as the real-family tests serve them: four slots,
512-token contexts, 16-row pages, a hot cache of two pages, prompts prefilled in chunks of 64."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams


def engine(path: Path, mode: str, host: tuple | None = None, **kw) -> Engine:
    base = dict(model=str(path), mode=mode, max_num_seqs=4, max_model_len=512, page_size=16,
                host_arena_mib=16, hot_cache_rows=32, max_prefill_tokens=64)  # fmt: skip
    return Engine(EngineConfig(**(base | kw)), host=host)


def tight_pool_mib(path: Path, **kw) -> float:
    """A pool of 50 pages per layer (a draft layer's included) beyond the fixed allocations of
    an adaptive engine configured by ``kw``: admissions of later requests must reclaim
    optional history of the running ones."""
    probe = engine(path, "adaptive", **(kw | {"kv_pool_mib": 64}))
    page_bytes = 16 * probe.model_cfg.d_kv * 4
    fixed = (64 << 20) - probe.kv.payload.store.pages.total * page_bytes
    pages = 50 * probe.model_cfg.n_layers
    probe.close()
    return (fixed + pages * page_bytes) / (1 << 20)


def reference_then_started(
    make: Callable[[str], Engine],
    prompts: list[list[int]],
    params: list[SamplingParams],
    steps: int,
) -> tuple[list[list[int]], Engine]:
    """(the tokens an uninterrupted engine ``make("ref")`` generates, the worker ``make("w0")``
    serving the same requests ``r0``, ``r1``, ... for ``steps`` steps): the caller checks it,
    then lets it die (``del``: nothing released, nothing flushed) and resumes its sessions."""
    ref = make("ref")
    want = [r.output_ids for r in ref.generate(prompts, params)]
    del ref
    first = make("w0")
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        first.add_request(f"r{i}", p, sp)
    for _ in range(steps):
        first.step()
    return want, first
