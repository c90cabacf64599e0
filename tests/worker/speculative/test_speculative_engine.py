"""Speculative decoding in the engine, in every serving mode: greedy output equals plain greedy
decoding for each drafter, with verification unions served through the hierarchy (B = k, so
unions overflow into staging)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.speculator import SpecCounters

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (130, 45, 210, 77)]


def config(model: str, mode: str, **kw) -> EngineConfig:
    spec = SpeculationConfig(
        kw.pop("drafter", None), kw.pop("spec_width", 8), kw.pop("width_policy", "fixed")
    )
    return EngineConfig(
        model=model, mode=mode, kv_pool_mib=kw.pop("kv_pool_mib", 48), host_arena_mib=32,
        max_num_seqs=6, max_prefill_tokens=1024, max_model_len=kw.pop("max_model_len", 1024),
        hot_cache_rows=kw.pop("hot", None), speculation=spec, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain() -> dict[str, list[list[int]]]:
    out = {}
    for model in ("tiny-glm", "tiny-dsv4"):
        eng = Engine(config(model, "resident"))
        out[model] = [r.output_ids for r in eng.generate(prompts(), GREEDY)]
    return out


@pytest.mark.parametrize("drafter", ["dflash", "dspark", "dflash2"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_speculative_greedy_equals_plain_greedy(plain, drafter: str, mode: str) -> None:
    model = "tiny-glm" if drafter != "dspark" else "tiny-dsv4"
    k = 32 if model == "tiny-glm" else 16
    eng = Engine(config(model, mode, drafter=drafter, spec_width=4, hot=k))
    got = [r.output_ids for r in eng.generate(prompts(), GREEDY)]
    assert got == plain[model]
    c = eng.speculator.counters
    assert c.drafts > 0 and c.draft_tokens > 0
    eng.close()


@pytest.mark.parametrize("policy", ["paper", "online"])
def test_width_policies_keep_greedy_output(plain, policy: str) -> None:
    eng = Engine(
        config("tiny-glm", "hisparse", drafter="dflash", spec_width=8, width_policy=policy)
    )
    got = [r.output_ids for r in eng.generate(prompts(), GREEDY)]
    assert got == plain["tiny-glm"]
    assert eng.speculator.counters.width in (0, 1, 4, 6, 8)
    eng.close()


def test_stop_and_min_tokens_inside_a_round() -> None:
    """Tokens after a stop inside an accepted block are never emitted."""
    eng = Engine(config("tiny-glm", "resident", drafter="dflash", spec_width=6))
    p = prompts()[0]
    free = Engine(config("tiny-glm", "resident")).generate([p], GREEDY)[0].output_ids
    tok = free[5]
    first = free.index(tok)
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(tok,), ignore_eos=True)
    req = eng.generate([p], params)[0]
    assert req.output_ids == free[: first + 1]
    short = eng.generate([p], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0]
    assert short.output_ids == free[:7]
    eng.close()


def _logprobs(eng: Engine, params: SamplingParams) -> dict[str, list]:
    """Each prompt's emitted tokens' logprobs (``TokenLogprob``s) over its outputs."""
    got: dict[str, list] = {}
    for i, p in enumerate(prompts()):
        eng.add_request(f"lp{i}", p, params)
    while eng.has_work():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.logprobs)
    return got


@pytest.mark.parametrize("drafter", ["mtp", "models/glm-dsa-mini/drafters/dflash2"])
def test_logprobs_of_speculated_tokens_are_plain_decodings(drafter: str) -> None:
    """The shipped model with its trained drafters (whose proposals are accepted): tokens
    emitted from a verify round carry the logprobs plain decoding gives them (the sampled
    token's and the top 3, from that position's verified row), within the rounding of a
    K-query pass beside a one-query one."""
    model, pool = "models/glm-dsa-mini", {"kv_pool_mib": 256}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = _logprobs(Engine(config(model, "adaptive", **pool)), params)
    eng = Engine(config(model, "adaptive", drafter=drafter, spec_width=4, **pool))
    spec = _logprobs(eng, params)
    assert eng.speculator is not None and eng.speculator.counters.accepted > 0
    assert spec.keys() == plain.keys()
    for rid, want in plain.items():
        got = spec[rid]
        assert [t.token_id for t in got] == [t.token_id for t in want], rid
        for a, b in zip(got, want, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top, strict=True))
    eng.close()


@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_requests_near_their_end_keep_the_pass_at_one_width(plain, mode: str) -> None:
    """A request with fewer tokens left than the block verifies only those, but the pass still
    runs K queries for every request (its shape, and so its CUDA graph, stays the same); with
    no room for K (the context's end) the pass narrows instead. Output is plain greedy's."""
    passes: list[tuple[tuple[int, ...], list[int]]] = []

    def recording(eng: Engine) -> Engine:
        assert eng.speculator is not None
        forward = eng.speculator.forward

        def record(tokens, batch, features=None):
            caps = [
                min(4, r.params.max_tokens - len(r.output_ids))
                for r in eng.scheduler.running
                if r.slot in batch.slot_ids
            ]
            passes.append((batch.lens, caps))
            return forward(tokens, batch, features)

        eng.speculator.forward = record
        return eng

    eng = recording(Engine(config("tiny-glm", mode, drafter="dflash", spec_width=4)))
    got = [r.output_ids for r in eng.generate(prompts(), GREEDY)]
    assert got == plain["tiny-glm"]
    narrowed = [(lens, caps) for lens, caps in passes if min(caps) < 4]
    assert narrowed, "some rounds had a request near its end"
    assert all(set(lens) == {4} for lens, _ in narrowed)
    eng.close()

    # a context that ends inside the block: no room for K queries, the pass narrows
    cfg = config("tiny-glm", mode, drafter="dflash", spec_width=4, max_model_len=260)
    eng = recording(Engine(cfg))
    passes.clear()
    long = prompts()[2]  # 210 tokens: 50 left in the context
    out = eng.generate([long], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    free = Engine(config("tiny-glm", mode, max_model_len=260)).generate(
        [long], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    )
    assert out[0].output_ids == free[0].output_ids
    assert any(max(lens) < 4 for lens, _ in passes)
    eng.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_speculative_greedy_over_fp8_kv_equals_plain_fp8_greedy(mode: str) -> None:
    """Verify rounds read packed FP8 rows as decode steps do (B = k: unions overflow into
    staging, which holds packed rows too)."""
    fp8 = {"kv_cache_dtype": "fp8"}
    ref = Engine(config("tiny-glm", "resident", **fp8))
    want = [r.output_ids for r in ref.generate(prompts(), GREEDY)]
    eng = Engine(config("tiny-glm", mode, drafter="dflash", spec_width=4, hot=32, **fp8))
    assert eng.kv.payload.pool(0).dtype == torch.uint8
    assert [r.output_ids for r in eng.generate(prompts(), GREEDY)] == want
    assert eng.speculator.counters.drafts > 0
    eng.close()
    ref.close()


class RoundClock:
    """A clock that advances 2 units at each reading while the round's width is off, 1 while it
    speculates: a round (two readings) lasts what its width costs."""

    def __init__(self, counters: SpecCounters) -> None:
        self.counters = counters
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0 if self.counters.width > 1 else 2.0
        return self.now


def test_the_online_policy_speculates_while_admissions_wait_for_memory_it_holds_none_of() -> None:
    """A pool that holds two of four requests: the others wait for memory (slots are free),
    and the scheduler counts them for the width policy; the engine reserves the drafter's
    ring and staging for every slot at start, so speculating holds no memory that turning it
    off would free, and the policy goes on speculating. The rounds' times come from a clock
    where a speculative round costs half a plain one (the random drafter's proposals are never
    accepted): speculation pays, whatever the host's timing noise, and the choice rests on
    memory alone."""
    cfg = EngineConfig(
        model="tiny-glm", mode="resident", kv_pool_mib=2, max_num_seqs=4, max_model_len=512,
        max_prefill_tokens=512, speculation=SpeculationConfig("dflash", 4, "online"),
    )  # fmt: skip
    eng = Engine(cfg)
    eng.speculator.clock = RoundClock(eng.speculator.counters)
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"r{i}", torch.randint(0, 256, (300,), generator=g).tolist(), params)
    waiting, free = [], []
    while eng.scheduler.has_work():
        steps = eng.stats.decode_steps
        eng.step()
        if eng.stats.decode_steps > steps:
            w = eng.speculator.counters.width
            (waiting if eng.scheduler.waiting else free).append(w)
    assert len(waiting) > 10 and min(waiting[-5:]) > 1
    assert free and min(free[-5:]) > 1
    eng.close()
