"""GLM-4.7 / GLM-5 replies read back: assistant turns rendered by GLM-4.7's chat template (through
transformers, the oracle) parse to the message they render, whole and streamed at random cuts;
and the format's known failure modes (a tool call before ``</think>``, names split across
deltas, calls without arguments in a stream, replies cut inside a call)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from dhisparse.tokenizer.reply import (
    ContentDelta,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallBegin,
    parse_reply,
    reply_parser,
)

from .helpers import HERE
from .reply_helpers import (
    TOOLS,
    TYPES,
    check_stream_is_whole,
    random_calls,
    random_text,
    streamed,
)

STYLE = "glm_4_7"
# GLM-4.7's released template (GLM-5's family; test_glm47_template checks the fixture)
GLM47_TEMPLATE = (HERE / "glm47_chat_template.jinja").read_text(encoding="utf-8")


def _render_turn(message: dict[str, Any]) -> str:
    """The assistant turn's text as the template writes it (after ``<|assistant|>``)."""
    chat = [{"role": "user", "content": "hi"}, message]
    rendered, _ = render_jinja_template([chat], chat_template=GLM47_TEMPLATE, tools=TOOLS)
    return rendered[0].rsplit("<|assistant|>", 1)[1]


@pytest.mark.parametrize("seed", range(60))
def test_template_turns_parse_back_to_their_message(seed: int) -> None:
    rng = random.Random(seed)
    reasoning, content = random_text(rng, 30), random_text(rng, 30)
    calls = random_calls(rng)
    message = {
        "role": "assistant",
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    text = _render_turn(message)
    if text.startswith("</think>"):  # no reasoning: a prompt that ends in </think> (thinking off)
        text = text.removeprefix("</think>")
    reply = check_stream_is_whole(STYLE, text, rng, reasoning_open=False, tools=TOOLS)
    assert reply.reasoning == reasoning.strip()
    assert reply.content == content.strip()
    # a string value's surrounding whitespace is formatting in GLM's format (xgrammar pads
    # <arg_value> with it), so it reads back stripped
    stripped = [
        (n, {k: v.strip() if TYPES[n][k] == "string" else v for k, v in a.items()})
        for n, a in calls
    ]
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        (n, json.dumps(a, ensure_ascii=False)) for n, a in stripped
    ]
    thought = text.startswith("<think>")
    assert reply.reasoning_end == (text.index("</think>") + len("</think>") if thought else 0)


def test_a_tool_call_before_the_reasoning_ends_is_reasoning() -> None:
    text = "I will call <tool_call>now</tool_call> now.</think>Done."
    reply = parse_reply(STYLE, text, reasoning_open=True, tools=TOOLS)
    assert reply.reasoning == "I will call <tool_call>now</tool_call> now."
    assert reply.content == "Done." and reply.tool_calls == ()


def test_a_name_split_across_deltas_begins_its_call_once_whole() -> None:
    parser = reply_parser(STYLE, reasoning_open=False, tools=TOOLS)
    assert parser.feed("<tool_") == []
    assert parser.feed("call>get_") == []
    assert parser.feed("wea") == []
    begun = parser.feed("ther\n")
    assert [(type(e), getattr(e, "name", None)) for e in begun] == [
        (ToolCallBegin, "get_weather"),
        (ToolArgumentsDelta, None),
    ]
    rest = parser.feed("<arg_key>city</arg_key>\n<arg_value>Os") + parser.feed("lo</arg_value>")
    rest += parser.feed("\n</tool_call>") + parser.finish()
    assert "".join(e.text for e in begun + rest if isinstance(e, ToolArgumentsDelta)) == (
        '{"city": "Oslo"}'
    )


@pytest.mark.parametrize("call", ["<tool_call>now</tool_call>", "<tool_call>now\n</tool_call>"])
def test_a_call_without_arguments_streams_character_by_character(call: str) -> None:
    reply, events = streamed(STYLE, list(call + "ok"), reasoning_open=False, tools=TOOLS)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("now", "{}")]
    assert reply.content == "ok"
    assert isinstance(events[0], ToolCallBegin)


def test_the_name_may_run_into_the_first_argument() -> None:
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    reply = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]


@pytest.mark.parametrize(
    ("key", "written", "value"),
    [
        ("city", "123", "123"),  # a string parameter keeps JSON-looking text as text
        ("city", " Oslo\n", "Oslo"),  # without the whitespace around it (formatting)
        ("days", " 7 ", 7),
        ("days", "seven", "seven"),  # not JSON: a string
        ("metric", "true", True),
        ("extra", '[1, {"a": null}]', [1, {"a": None}]),  # not in the schema: JSON if it is
        ("extra", "Oslo", "Oslo"),
        ("extra", "NaN", "NaN"),  # not JSON, though Python's json reads it
    ],
)
def test_a_value_is_a_string_or_json_as_the_schema_says(key: str, written: str, value: Any) -> None:
    text = f"<tool_call>get_weather\n<arg_key>{key}</arg_key>\n<arg_value>{written}</arg_value>\n</tool_call>"
    (call,) = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS).tool_calls
    assert json.loads(call.arguments) == {key: value}


def test_an_unknown_tool_reads_every_json_value_as_json() -> None:
    text = "<tool_call>other<arg_key>n</arg_key><arg_value>5</arg_value></tool_call>"
    (call,) = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS).tool_calls
    assert (call.name, call.arguments) == ("other", '{"n": 5}')


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_the_markup_is_content(tools: list[Any] | None) -> None:
    text = "<think>r</think>\nSee <tool_call>now</tool_call> here\n"
    reply = parse_reply(STYLE, text, reasoning_open=False, tools=tools)
    assert (reply.reasoning, reply.content, reply.tool_calls) == (
        "r",
        "\nSee <tool_call>now</tool_call> here\n",
        (),
    )


def test_content_and_reasoning_are_released_as_soon_as_they_cannot_be_a_tag() -> None:
    parser = reply_parser(STYLE, reasoning_open=True, tools=TOOLS)
    assert parser.feed("Let me see</th") == [ReasoningDelta("Let me see")]
    assert parser.feed("ink>\nHello wor") == [ContentDelta("\nHello wor")]
    assert parser.feed("ld. \n<tool") == [ContentDelta("ld.")]  # the trailing space waits
    assert parser.feed("s> and") == [ContentDelta(" \n<tools> and")]
    assert parser.feed("\n<tool_call>n") == []
    assert parser.finish() == []  # a call cut before its name ends is dropped
    # text as written, but for the whitespace that separates it from a call
    reply = parse_reply(STYLE, "  a \n<tool_call>now</tool_call>\n b \n", reasoning_open=False,
                        tools=TOOLS)  # fmt: skip
    assert (reply.content, [c.name for c in reply.tool_calls]) == ("  ab \n", ["now"])


def test_a_reply_cut_inside_a_call_keeps_the_call_its_name_began() -> None:
    text = "<tool_call>search\n<arg_key>query</arg_key><arg_value>snow in Os"
    reply = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("search", '{"query": "snow in Os"}')
    ]
    text = "<tool_call>search\n<arg_key>query</arg_key><arg_value>a</arg_value><arg_key>limit"
    (call,) = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS).tool_calls
    assert call.arguments == '{"query": "a"}'
    text = "<tool_call>search\n<arg_key>limit</arg_key><arg_value>3"
    (call,) = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS).tool_calls
    assert call.arguments == "{}"  # a non-string value cut short is left out


@pytest.mark.parametrize("seed", range(6))
def test_every_cut_of_a_reply_streams_as_it_parses(seed: int) -> None:
    rng = random.Random(seed)
    calls = random_calls(rng, most=2) or [("now", {})]
    message = {
        "role": "assistant",
        "reasoning_content": random_text(rng),
        "content": random_text(rng),
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    text = _render_turn(message)
    whole = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS)
    for k in range(len(text) + 1):
        cut = check_stream_is_whole(STYLE, text[:k], rng, reasoning_open=False, tools=TOOLS)
        assert len(cut.tool_calls) <= len(whole.tool_calls)
        assert [c.name for c in cut.tool_calls] == [c.name for c in whole.tool_calls][
            : len(cut.tool_calls)
        ]


def test_an_unclosed_reasoning_takes_the_whole_reply() -> None:
    reply = parse_reply(STYLE, "still thinking <tool_call>", reasoning_open=True, tools=TOOLS)
    assert reply.reasoning == "still thinking <tool_call>"
    assert reply.reasoning_end == len("still thinking <tool_call>")
    assert parse_reply(STYLE, "Hi", reasoning_open=False, tools=TOOLS).reasoning_end == 0
