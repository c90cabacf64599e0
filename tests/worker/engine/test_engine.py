"""The engine in resident mode: continuous batching, sampling and stopping."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.worker.engine.config import EngineConfig as _EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import FinishReason, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def EngineConfig(**kw) -> _EngineConfig:
    """Small pools keep engine set-up cheap."""
    kw.setdefault("kv_pool_mib", 8)
    return _EngineConfig(**kw)


def prompts(engine: Engine, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [
        torch.randint(0, 256, (int(torch.randint(5, 90, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("model", ["tiny-glm", "tiny-dsv4"])
def test_batched_decode_matches_each_request_alone(model: str) -> None:
    engine = Engine(EngineConfig(model=model, max_num_seqs=8))
    ps = prompts(engine, 6)
    batched = engine.generate(ps, GREEDY)
    for p, req in zip(ps, batched, strict=True):
        alone = Engine(EngineConfig(model=model)).generate([p], GREEDY)[0]
        assert req.output_ids == alone.output_ids
        assert len(req.output_ids) == GREEDY.max_tokens
        assert req.finish_reason is FinishReason.LENGTH


def test_requests_join_and_leave_between_steps() -> None:
    engine = Engine(EngineConfig(model="tiny-glm", max_num_seqs=4))
    ps = prompts(engine, 3)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", ps[0], GREEDY)
    engine.add_request("b", ps[1], short)
    engine.step()
    engine.step()
    engine.add_request("c", ps[2], GREEDY)  # joins while a and b are decoding
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    while engine.has_work():
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
    assert len(seen["b"]) == 3 - 2  # b finished early and left the batch
    for rid, p in (("a", ps[0]), ("c", ps[2])):
        alone = Engine(EngineConfig(model="tiny-glm")).generate([p], GREEDY)[0].output_ids
        assert alone[-len(seen[rid]) :] == seen[rid]


def test_preemption_recomputes_to_the_same_tokens() -> None:
    # A pool too small for all requests at full length forces preemption and recompute.
    cfg = EngineConfig(model="tiny-glm", max_num_seqs=4, kv_pool_mib=0.6, page_size=16)
    engine = Engine(cfg)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 256, (60,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    assert engine.kv.tokens_capacity < 4 * 120
    got = engine.generate(ps, params)
    for p, req in zip(ps, got, strict=True):
        assert (
            req.output_ids
            == Engine(EngineConfig(model="tiny-glm")).generate([p], params)[0].output_ids
        )
    assert engine.stats.prefill_tokens_computed > sum(len(p) for p in ps)  # someone was recomputed


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    engine = Engine(EngineConfig(model="tiny-dsv4"))
    p = prompts(engine, 1)[0]

    def mk(seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=20, ignore_eos=True
        )

    a, b, c = engine.generate([p, p, p], [mk(1), mk(1), mk(2)])
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_stop_string_cuts_text_and_finishes() -> None:
    engine = Engine(EngineConfig(model="tiny-glm"))
    p = prompts(engine, 1)[0]
    free = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = free.text.detok.text
    # A stop string of plain characters that first occurs a few characters in.
    i = next(
        i
        for i in range(3, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    stop = text[i : i + 2]
    req = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=20, stop=(stop,)))[0]
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == stop
    assert req.text.detok.text[: req.text.emitted] == text[: text.index(stop)]


def test_stop_token_ids_eos_and_min_tokens() -> None:
    engine = Engine(EngineConfig(model="tiny-glm"))
    p = prompts(engine, 1)[0]
    free = engine.generate([p], GREEDY)[0].output_ids
    tok = free[3]
    first = free.index(tok)
    req = engine.generate(
        [p], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(tok,))
    )[0]
    assert req.output_ids == free[: first + 1] and req.stop_reason == tok
    req = engine.generate(
        [p],
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(tok,), min_tokens=first + 2),
    )[0]
    assert tok not in req.output_ids[: first + 2]


def test_validation_errors_are_value_errors() -> None:
    engine = Engine(EngineConfig(model="tiny-glm", max_model_len=64))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("x", [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("x", [999], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("x", [1], SamplingParams(top_p=0.0))
    engine.add_request("x", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("x", [1, 2], GREEDY)


def test_abort_frees_the_slot_and_kv() -> None:
    engine = Engine(EngineConfig(model="tiny-glm", max_num_seqs=2))
    before = engine.kv.memory().free
    engine.add_request("x", [1, 2, 3], GREEDY)
    engine.step()
    assert engine.kv.memory().free < before
    out = engine.abort("x")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert engine.kv.memory().free == before and not engine.has_work()
    assert engine.abort("x") is None


def test_context_limit_finishes_with_length() -> None:
    engine = Engine(EngineConfig(model="tiny-glm", max_model_len=40))
    req = engine.generate(
        [[5] * 30], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    )[0]
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 40


@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_maintenance_runs_between_steps_while_the_device_runs_the_decode_pass(mode: str) -> None:
    """Between-step maintenance (copy completions, reclaims, refills) runs exactly once between
    the passes of consecutive steps: right after a decode pass's commit, while the device
    runs it, or at the start of the next step when the last step ran only prefills."""
    eng = Engine(
        EngineConfig(model="tiny-glm", mode=mode, kv_pool_mib=64, max_num_seqs=2,
                     host_arena_mib=32)
    )  # fmt: skip
    calls: list[str] = []
    for owner, name in ((eng.kv.payload.residency, "maintain"), (eng.kv, "commit")):
        fn = getattr(owner, name)
        setattr(owner, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n), _fn(*a, **k))[1])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", list(range(40)), params)
    eng.add_request("b", list(range(70)), params)
    steps = []
    while eng.has_work():
        before = len(calls)
        eng.step()
        steps.append(calls[before:])
    assert len(steps) > 5 and all("commit" in s for s in steps)
    for prev, cur in itertools.pairwise(steps):
        # passes of consecutive steps: one maintenance between them
        between = prev[len(prev) - prev[::-1].index("commit") :] + cur[: cur.index("commit")]
        assert between == ["maintain"], (prev, cur)
    decode_steps = steps[1:]  # both prompts were prefilled in the first step
    assert all(s[-2:] == ["commit", "maintain"] for s in decode_steps), decode_steps


def test_sampling_values_that_would_overflow_are_greedy_or_refused() -> None:
    """A temperature below 1e-5 samples greedily (dividing by it overflows float32, and the NaNs
    would end the engine); one past float32's range, or not finite, is a client error."""
    engine = Engine(EngineConfig(model="tiny-glm"))
    prompt = [5, 6, 7, 8]
    greedy = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    tiny = engine.generate([prompt], SamplingParams(temperature=1e-40, max_tokens=6))[0]
    assert tiny.output_ids == greedy.output_ids and tiny.params.greedy
    for bad in (1e39, float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            engine.add_request(f"bad-{bad}", prompt, SamplingParams(temperature=bad))


def test_unseeded_sampling_streams_repeat_alone_and_differ_between_workers() -> None:
    """An engine of no store owner draws unseeded requests from ``seed``'s stream, so its runs
    repeat; workers (store owners) each draw their own, even two lives of one worker id."""
    assert EngineConfig(seed=3).sampling_seed() == 3
    workers = [EngineConfig(seed=3, owner=o).sampling_seed() for o in ("w0", "w1", "w0")]
    assert len(set(workers)) == 3 and 3 not in workers
    assert all(0 <= s < 2**63 for s in workers)
