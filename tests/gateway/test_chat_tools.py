"""Agent requests on the request side: tools, tool_choice, response_format, assistant tool calls
with their results and reasoning, validated (OpenAI-style 400s naming the param) and converted
for the chat format; a history rendered through the gateway equals transformers' rendering of
the same chat for the shipped model (GLM-4.7's template), and DeepSeek-V3.2's format gets the
calls and results in its own places; penalties and logit bias reach the sampling."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerFast

from dhisparse.paths import ROOT
from dhisparse.tokenizer import ByteTokenizer, DeepseekV32Formatter, chat_formatter, load_tokenizer
from services.gateway.errors import APIError, validation_message
from services.gateway.preprocess import (
    Limits,
    chat_messages,
    chat_prompt,
    chat_sampling,
    completion_sampling,
    template_kwargs,
)
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest

SHIPPED = ROOT / "models" / "glm-dsa-mini"
USER = {"role": "user", "content": "Weather in Paris and 北京?"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def _call(call_id: str, arguments: Any, name: str = "get_weather") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLS = [_call("c1", '{"city": "Paris", "days": 2}'), _call("c2", '{"city": "北京"}')]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    USER,
    {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "晴"}]},
]


def req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **kw})


def refusal(**kw: Any) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        req(**kw)
    return validation_message(e.value.errors())


def test_agent_requests_are_accepted() -> None:
    r = req(
        messages=HISTORY,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {}}},
        reasoning_effort="high",
        presence_penalty=0.5,
        frequency_penalty=-2,
        repetition_penalty=1.3,
        min_p=0.05,
        logit_bias={"7": -100, "11": 2.5},
    )
    assert r.template_tools() == [WEATHER]
    assert req(tools=[WEATHER]).effective_tool_choice() == "auto"
    assert req().effective_tool_choice() == "none" and req().template_tools() is None
    assert not req(tools=[], tool_choice="auto").template_tools()


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "pattern"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "pattern"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "repeated: get_weather"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
            '"type": "object"',
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "none"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g', not a tool",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "high"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "0"),
        ({"min_p": 1.5}, "min_p", "1"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "pattern"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "100"),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [_call("c", "{bad")]}]},
            "messages",
            "not JSON",
        ),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [_call("c", "[1]")]}]},
            "messages",
            "JSON object",
        ),
        ({"messages": [USER, {"role": "user", "tool_calls": CALLS}]}, "messages", "assistant"),
        ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        (
            {"messages": [*HISTORY[:3], {"role": "tool", "tool_call_id": "c9", "content": "?"}]},
            "messages",
            "tool_call_id 'c9'",
        ),
        (  # a result before its call answers nothing
            {"messages": [USER, HISTORY[3], HISTORY[2]]},
            "messages",
            "tool_call_id 'c1'",
        ),
    ],
)
def test_bad_agent_requests_are_400s_naming_the_param(
    body: dict[str, Any], param: str, says: str
) -> None:
    message, got = refusal(**body)
    assert got == param and says in message, message


def test_messages_reach_the_format_as_vllm_hands_them_over() -> None:
    r = req(messages=[*HISTORY, {"role": "assistant", "content": "ok", "reasoning": "Done."}])
    empty = req(messages=[USER, {"role": "assistant", "content": "x", "tool_calls": []}])
    no_args = req(messages=[USER, {"role": "assistant", "tool_calls": [_call("c", "")]}])
    assert chat_messages(r.messages) == [
        {"role": "system", "content": "Be terse."},
        USER,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two calls.",
            "reasoning": "Two calls.",
            "tool_calls": [
                _call("c1", {"city": "Paris", "days": 2}),
                _call("c2", {"city": "北京"}),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "c2", "content": "晴"},
        {"role": "assistant", "content": "ok", "reasoning_content": "Done.", "reasoning": "Done."},
    ]
    assert "tool_calls" not in chat_messages(empty.messages)[1]  # vLLM drops an empty list
    assert chat_messages(no_args.messages)[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_reasoning_effort_is_a_template_variable_kwargs_override() -> None:
    assert template_kwargs(req()) == {}
    assert template_kwargs(req(reasoning_effort="low")) == {"reasoning_effort": "low"}
    both = req(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert template_kwargs(both) == {"reasoning_effort": "high"}
    assert template_kwargs(req(chat_template_kwargs={"tools": [1], "x": 1})) == {"x": 1}


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required"])
def test_a_history_through_the_gateway_renders_as_transformers(tool_choice: str) -> None:
    """The shipped model: the request's JSON, converted by the gateway and rendered by our
    formatter, gives the text and ids transformers gives for the same chat (arguments as
    mappings, as vLLM hands them to templates); the tools are in the prompt whatever
    tool_choice is (vLLM's default)."""
    ref = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED))
    formatter = chat_formatter(load_tokenizer(SHIPPED), SHIPPED)
    for thinking in (True, False):
        body = {
            "messages": HISTORY,
            "tools": [WEATHER],
            "tool_choice": tool_choice,
            "reasoning_effort": "high",
            "chat_template_kwargs": {"enable_thinking": thinking},
        }
        prompt = chat_prompt(formatter, ChatCompletionRequest.model_validate(body))
        messages = copy.deepcopy(HISTORY)
        for call in messages[2]["tool_calls"]:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        messages[2]["content"], messages[4]["content"] = "", "晴"
        kw = {"tools": [WEATHER], "enable_thinking": thinking, "reasoning_effort": "high"}
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        assert prompt.text == text
        assert prompt.token_ids == ref.encode(text, add_special_tokens=False)
        assert "<arg_key>days</arg_key><arg_value>2</arg_value>" in text
        assert text.endswith("<|assistant|><think>" if thinking else "<|assistant|></think>")


def test_deepseek_v32_gets_the_calls_and_results_in_its_own_places() -> None:
    fmt = DeepseekV32Formatter(ByteTokenizer())
    for thinking in (True, False):
        r = req(messages=HISTORY, tools=[WEATHER], chat_template_kwargs={"thinking": thinking})
        text = chat_prompt(fmt, r).text
        assert (
            text.index("## Tools")
            < text.index('"name": "get_weather"')
            < text.index(USER["content"])
        )
        calls = (
            "<｜DSML｜function_calls>\n"
            '<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n"
            '<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n"
            "</｜DSML｜function_calls><｜end▁of▁sentence｜>"
        )
        results = (
            '<function_results>\n<result>{"sky": "sunny"}</result>\n<result>晴</result>\n'
            "</function_results>\n\n"
        )
        assert calls in text and text.index(calls) < text.index(results)
        # The turn after the user's keeps its reasoning in thinking mode, and the results
        # reopen it (or close it, thinking off).
        assert ("Two calls.</think>\n\n" + calls in text) is thinking
        assert text.endswith(results + ("<think>" if thinking else "</think>"))


def test_penalties_and_logit_bias_reach_the_sampling() -> None:
    limits = Limits(max_model_len=100, vocab_size=50)
    rng = random.Random(0)
    for _ in range(20):
        bias = {str(rng.randrange(50)): rng.uniform(-100, 100) for _ in range(rng.randrange(5))}
        kw = {
            "presence_penalty": rng.uniform(-2, 2),
            "frequency_penalty": rng.uniform(-2, 2),
            "repetition_penalty": rng.uniform(0.1, 3),
            "min_p": rng.random(),
            "logit_bias": bias,
        }
        for s in (
            chat_sampling(req(**kw), 4, limits),
            completion_sampling(CompletionRequest(prompt="x", **kw), 4, limits),
        ):
            assert (s.presence_penalty, s.frequency_penalty) == (
                kw["presence_penalty"],
                kw["frequency_penalty"],
            )
            assert (s.repetition_penalty, s.min_p) == (kw["repetition_penalty"], kw["min_p"])
            assert s.logit_bias == tuple(sorted((int(k), v) for k, v in bias.items()))
    neutral = chat_sampling(req(), 4, limits)
    assert (neutral.presence_penalty, neutral.frequency_penalty) == (0.0, 0.0)
    assert (neutral.repetition_penalty, neutral.min_p, neutral.logit_bias) == (1.0, 0.0, ())
    with pytest.raises(APIError) as e:
        chat_sampling(req(logit_bias={"49": 1, "50": 1}), 4, limits)
    assert e.value.param == "logit_bias" and "50 is out of range [0, 50)" in e.value.message
