"""Speculation under a grammar: a draft the grammar forbids is rejected by verification (its
target probability is 0 once masked), and speculative greedy output equals plain greedy output
under the same grammar, for a block drafter and for the shipped model's MTP layer."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.grammar_masks import Block
from services.worker.request.request import FinishReason, Grammar, SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.verify import verify_batch
from tests.worker.request.grammar_cases import (
    JSON_OBJECT,
    JSON_SCHEMA,
    MINI,
    MINI_EOS,
    MINI_VOCAB,
    SCHEMA,
    accepts,
    allowed,
    compiler,
    random_walk,
    reference_mask,
    shared_masks,
    tool_call_tag,
)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_draft_the_grammar_forbids_is_rejected(greedy: bool) -> None:
    """Drafts [ok, forbidden, ok] that the target would accept unmasked (each is its row's
    argmax, and the drafter was sure of it): verification accepts the first, rejects the
    forbidden one, and corrects with a token the grammar allows there."""
    c = compiler("mini")
    compiled = c.compile(JSON_SCHEMA)
    walk = random_walk(compiled, 12, MINI_VOCAB, MINI_EOS, seed=2)
    out, rest = walk[:4], walk[4:]
    ok_there = allowed(reference_mask(compiled, out + rest[:1], MINI_VOCAB), MINI_VOCAB)
    forbidden = int((~ok_there).nonzero()[7, 0])
    drafts = [rest[0], forbidden, rest[1]]
    params = SamplingParams(temperature=0.0 if greedy else 1.0)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(4, MINI_VOCAB, generator=g)
        for i, t in enumerate(drafts):
            logits[i, t] = 30.0
        draft_probs = torch.zeros(1, 3, MINI_VOCAB)
        draft_probs[0, torch.arange(3), torch.tensor(drafts)] = 1.0
        masks = shared_masks(MINI_VOCAB)
        masks.fill([Block(c.state(JSON_SCHEMA, out), 0, 4, drafts)])
        masks.apply(logits)
        (v,) = verify_batch(
            logits, [4], torch.tensor([drafts]), draft_probs, [params], [g], drafts=[drafts]
        )
        assert v.num_accepted == 1
        assert v.next_token != forbidden and ok_there[v.next_token]
        if greedy:
            break


def config(model: str, drafter: str | None, width: int = 4) -> EngineConfig:
    return EngineConfig(
        model=model, mode="resident", kv_pool_mib=48, max_num_seqs=4, max_model_len=1024,
        speculation=SpeculationConfig(drafter, width, "fixed"),
    )  # fmt: skip


def prompts(n: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in (130, 45, 210, 77)[:n]]


@pytest.mark.parametrize("grammar", ["json_object", "json_schema", "glm_4_7"])
def test_speculative_greedy_equals_plain_greedy_under_a_grammar(grammar: str) -> None:
    g: Grammar = {
        "json_object": JSON_OBJECT, "json_schema": JSON_SCHEMA,
        "glm_4_7": tool_call_tag("glm_4_7"),
    }[grammar]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48, grammar=g)
    plain = [r.output_ids for r in Engine(config("tiny-glm", None)).generate(prompts(4), params)]
    eng = Engine(config("tiny-glm", "dflash"))
    reqs = eng.generate(prompts(4), params)
    assert [r.output_ids for r in reqs] == plain
    c = eng.speculator.counters
    assert c.drafts > 0 and c.draft_tokens > 0
    eng.close()


@pytest.mark.parametrize("grammar", ["json_schema", "glm_4_7"])
def test_mtp_speculation_under_a_grammar_equals_plain_decoding(grammar: str) -> None:
    """The shipped model's MTP layer drafts tokens the grammar may forbid; outputs stay those
    of plain decoding under the grammar, and each ends in the grammar."""
    g = JSON_SCHEMA if grammar == "json_schema" else tool_call_tag("glm_4_7")
    params = SamplingParams(temperature=0.0, max_tokens=128, grammar=g)
    plain_eng = Engine(config(str(MINI), None))
    ps = [plain_eng.tokenizer.encode_prompt(p) for p in ("def add(a, b):", "# weather\n")]
    plain = plain_eng.generate(ps, params)
    eng = Engine(config(str(MINI), "mtp"))
    reqs = eng.generate(ps, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert all(r.finish_reason is FinishReason.STOP for r in reqs)
    assert eng.speculator.counters.draft_tokens > 0
    eng.close()


def test_speculative_sampling_under_a_grammar_stays_in_it() -> None:
    """Sampled speculation (drafts accepted with probability min(1, p/q) under the masked p):
    every output is in the grammar's language, and the schema's end."""
    eng = Engine(config("tiny-glm", "dflash"))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=192, grammar=JSON_SCHEMA)
    for req in eng.generate(prompts(4), params):
        assert req.finish_reason is FinishReason.STOP
        m = accepts(eng.grammars.compile(JSON_SCHEMA), req.output_ids)
        assert m is not None and m.is_terminated()
        jsonschema.validate(json.loads(eng.tokenizer.decode(req.output_ids)), SCHEMA)
    assert eng.speculator.counters.accepted > 0
    eng.close()
