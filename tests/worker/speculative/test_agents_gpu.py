"""Constrained decoding and the sampling parameters users send, on the GPU (CUDA graphs where the
engine replays them: ``graphs_off_reason`` says where not, printed) and with the shipped model's
MTP layer drafting: the masks and penalties reach the logits on the device
(pinned host masks copied without blocking), speculative greedy output equals plain greedy
output under the same grammar and penalties, and every output follows its grammar (a JSON
schema, a required DSML / GLM tool call)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dhisparse.tokenizer import load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import FinishReason, SamplingParams
from services.worker.speculative.config import SpeculationConfig
from tests.worker.request.grammar_cases import JSON_SCHEMA, MINI, SCHEMA, tool_call_tag

pytestmark = pytest.mark.gpu

PROMPTS = ["Give me a record as JSON:", "import json\n\n\ndef load(path):", "{", "name ="]


def _engine(drafter: str | None) -> Engine:
    spec = SpeculationConfig(drafter, 4, "fixed") if drafter else SpeculationConfig()
    return Engine(
        EngineConfig(
            model=str(MINI), device="cuda", kv_pool_mib=256, max_num_seqs=8, max_model_len=1024,
            speculation=spec,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tok = load_tokenizer(MINI)
    return [tok.encode(p) for p in PROMPTS]


CASES = {
    "json_schema": SamplingParams(temperature=0.0, max_tokens=96, grammar=JSON_SCHEMA),
    "penalties": SamplingParams(
        temperature=0.0, max_tokens=48, ignore_eos=True, presence_penalty=0.8,
        frequency_penalty=0.4, repetition_penalty=1.3, logit_bias=((10, 4.0), (11, -50.0)),
    ),
    "glm_call": SamplingParams(temperature=0.0, max_tokens=160, grammar=tool_call_tag("glm_4_7")),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_speculative_greedy_equals_plain_greedy_on_graphs(prompts, case: str) -> None:
    params = CASES[case]
    outs = {}
    for drafter in (None, "mtp"):
        eng = _engine(drafter)
        outs[drafter] = [(r.output_ids, r.finish_reason) for r in eng.generate(prompts, params)]
        print(f"drafter {drafter}: graphs off because {eng.graphs_off_reason}")
        if drafter:
            assert eng.speculator is not None and eng.speculator.counters.drafts > 0
        eng.close()
    assert outs["mtp"] == outs[None]
    tok = load_tokenizer(MINI)
    for ids, finish in outs[None]:
        text = tok.decode(ids)
        if case == "json_schema" and finish == FinishReason.STOP:
            jsonschema.validate(json.loads(text), SCHEMA)
        if case == "glm_call" and finish == FinishReason.STOP:
            assert text.lstrip().startswith("<tool_call>") and "</tool_call>" in text
        if case == "penalties":
            assert 11 not in ids
