"""Prompt logprobs in the engine: every prompt token's log-probability given the tokens before
it, and its top-n alternatives, equal those of one whole forward of the model over the prompt
(``log_softmax`` of its logits), whatever the chunks its prefill ran in and whoever ran beside
it; they come once, on the request's first output, also when a preempted prefill recomputes;
``max_tokens`` 0 ends a request after its prefill with no token; a durable session resumed
part-way through its prefill (the prefix was scored by a worker that died) sends none."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.presets import preset_topology
from services.worker.durable.adoption import adopt_sessions
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.config import KVCacheConfig, bytes_per_token
from services.worker.model.decoder import SparseDecoder
from services.worker.request.prompt_logprobs import score
from services.worker.request.request import FinishReason, RequestOutput, SamplingParams
from services.worker.serving.cache import KVCache
from tests.worker.helpers import run_chunks

TOP = 5


def config(model: str, budget: int | None, mode: str = "resident", **kw) -> EngineConfig:
    """``budget``: prefill tokens per step (chunked); None: each prompt whole."""
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("kv_pool_mib", 24)
    return EngineConfig(
        model=model, mode=mode, host_arena_mib=32, max_model_len=512,
        max_prefill_tokens=budget or 512, chunked_prefill=budget is not None, **kw,
    )  # fmt: skip


def prompts(*lens: int, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def reference(model: SparseDecoder, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] log-probabilities of the tokens after each prompt position, from
    one whole forward over the prompt in a cache of its own."""
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=1, max_model_len=512))
    hidden = run_chunks(model, kv, torch.tensor(prompt), [len(prompt)])
    kv.close()
    return torch.log_softmax(model.logits(hidden[:-1]), dim=-1)


def run(engine: Engine, asks: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Every output of each request, by id, the requests added at once."""
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in asks}
    for rid, (p, sp) in asks.items():
        engine.add_request(rid, p, sp)
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def check(prompt: list[int], got: tuple, want: torch.Tensor, top: int) -> None:
    """``got`` (an output's prompt logprobs) against the reference ``want``."""
    assert len(got) == len(prompt)
    assert got[0].token_id == prompt[0] and got[0].logprob == 0.0 and got[0].top == ()
    values = torch.tensor([lp.logprob for lp in got[1:]])
    expect = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert [lp.token_id for lp in got[1:]] == prompt[1:]
    torch.testing.assert_close(values, expect, atol=1e-4, rtol=0)
    v, i = torch.topk(want, top, dim=-1) if top else (None, None)
    for j, lp in enumerate(got[1:]):
        assert len(lp.top) == top
        if top:
            assert [t for t, _ in lp.top] == i[j].tolist()
            torch.testing.assert_close(
                torch.tensor([x for _, x in lp.top]), v[j], atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("budget", [None, 7, 16, 64])
@pytest.mark.parametrize("model", ["tiny-glm", "tiny-dsv4"])
def test_prompt_logprobs_equal_one_whole_forward_over_the_prompt(model: str, budget) -> None:
    """Three requests in one batch: two ask (top 5, top 0) with other prompts prefilled beside
    them, one does not ask and gets none; each is sent once, on the first output."""
    engine = Engine(config(model, budget))
    ps = prompts(130, 41, 77)
    asks = {
        "top": (ps[0], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP)),
        "plain": (ps[1], SamplingParams(temperature=0.0, max_tokens=3)),
        "bare": (ps[2], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)),
    }
    outs = run(engine, asks)
    assert all(not o.prompt_logprobs for o in outs["plain"])
    for rid, top in (("top", TOP), ("bare", 0)):
        prompt = asks[rid][0]
        assert outs[rid][0].new_token_ids and all(not o.prompt_logprobs for o in outs[rid][1:])
        check(prompt, outs[rid][0].prompt_logprobs, reference(engine.model, prompt), top)
    engine.close()


def test_scoring_in_slices_equals_scoring_whole() -> None:
    """The slices bound memory and change nothing: the same scores, exactly."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(23, 300, generator=g)
    targets = torch.randint(0, 300, (23,), generator=g).tolist()
    whole = score(logits, targets, 4, lambda x: x, slice_rows=1024)
    assert score(logits, targets, 4, lambda x: x, slice_rows=5) == whole
    lp = torch.log_softmax(logits, dim=-1)
    assert [t.logprob for t in whole] == lp[torch.arange(23), targets].tolist()


def test_max_tokens_zero_ends_after_the_prefill_with_no_token() -> None:
    engine = Engine(config("tiny-glm", 16))
    p = prompts(50)[0]
    before = engine.kv.memory()
    outs = run(engine, {"r": (p, SamplingParams(max_tokens=0, prompt_logprobs=2))})["r"]
    assert len(outs) == 1
    (out,) = outs
    assert out.finish_reason is FinishReason.LENGTH
    assert out.new_token_ids == () and out.text == "" and out.completion_tokens == 0
    check(p, out.prompt_logprobs, reference(engine.model, p), 2)
    after = engine.kv.memory()  # its pages free, or kept as a cached prefix (optional)
    assert not engine.has_work() and after.required == before.required
    assert after.free + after.optional == before.free
    assert len(engine.scheduler.free_slots) == 4


def test_max_tokens_zero_needs_prompt_logprobs_and_their_range_is_checked() -> None:
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate(256)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0).validate(256)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate(256)


def test_a_preempted_partial_prefill_sends_its_prompt_logprobs_once() -> None:
    """As ``test_chunked_prefill``'s preemption case: r0's decode preempts r1 part-way through
    its prefill; r1 recomputes from its first token, and scores nothing twice."""
    ps = prompts(20, 150)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=3),
    ]
    per_token = bytes_per_token(preset_topology("tiny-glm"), 4, payload=True)
    pool = 10 * 16 * per_token / 2**20
    engine = Engine(config("tiny-glm", 8, kv_pool_mib=pool, page_size=16, max_num_seqs=2))
    preempted: list[int] = []  # r1's scored positions when it was preempted
    preempt = engine.scheduler._preempt

    def recorded(victim, out):
        if victim.request_id == "r1":
            preempted.append(len(victim.prompt_scored))
        preempt(victim, out)

    engine.scheduler._preempt = recorded  # type: ignore[method-assign]
    outs = run(engine, {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(ps, params, strict=True))})
    assert preempted and 0 < preempted[0] < 149, preempted
    sent = [o for o in outs["r1"] if o.prompt_logprobs]
    assert len(sent) == 1 and sent[0] is outs["r1"][0]
    check(ps[1], sent[0].prompt_logprobs, reference(engine.model, ps[1]), 3)


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


def test_a_session_resumed_part_way_through_its_prefill_sends_none(store) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    p = prompts(150)[0]

    def make(owner: str) -> Engine:
        engine = Engine(
            config("tiny-glm", 16, "hisparse", owner=owner), host=(store, store.mapping)
        )
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        return engine

    first = make("w0")
    first.add_request("r0", p, params)
    for _ in range(5):
        first.step()
    assert first.requests["r0"].num_computed == 80 and not first.requests["r0"].output_ids
    del first  # dies: no release, no flush
    second = make("w0")
    report = adopt_sessions(second, store, "w0", second.kv.host_backups.generation)
    assert report.resumed == ["r0"]
    r0 = second.requests["r0"]
    outs: list[RequestOutput] = []
    while second.has_work():
        outs.extend(second.step())
    assert len(r0.output_ids) == 4 and not r0.prompt_scored
    assert all(not o.prompt_logprobs for o in outs)
