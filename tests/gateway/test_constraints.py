"""The reply's grammar (``constraints``, then the worker's ``grammar_specs`` that builds and
compiles it) against the real formats: what each family's own chat format renders for an
assistant turn with tool calls (GLM-4.7's template on the shipped model, DeepSeek-V3.2's,
DeepSeek-V4's and DeepSeek-V4.1's encoders) must be a reply the grammar built from the prompt accepts, as xgrammar matches it; what breaks the choice (another tool, a second call without parallel calls, text
where a call is required, JSON off the schema) must not be. Whether reasoning is open follows
the rendered prompts of every family."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
from xgrammar.testing import _is_grammar_accept_string

from dhisparse.paths import ROOT
from dhisparse.tokenizer import (
    ByteTokenizer,
    ChatFormatter,
    DeepseekV4Formatter,
    DeepseekV32Formatter,
    DeepseekV41Formatter,
    chat_formatter,
    load_tokenizer,
)
from dhisparse.tokenizer.reply import parse_reply
from dhisparse.tokenizer.reply import reply_style as tool_style
from services.gateway.constraints import Style, grammar_for, reasoning_open
from services.gateway.errors import APIError
from services.gateway.generation import GrammarSpec
from services.gateway.preprocess import chat_prompt
from services.gateway.protocol import ChatCompletionRequest
from services.worker.request.grammar_specs import grammar_of
from services.worker.request.request import Grammar

SHIPPED = ROOT / "models" / "glm-dsa-mini"
GLM = chat_formatter(load_tokenizer(SHIPPED), SHIPPED)
DSV32 = DeepseekV32Formatter(ByteTokenizer())
DSV4 = DeepseekV4Formatter(ByteTokenizer())
DSV41 = DeepseekV41Formatter(ByteTokenizer())
FAMILIES: list[tuple[Style, ChatFormatter, str]] = [
    ("glm_4_7", GLM, "enable_thinking"),
    ("deepseek_v3_2", DSV32, "thinking"),
    ("deepseek_v4", DSV4, "thinking"),
    ("deepseek_v4_1", DSV41, "thinking"),
]
USER = {"role": "user", "content": "Weather in Paris and Oslo?"}


def _tool(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER = _tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
CLOCK = _tool("get_time", {"zone": {"type": "string"}}, ["zone"])
TOOLS = [WEATHER, CLOCK]


def _call(i: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"c{i}", "function": {"name": name, "arguments": json.dumps(arguments)}}


PARIS = _call(1, "get_weather", {"city": "Paris", "days": 2})
OSLO = _call(2, "get_weather", {"city": "Oslo"})
ZONE = _call(3, "get_time", {"zone": "UTC"})


def req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **kw})


def _accepts(spec: GrammarSpec, reply: str) -> bool:
    """Whether the grammar the worker builds of ``spec`` accepts ``reply``."""
    grammar = grammar_of(Grammar(spec.kind, spec.spec, spec.reasoning_open))
    return _is_grammar_accept_string(grammar, reply)


def _reply(
    fmt: ChatFormatter, flag: str, thinking: bool, calls: list[dict[str, Any]], text: str = ""
) -> tuple[str, str]:
    """The generation prompt, and the reply the family's own format renders for an assistant
    turn of ``text`` and ``calls`` (reasoning "R" when thinking): the history's text past the
    prompt, its end-of-turn token left out."""
    turn: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": calls or None}
    if thinking:
        turn["reasoning_content"] = "R"
    kwargs = {flag: thinking}
    prompt = chat_prompt(fmt, req(tools=TOOLS, chat_template_kwargs=kwargs)).text
    history = req(messages=[USER, turn], tools=TOOLS, chat_template_kwargs=kwargs)
    done = chat_prompt(fmt, history.model_copy(update={"add_generation_prompt": False})).text
    assert done.startswith(prompt)
    return prompt, done.removeprefix(prompt).removesuffix("<｜end▁of▁sentence｜>")


def test_styles_of_the_families() -> None:
    assert tool_style("glm_moe_dsa") == "glm_4_7"
    assert tool_style("deepseek_v32") == "deepseek_v3_2"
    assert tool_style("deepseek_v4") == "deepseek_v4"
    assert tool_style("deepseek_v41") == "deepseek_v4_1"
    assert tool_style("llama") is None and tool_style(None) is None


@pytest.mark.parametrize(("style", "fmt", "flag"), FAMILIES)
def test_reasoning_is_open_where_the_prompt_opens_it(
    style: Style, fmt: ChatFormatter, flag: str
) -> None:
    for thinking in (True, False):
        prompt = chat_prompt(fmt, req(chat_template_kwargs={flag: thinking})).text
        assert reasoning_open(prompt, style) is thinking
        assert not reasoning_open(prompt, None)
    after_results = [
        USER,
        {"role": "assistant", "content": "", "reasoning_content": "R", "tool_calls": [PARIS]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = chat_prompt(fmt, req(messages=after_results, chat_template_kwargs={flag: True}))
    assert reasoning_open(prompt.text, style)


@pytest.mark.parametrize(("style", "fmt", "flag"), FAMILIES)
@pytest.mark.parametrize("thinking", [True, False])
def test_the_formats_own_tool_calls_are_what_the_grammar_accepts(
    style: Style, fmt: ChatFormatter, flag: str, thinking: bool
) -> None:
    prompt, both = _reply(fmt, flag, thinking, [PARIS, OSLO])
    _, one = _reply(fmt, flag, thinking, [PARIS])
    _, other = _reply(fmt, flag, thinking, [ZONE])
    _, prose = _reply(fmt, flag, thinking, [], "It is sunny.")
    named = {"type": "function", "function": {"name": "get_weather"}}

    def grammar(**kw: Any) -> GrammarSpec:
        spec = grammar_for(req(tools=TOOLS, **kw), prompt, style)
        assert spec is not None and spec.kind == "tool_calls"
        assert spec.reasoning_open is thinking
        return spec

    required, forced, auto = grammar(tool_choice="required"), grammar(tool_choice=named), grammar()
    single = grammar(tool_choice="required", parallel_tool_calls=False)
    assert _accepts(required, both) and _accepts(required, other)
    assert not _accepts(required, prose)
    assert _accepts(forced, one) and not _accepts(forced, other) and not _accepts(forced, both)
    assert _accepts(auto, prose) and _accepts(auto, both)
    assert _accepts(single, one) and not _accepts(single, both)
    bad = one.replace(">2<", ">two<")
    assert bad != one and not _accepts(required, bad)  # days is an integer
    assert grammar_for(req(tools=TOOLS, tool_choice="none"), prompt, style) is None


@pytest.mark.parametrize(("style", "fmt", "flag"), FAMILIES)
@pytest.mark.parametrize("thinking", [True, False])
def test_a_constrained_call_parses_to_arguments_of_the_schema(
    style: Style, fmt: ChatFormatter, flag: str, thinking: bool
) -> None:
    prompt, one = _reply(fmt, flag, thinking, [PARIS])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        spec = grammar_for(req(tools=TOOLS, tool_choice=choice), prompt, style)
        assert spec is not None and _accepts(spec, one)
    reply = parse_reply(style, one, reasoning_open=thinking, tools=TOOLS)
    [call] = reply.tool_calls
    assert call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert arguments == {"city": "Paris", "days": 2}
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.parametrize(("style", "fmt", "flag"), FAMILIES)
def test_json_formats_follow_the_open_reasoning(
    style: Style, fmt: ChatFormatter, flag: str
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_schema = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    closed = chat_prompt(fmt, req(chat_template_kwargs={flag: False})).text
    opened = chat_prompt(fmt, req(chat_template_kwargs={flag: True})).text
    plain = grammar_for(req(response_format=as_schema), closed, style)
    assert plain == GrammarSpec("json_schema", json.dumps(schema), False)
    assert _accepts(plain, '{"a": 1}') and not _accepts(plain, '{"a": "x"}')
    thought = grammar_for(req(response_format=as_schema), opened, style)
    assert thought == GrammarSpec("json_schema", json.dumps(schema), True)
    assert _accepts(thought, 'Think first.</think>{"a": 1}')
    assert not _accepts(thought, '{"a": 1}') and not _accepts(thought, 'x</think>{"a": "x"}')
    any_object = grammar_for(req(response_format={"type": "json_object"}), closed, style)
    assert any_object == GrammarSpec("json_object", "", False)
    assert _accepts(any_object, '{"b": [1, 2]}')
    nameless = {"type": "json_schema", "json_schema": {"name": "r"}}
    assert grammar_for(req(response_format=nameless), closed, style) == any_object
    assert grammar_for(req(response_format={"type": "text"}), opened, style) is None
    assert grammar_for(req(), opened, style) is None


def test_what_the_gateway_refuses_is_a_400_naming_the_param() -> None:
    def refused(r: ChatCompletionRequest, style: Style | None) -> tuple[str, str | None]:
        with pytest.raises(APIError) as e:
            grammar_for(r, "<|assistant|></think>", style)
        assert e.value.status == 400
        return e.value.message, e.value.param

    message, param = refused(req(tools=TOOLS), None)
    assert (message, param) == ("this model has no tool-call format", "tools")
    assert grammar_for(req(tools=TOOLS, tool_choice="none"), "x", None) is None
    both = req(tools=TOOLS, response_format={"type": "json_object"})
    assert refused(both, "glm_4_7")[1] == "response_format"
    forced = req(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert grammar_for(forced, "x", "glm_4_7") is not None  # the reply is the calls


def test_what_xgrammar_cannot_read_the_worker_refuses() -> None:
    """A schema or tool xgrammar cannot compile passes the gateway and is the worker's
    ValueError (its INVALID_ARGUMENT, the client's 400: test_http_errors)."""
    unknown = {"type": "object", "properties": {"a": {"type": "frob"}}}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "r", "schema": unknown}}
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": unknown}}
    for r in (req(response_format=bad_schema), req(tools=[bad_tool], tool_choice="required")):
        spec = grammar_for(r, "<|assistant|></think>", "glm_4_7")
        assert spec is not None
        with pytest.raises((ValueError, RuntimeError)):
            grammar_of(Grammar(spec.kind, spec.spec, spec.reasoning_open))


def test_the_gateway_imports_no_xgrammar() -> None:
    code = "import sys, services.gateway.app; print('xgrammar' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
