"""Engines over a tiny checkpoint directory, as the real-family tests serve them: four slots,
512-token contexts, 16-row pages, a hot cache of two pages, prompts prefilled in chunks of 64."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from services.worker.durable.adoption import adopt_sessions
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams


def engine(path: Path, mode: str, host: tuple | None = None, **kw) -> Engine:
    base = dict(model=str(path), mode=mode, max_num_seqs=4, max_model_len=512, page_size=16,
                host_arena_mib=16, hot_cache_rows=32, max_prefill_tokens=64)  # fmt: skip
    return Engine(EngineConfig(**(base | kw)), host=host)


def recorded_emits(eng: Engine) -> list[tuple[str, int, torch.Tensor]]:
    """Makes ``eng`` record every emission: (request id, output tokens before it, the logits
    of the tokens it emits), in order; the list fills as the engine runs."""
    seen: list[tuple[str, int, torch.Tensor]] = []
    emit = eng.emit

    def record(req, tokens, logits):
        seen.append((req.request_id, len(req.output_ids), logits.clone()))
        return emit(req, tokens, logits)

    eng.emit = record  # type: ignore[method-assign]
    return seen


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


def resumed_after_death(
    make: Callable[[str], Engine],
    store: object,
    prompts: list[list[int]],
    params: list[SamplingParams],
    steps: int,
    check_started: Callable[[Engine], None] | None = None,
) -> tuple[list[list[int]], Engine]:
    """``reference_then_started`` (the started worker given to ``check_started``), then the
    worker dies (``del``: nothing released, nothing flushed) and a successor ``make("w0")``
    adopts its sessions from the node's ``store`` and finishes them, checked: every session
    resumed, each ending with the uninterrupted engine's tokens, no prompt token computed
    again. Returns (those tokens, the successor)."""
    want, first = reference_then_started(make, prompts, params, steps)
    if check_started is not None:
        check_started(first)
    del first  # dies: nothing released, nothing flushed
    second = make("w0")
    report = adopt_sessions(second, store, "w0", second.kv.host_backups.generation)
    names = [f"r{i}" for i in range(len(prompts))]
    assert report.resumed == names
    reqs = [second.requests[n] for n in names]
    while second.has_work():
        second.step()
    assert [r.output_ids for r in reqs] == want
    assert second.stats.prefill_tokens_computed == 0
    return want, second


def scored_prompt(
    eng: Engine,
    reference_logits: Callable[[list[int]], torch.Tensor],
    prompt: list[int],
    beside: list[int],
    top: int,
) -> tuple[list, torch.Tensor]:
    """Serves ``prompt`` asking for its prompt logprobs (``top`` alternatives) beside another
    request; checks the first output carries one per prompt token and that each scored
    token's logprob is the reference's ``log_softmax`` (``reference_logits(prompt)``: [n, V]).
    Returns (the scores of tokens 1.., the reference's log-probabilities [n - 1, V])."""
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=top)
    eng.add_request("asked", prompt, asked)
    eng.add_request("beside", beside, SamplingParams(temperature=0.0, max_tokens=2))
    first = None
    while eng.has_work():
        for out in eng.step():
            if out.request_id == "asked" and first is None:
                first = out
    assert first is not None and len(first.prompt_logprobs) == len(prompt)
    want = torch.log_softmax(reference_logits(prompt)[:-1], dim=-1)
    got = first.prompt_logprobs[1:]
    assert [lp.token_id for lp in got] == prompt[1:]
    expect = want[torch.arange(len(prompt) - 1), prompt[1:]]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), expect, atol=2e-4, rtol=0)
    return list(got), want
