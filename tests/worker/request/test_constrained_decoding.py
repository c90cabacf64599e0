"""Constrained decoding in the engine: JSON outputs parse and follow their schema, tool-call tags
give a call of a listed tool with valid arguments, a grammar that allows what the model writes
anyway changes nothing, and bad grammars are refused at admission."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from services.worker.durable.adoption import adopt_sessions
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.request.request import FinishReason, Grammar, Request, SamplingParams
from tests.worker.request.grammar_cases import (
    ANY_TEXT,
    JSON_OBJECT,
    JSON_SCHEMA,
    MINI,
    SCHEMA,
    TOOLS,
    accepts,
    tool_call_tag,
)


def engine(model: str = "tiny-glm") -> Engine:
    return Engine(EngineConfig(model=model, kv_pool_mib=8, max_num_seqs=4))


def prompts(n: int = 4, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(m),), generator=g).tolist() for m in (20, 57, 9, 33)[:n]]


def finished_in_grammar(eng: Engine, req: Request) -> str:
    """The text of a request the grammar ended: every token accepted, the last a stop token."""
    assert req.finish_reason is FinishReason.STOP, eng.tokenizer.decode(req.output_ids)
    m = accepts(eng.grammars.compile(req.params.grammar), req.output_ids)
    assert m is not None and m.is_terminated()
    assert req.output_ids[-1] in eng.eos_token_ids
    return eng.tokenizer.decode(req.output_ids)


@pytest.mark.parametrize("model", ["tiny-glm", "tiny-dsv4"])
@pytest.mark.parametrize("greedy", [True, False])
def test_json_outputs_parse_and_follow_the_schema(model: str, greedy: bool) -> None:
    """Every output is a prefix of the grammar's language and every ended one parses. A random
    model may write whitespace (JSON allows any between tokens) or a string's characters for
    long, so only the schema's sampled outputs (enums, booleans, small integers) must all
    end."""
    eng = engine(model)
    finished = 0
    for grammar in (JSON_OBJECT, JSON_SCHEMA):
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0, seed=5, max_tokens=192, grammar=grammar
        )
        must_end = grammar is JSON_SCHEMA and not greedy
        for req in eng.generate(prompts(), params):
            if req.finish_reason is FinishReason.LENGTH and not must_end:
                assert accepts(eng.grammars.compile(grammar), req.output_ids) is not None
                continue
            value = json.loads(finished_in_grammar(eng, req))
            assert isinstance(value, dict)
            if grammar is JSON_SCHEMA:
                jsonschema.validate(value, SCHEMA)
            finished += 1
    assert finished >= (1 if greedy else 5)


def test_a_complete_grammar_ends_a_request_that_ignores_eos() -> None:
    eng = engine()
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=192, ignore_eos=True, grammar=JSON_SCHEMA
    )
    for req in eng.generate(prompts(), params):
        jsonschema.validate(json.loads(finished_in_grammar(eng, req)), SCHEMA)


def test_a_token_the_grammar_rejects_fails_the_request() -> None:
    """Never sampled (its mask forbids it); emitted anyway, it ends the request with an
    internal error and is not appended."""
    eng = engine()
    req = eng.add_request("r", prompts(1)[0], SamplingParams(max_tokens=8, grammar=JSON_SCHEMA))
    eng.step()
    before = list(req.output_ids)
    out = eng.emit(req, [ord("x")], torch.zeros(1, eng.model_cfg.vocab_size))
    assert out.finish_reason is FinishReason.ABORT and out.new_token_ids == ()
    assert out.error is not None and out.error.code == "internal"
    assert req.output_ids == before and not eng.has_work()


def test_a_resumed_session_keeps_its_grammar() -> None:
    """A durable session under a grammar, resumed by a successor engine midway (its matcher
    rebuilt past the tokens already emitted): the uninterrupted run's tokens."""
    store = LocalHostStore(64 << 20)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=192, grammar=JSON_SCHEMA)

    def make(owner: str) -> Engine:
        cfg = EngineConfig(
            model="tiny-glm", mode="hisparse", kv_pool_mib=48, max_num_seqs=4,
            max_model_len=512, owner=owner,
        )  # fmt: skip
        eng = Engine(cfg, host=(store, store.mapping))
        HostLink(store, owner, 30.0, eng.kv.host_backups).register()
        return eng

    want = make("ref").generate(prompts(1), params)[0]
    first = make("w0")
    first.add_request("r0", prompts(1)[0], params)
    for _ in range(12):
        first.step()
    del first  # dies: the arena and the store outlive it
    second = make("w0")
    report = adopt_sessions(second, store, "w0", second.kv.host_backups.generation)
    assert report.resumed == ["r0"]
    req = second.requests["r0"]
    assert 0 < len(req.output_ids) < len(want.output_ids)
    while second.has_work():
        second.step()
    assert req.output_ids == want.output_ids
    jsonschema.validate(json.loads(finished_in_grammar(second, req)), SCHEMA)
    store.close()


def test_a_grammar_that_allows_the_greedy_tokens_changes_nothing() -> None:
    """The shipped model writes Python: any text allows every token it picks, so its greedy
    output is the unconstrained one, token for token (EOS included)."""
    eng = engine(str(MINI))
    tok = eng.tokenizer
    ps = [tok.encode_prompt(p) for p in ("def fibonacci(n):", "import os\n\n\ndef main():")]
    free = eng.generate(ps, SamplingParams(temperature=0.0, max_tokens=40))
    held = eng.generate(ps, SamplingParams(temperature=0.0, max_tokens=40, grammar=ANY_TEXT))
    for f, h in zip(free, held, strict=True):
        assert h.output_ids == f.output_ids
        assert h.finish_reason is f.finish_reason
        assert accepts(eng.grammars.compile(ANY_TEXT), h.output_ids) is not None


def _check_arguments(name: str, args: dict) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert name in schemas
    jsonschema.validate(args, schemas[name])


def _dsml_calls(text: str, block: str) -> list[tuple[str, dict]]:
    """DeepSeek-V3.2 (``block`` function_calls) or DeepSeek-V4 (tool_calls) calls:
    ``\\n\\n<｜DSML｜BLOCK>\\n<｜DSML｜invoke name="f">`` then
    ``<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>`` (a string's value
    as written, any other's as JSON) and the closing tags; whitespace between the tags as the
    grammar allows it (``parsing_dsv32`` expects exactly one newline)."""
    assert text.startswith(f"\n\n<｜DSML｜{block}>\n")
    assert text.endswith(f"</｜DSML｜{block}>")
    calls = []
    for name, body in re.findall(
        r'<｜DSML｜invoke name="(.*?)">(.*?)</｜DSML｜invoke>', text, re.S
    ):
        args = {}
        for key, is_string, value in re.findall(
            r'<｜DSML｜parameter name="(.*?)" string="(true|false)">(.*?)</｜DSML｜parameter>',
            body, re.S,
        ):  # fmt: skip
            args[key] = value if is_string == "true" else json.loads(value)
        calls.append((name, args))
    return calls


def _glm_calls(text: str) -> list[tuple[str, dict]]:
    """GLM-4.7/GLM-5 calls: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...
    </tool_call>``; a value is JSON unless it does not parse (a string)."""
    calls = []
    for name, body in re.findall(r"<tool_call>(.*?)((?:<arg_key>.*?)?)</tool_call>", text, re.S):
        args = {}
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.S)
        for key, value in pairs:
            try:
                args[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                args[key.strip()] = value.strip()
        calls.append((name.strip(), args))
    return calls


DSML_BLOCKS = {"deepseek_v3_2": "function_calls", "deepseek_v4": "tool_calls"}


@pytest.mark.parametrize("model", [*DSML_BLOCKS, "glm_4_7"])
def test_tool_call_tags_give_a_call_of_a_listed_tool(model: str) -> None:
    eng = engine()
    grammar = tool_call_tag(model)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=7, max_tokens=400, grammar=grammar)
        for req in eng.generate(prompts(), params):
            text = finished_in_grammar(eng, req)
            block = DSML_BLOCKS.get(model)
            calls = _dsml_calls(text, block) if block else _glm_calls(text)
            assert len(calls) == 1
            _check_arguments(*calls[0])


BAD = [
    Grammar("json_schema", '{"type": "nope"}'),
    Grammar("json_schema", "{"),
    Grammar("structural_tag", '{"type": "structural_tag", "format": {"type": "zzz"}}'),
    Grammar("yaml", ""),
]


@pytest.mark.parametrize("grammar", BAD)
def test_bad_grammars_are_refused_at_admission(grammar: Grammar) -> None:
    eng = engine()
    with pytest.raises(ValueError):
        eng.validate_request([1, 2, 3], SamplingParams(grammar=grammar))
    with pytest.raises(ValueError):
        eng.add_request("bad", [1, 2, 3], SamplingParams(grammar=grammar))
    assert not eng.has_work()
