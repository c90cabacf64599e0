"""The OpenAI API agents use, end to end with the official ``openai`` client against
``dhisparse up`` (real processes), for every family: the shipped model (GLM-5's family, its MTP
layer drafting), a tiny random GLM-5 checkpoint with GLM-4.7's released template, and a tiny
random DeepSeek-V3.2 checkpoint (DSML, the format's own encoder). Random weights do not know
how to call a tool: constrained decoding guarantees the calls parse and their arguments are
valid against each function's schema whatever the model's quality."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests import hf_tiny, hf_tiny_v4
from tests.e2e.test_durability import up_stack
from tests.tokenizer.helpers import (
    DSV4_SPECIALS,
    DSV32_SPECIALS,
    GLM_SPECIALS,
    dsv32_tokenizer_config,
    glm_tokenizer_config,
    write_model_dir,
)

GLM47_TEMPLATE = (Path(__file__).parents[1] / "tokenizer" / "glm47_chat_template.jinja").read_text(
    encoding="utf-8"
)
# Schemas whose every value is bounded, so that even a random model's constrained reply ends.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
MAX_TOKENS = 320
# GLM-4.7's template thinks by default, and a random model's reasoning need never end: these
# tests ask the tiny GLM-5 to answer at once (the reasoning test turns thinking on).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _glm_dir(path: Path) -> Path:
    ref = hf_tiny.build(hf_tiny.glm_config(vocab_size=448, eos_token_id=[0, 1, 2]), seed=5)
    hf_tiny.save_hub_style(ref, path)
    return write_model_dir(
        path, GLM_SPECIALS, glm_tokenizer_config(), chat_template_file=GLM47_TEMPLATE,
        generation_config={"eos_token_id": [0, 1, 2]},
    )  # fmt: skip


def _v32_dir(path: Path) -> Path:
    ref = hf_tiny.build(hf_tiny.v32_config(vocab_size=448, eos_token_id=1), seed=6)
    hf_tiny.save_hub_style(ref, path)
    return write_model_dir(path, DSV32_SPECIALS, dsv32_tokenizer_config())


def _v4_dir(path: Path) -> Path:
    ref = hf_tiny_v4.build(hf_tiny_v4.v4_config(vocab_size=448, eos_token_id=1), seed=7)
    hf_tiny_v4.save_hub_style(ref, path)
    return write_model_dir(path, DSV4_SPECIALS, dsv32_tokenizer_config())


MAKE_DIR = {"glm5-tiny": _glm_dir, "v32-tiny": _v32_dir, "v4-tiny": _v4_dir}


@pytest.fixture(scope="module", params=["shipped", *MAKE_DIR])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def client(family: str, tmp_path_factory) -> Iterator[OpenAI]:
    flags: tuple[str, ...] = ("--kv-pool-mib", "512", "--max-model-len", "2048", "--no-restart")
    if family != "shipped":  # the shipped model drafts with its MTP layer (the default)
        model = MAKE_DIR[family](tmp_path_factory.mktemp(family))
        flags += ("--model", str(model), "--drafter", "none")
    with up_stack(tmp_path_factory.mktemp("agents") / "up.log", *flags) as st:
        yield OpenAI(base_url=f"{st.base}/v1", api_key="unused", max_retries=0)


def model_of(client: OpenAI) -> str:
    return client.models.list().data[0].id


def create(client: OpenAI, **kw: object):
    """A chat completion of the served model, thinking off."""
    return client.chat.completions.create(model=model_of(client), extra_body=NO_THINKING, **kw)


def valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        assert c.id.startswith("call_") and c.type == "function"
        out.append((c.function.name, args))
    return out


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments text) per call index, and the finish reason, from a stream."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                slot = calls.setdefault(tc.index, ["", ""])
                if tc.function and tc.function.name:
                    slot[0] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot[1] += tc.function.arguments
            finish = choice.finish_reason or finish
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_forced_calls_are_valid_and_stream_as_they_answer(client: OpenAI, choice) -> None:
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    (c,) = create(client, **kw).choices
    calls = valid_calls(c.message.tool_calls or ())
    assert len(calls) == 1, c.message
    if isinstance(choice, dict):
        assert calls[0][0] == "get_weather"
    assert c.finish_reason == "tool_calls"
    streamed, finish = streamed_calls(create(client, **kw, stream=True))
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    assert finish == "tool_calls"


def test_sampled_and_parallel_calls_are_valid(client: OpenAI) -> None:
    """Sampled, and with parallel calls allowed: every call that ended is valid (a random
    model may go on calling until max_tokens cuts its last call short)."""
    r = create(
        client, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=1.0, seed=7, n=2,
    )  # fmt: skip
    for c in r.choices:
        calls = c.message.tool_calls or []
        assert calls, c.message
        assert c.finish_reason in ("tool_calls", "length")
        valid_calls(calls if c.finish_reason == "tool_calls" else calls[:-1])


def test_json_schema_replies_are_valid(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    for temperature in (0, 1.0):
        r = create(
            client, messages=MESSAGES, response_format=fmt, max_tokens=MAX_TOKENS,
            temperature=temperature, seed=3,
        )  # fmt: skip
        (c,) = r.choices
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), WEATHER)


def test_json_object_replies_parse(client: OpenAI) -> None:
    r = create(
        client, messages=MESSAGES, response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS, temperature=0, logit_bias={"0": -100},
    )  # fmt: skip
    (c,) = r.choices
    if c.finish_reason == "stop":  # an object a random model may not close in time
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")


def test_a_history_with_calls_and_results_is_served(client: OpenAI) -> None:
    first = create(
        client, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0,
    ).choices[0].message  # fmt: skip
    assert first.tool_calls, first
    calls = [c.model_dump() for c in first.tool_calls or ()]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": first.content, "tool_calls": calls},
        *[{"role": "tool", "tool_call_id": c["id"], "content": '{"ok": true}'} for c in calls],
    ]
    r = create(client, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(BadRequestError, match="call_nope"):
        client.chat.completions.create(
            model=model_of(client), max_tokens=8,
            messages=[*MESSAGES, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}],
        )  # fmt: skip


def test_bad_tool_requests_are_400s(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="nope"):
        client.chat.completions.create(
            model=model_of(client), messages=MESSAGES, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nonsense"}}}
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=model_of(client), messages=MESSAGES, response_format=bad, max_tokens=8
        )


def test_reasoning_is_apart_from_content(family: str, client: OpenAI) -> None:
    """With thinking on the reply starts in reasoning: cut short, all of it is reasoning,
    under both names, and usage counts its tokens."""
    kwargs = {"thinking": True} if family in ("v32-tiny", "v4-tiny") else {"enable_thinking": True}
    r = client.chat.completions.create(
        model=model_of(client), messages=MESSAGES, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": kwargs, "ignore_eos": True},
    )  # fmt: skip
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] == msg["reasoning"] and msg["reasoning_content"]
    assert not msg["content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 6
