"""Speculative decoding of requests with penalties, logit biases and min_tokens in the engine:
greedy output equals plain greedy decoding's, both with the untrained drafter (most proposals
rejected) and with an oracle that proposes plain greedy's continuation (long accepted
prefixes, so the penalties of row j must count the proposals before it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.speculative.proposal import Proposal
from tests.worker.speculative.test_speculative_engine import config, prompts

BASE = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHAPED = {
    "repetition": replace(BASE, repetition_penalty=1.6),
    "frequency+presence": replace(BASE, frequency_penalty=0.9, presence_penalty=0.6),
    "all": replace(
        BASE,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=-0.2,
        logit_bias=((10, 3.0), (32, -100.0), (101, 1.5)),
        min_tokens=6,
        stop_token_ids=(44,),
    ),
}


def plain(params: SamplingParams) -> list[list[int]]:
    eng = Engine(config("tiny-glm", "resident"))
    out = [r.output_ids for r in eng.generate(prompts(), params)]
    eng.close()
    return out


def with_oracle(eng: Engine, truth: list[list[int]], error: float) -> Engine:
    """The engine's drafter, its proposals replaced by the true continuation (each wrong with
    probability ``error``) where it is known."""
    assert eng.speculator is not None
    drafter = eng.speculator.drafter
    propose = drafter.propose
    sequences = {tuple(p): [*p, *t] for p, t in zip(prompts(), truth, strict=True)}
    rng = torch.Generator().manual_seed(0)

    def oracle(slots, anchors, num_committed, widths=None, *args, **kwargs) -> Proposal:
        prop = propose(slots, anchors, num_committed, widths, *args, **kwargs)
        tokens = prop.tokens.clone()
        by_slot = {r.slot: r for r in eng.scheduler.running}
        for r, (slot, n) in enumerate(zip(slots, num_committed, strict=True)):
            seq = sequences[tuple(by_slot[slot].prompt_ids)]
            for j in range(prop.widths[r] - 1):
                if n + 1 + j < len(seq):
                    wrong = float(torch.rand((), generator=rng)) < error
                    tokens[r, j] = (seq[n + 1 + j] + 1) % 256 if wrong else seq[n + 1 + j]
        return replace(prop, tokens=tokens)

    drafter.propose = oracle  # type: ignore[method-assign]
    return eng


@pytest.mark.parametrize("name", list(SHAPED))
def test_speculative_greedy_with_penalties_equals_plain_greedy(name: str) -> None:
    params = SHAPED[name]
    want = plain(params)
    assert want != plain(BASE), "the penalties change greedy output"
    for oracle in (False, True):
        eng = Engine(config("tiny-glm", "resident", drafter="dflash", spec_width=5))
        if oracle:
            with_oracle(eng, want, error=0.15)
        got = [r.output_ids for r in eng.generate(prompts(), params)]
        assert got == want, f"oracle={oracle}"
        c = eng.speculator.counters
        if oracle:  # some rounds accepted all four proposals
            assert c.per_position[3] > 0 and c.accepted > c.drafts
        eng.close()
    if params.min_tokens:
        assert all(44 not in out[: params.min_tokens] for out in want)
    for t, bias in params.logit_bias:
        if bias == -100.0:
            assert all(t not in out for out in want)
