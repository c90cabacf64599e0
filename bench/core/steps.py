"""Decode rates that hold up on a noisy host: the median over decode steps.

On the H200 host (``python -m bench profile-step --series``) the same configuration's steps
alternate between fast and slow phases, whatever the serving mode, so a rate taken as total
tokens / total time over a short run moves by tens of percent from run to run. The median of
the per-step rates (tokens a decode step emitted / its time) ignores those phases while they
last fewer than half of the steps; benchmarks report it next to the aggregate."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams


class StepRates:
    """Watches an engine's decode counters across ``step()`` calls."""

    def __init__(self, engine) -> None:
        self.stats = engine.stats
        self.rates: list[float] = []  # tokens/s of each decode step
        self._last = (self.stats.decode_s, self.stats.decode_tokens)

    def record(self) -> None:
        """Call after each ``engine.step()``."""
        s, t = self.stats.decode_s, self.stats.decode_tokens
        ds, dt = s - self._last[0], t - self._last[1]
        self._last = (s, t)
        if dt > 0 and ds > 0:
            self.rates.append(dt / ds)

    @property
    def median(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0


def steady_engine(
    mode: str,
    prompts: list[list[int]],
    context: int,
    pool_gib: float,
    checkpoint: str = "bench-glm",
    model=None,
    tokenizer=None,
    built: Callable[[Engine], None] | None = None,
    **config,
) -> Engine:
    """An engine of the profiling benchmarks (``profile-step``, ``step-timeline``) serving
    ``checkpoint`` (or the built ``model``) and decoding one never-ending greedy request per
    prompt (``context`` tokens each), stepped until every one is prefilled. ``built`` sees the
    engine before its first pass (a replay of selections is installed there). ``config``:
    other ``EngineConfig`` fields, or overrides."""
    fields = dict(
        model=checkpoint, mode=mode, kv_pool_mib=pool_gib * 1024, max_num_seqs=len(prompts),
        page_size=64, max_model_len=context + 512, max_prefill_tokens=context,
        hot_cache_rows=1024, host_arena_mib=16 * 1024 if mode != "resident" else 16,
    )  # fmt: skip
    eng = Engine(EngineConfig(**{**fields, **config}), model=model, tokenizer=tokenizer)
    if built is not None:
        built(eng)
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"p{i}", prompt, params)
    while eng.num_waiting or any(r.num_computed == 0 for r in eng.scheduler.running):
        eng.step()
    return eng
