"""DeepSeek-V3.2 replies read back: assistant turns written by our DSML encoder
(``encoding_dsv32``, itself checked against DeepSeek's reference) parse to the message they
encode, whole and streamed at random cuts, in thinking and chat mode; and what the encoder
never writes but constrained decoding may (a block without the two newlines before it, text
after a block) or a reply cut short."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from dhisparse.tokenizer.encoding_dsv32 import CALLS_CLOSE, EOS, ThinkingMode, encode_messages
from dhisparse.tokenizer.reply import ContentDelta, parse_reply, reply_parser

from .reply_helpers import TOOLS, check_stream_is_whole, random_calls, random_text

STYLE = "deepseek_v3_2"
CALL = (
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
)


def _encode_turn(message: dict[str, Any], mode: ThinkingMode) -> str:
    """The assistant turn's text as the encoder writes it, without its EOS (where the
    worker stops)."""
    context = [{"role": "system", "content": "s", "tools": TOOLS}, {"role": "user", "content": "u"}]
    text = encode_messages([message], mode, context=context)
    assert text.endswith(EOS)
    return text[: -len(EOS)]


@pytest.mark.parametrize("mode", ["thinking", "chat"])
@pytest.mark.parametrize("seed", range(40))
def test_encoded_turns_parse_back_to_their_message(seed: int, mode: ThinkingMode) -> None:
    rng = random.Random(seed)
    reasoning, content = random_text(rng, 30), random_text(rng, 30)
    calls = random_calls(rng)
    if mode == "thinking" and not reasoning and not calls:
        reasoning = "r"
    message = {
        "role": "assistant",
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    text = _encode_turn(message, mode)
    thinking = mode == "thinking"
    reply = check_stream_is_whole(STYLE, text, rng, reasoning_open=thinking, tools=TOOLS)
    assert reply.reasoning == (reasoning if thinking else "")
    assert reply.content == content
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        (n, json.dumps(a, ensure_ascii=False)) for n, a in calls
    ]
    assert reply.reasoning_end == (len(reasoning) + len("</think>") if thinking else 0)


def test_a_block_without_the_newlines_before_it_and_text_after_it() -> None:
    text = "Checking." + CALL + " Then more."
    reply = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS)
    assert reply.content == "Checking. Then more."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", '{"city": "Oslo", "days": 3}')
    ]


def test_newlines_wait_only_while_a_block_may_follow() -> None:
    parser = reply_parser(STYLE, reasoning_open=False, tools=TOOLS)
    assert parser.feed("One\n") == [ContentDelta("One")]
    assert parser.feed("\n") == []
    assert parser.feed("Two") == [ContentDelta("\n\nTwo")]
    assert parser.feed("\n\n<｜DSML｜func") == []
    assert parser.feed("tion_calls>\n") == []


def test_a_string_false_value_that_is_not_json_is_a_string() -> None:
    text = CALL.replace(">3<", "> soon <")
    (call,) = parse_reply(STYLE, text, reasoning_open=False, tools=TOOLS).tool_calls
    assert json.loads(call.arguments) == {"city": "Oslo", "days": "soon"}


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_the_markup_is_content(tools: list[Any] | None) -> None:
    reply = parse_reply(STYLE, "a\n\n" + CALL, reasoning_open=False, tools=tools)
    assert (reply.content, reply.tool_calls) == ("a\n\n" + CALL, ())


def test_every_cut_of_a_reply_streams_as_it_parses() -> None:
    rng = random.Random(0)
    now = '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n'
    text = "plan</think>Sure.\n\n" + CALL.replace(CALLS_CLOSE, now + CALLS_CLOSE)
    names = []
    for k in range(len(text) + 1):
        cut = check_stream_is_whole(STYLE, text[:k], rng, reasoning_open=True, tools=TOOLS)
        names.append([c.name for c in cut.tool_calls])
        if k > text.index('name="now">') + len('name="now">'):
            assert names[-1] == ["get_weather", "now"]
    cut_in_value = text[: text.index("Oslo") + 2]
    (call,) = parse_reply(STYLE, cut_in_value, reasoning_open=True, tools=TOOLS).tool_calls
    assert call.arguments == '{"city": "Os"}'
