"""DeepSeek-V4 replies read back: assistant turns written by our V4 and V4.1 encoders
(``encoding_dsv4``, ``encoding_dsv41``, each checked against DeepSeek's reference) parse in
their style to the message they encode, whole and streamed at random cuts, in thinking and chat
mode; V4 calls live in a ``tool_calls`` block, so
V3.2's ``function_calls`` markup in a V4 reply is content."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from dhisparse.tokenizer import encoding_dsv4, encoding_dsv41
from dhisparse.tokenizer.dsml import EOS
from dhisparse.tokenizer.encoding_dsv32 import ThinkingMode
from dhisparse.tokenizer.reply import parse_reply

from .reply_helpers import TOOLS, check_stream_is_whole, random_calls, random_text

STYLE = "deepseek_v4"
ENCODERS = {STYLE: encoding_dsv4.encode_messages, "deepseek_v4_1": encoding_dsv41.encode_messages}
CALL = (
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _encode_turn(style: str, message: dict[str, Any], mode: ThinkingMode) -> str:
    """The assistant turn's text as the style's encoder writes it, without its EOS."""
    context = [{"role": "system", "content": "s", "tools": TOOLS}, {"role": "user", "content": "u"}]
    text = ENCODERS[style]([message], mode, context=context)
    assert text.endswith(EOS)
    return text[: -len(EOS)]


@pytest.mark.parametrize("style", sorted(ENCODERS))
@pytest.mark.parametrize("mode", ["thinking", "chat"])
@pytest.mark.parametrize("seed", range(30))
def test_encoded_turns_parse_back_to_their_message(
    style: str, seed: int, mode: ThinkingMode
) -> None:
    rng = random.Random(seed)
    reasoning, content = random_text(rng, 30), random_text(rng, 30)
    calls = random_calls(rng)
    message = {
        "role": "assistant",
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for n, a in calls
        ],
    }
    text = _encode_turn(style, message, mode)
    thinking = mode == "thinking"
    reply = check_stream_is_whole(style, text, rng, reasoning_open=thinking, tools=TOOLS)
    assert reply.reasoning == (reasoning if thinking else "")
    assert reply.content == content
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == calls


def test_v32s_block_is_content_in_a_v4_reply() -> None:
    v32 = CALL.replace("tool_calls>", "function_calls>")
    reply = parse_reply(STYLE, "a\n\n" + v32, reasoning_open=False, tools=TOOLS)
    assert (reply.content, reply.tool_calls) == ("a\n\n" + v32, ())
    reply = parse_reply(STYLE, "a\n\n" + CALL, reasoning_open=False, tools=TOOLS)
    assert reply.content == "a"
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", '{"city": "Oslo", "days": 3}')
    ]


def test_every_cut_of_a_reply_streams_as_it_parses() -> None:
    rng = random.Random(1)
    text = "plan</think>Sure.\n\n" + CALL
    for k in range(len(text) + 1):
        cut = check_stream_is_whole(STYLE, text[:k], rng, reasoning_open=True, tools=TOOLS)
        if k > text.index('name="get_weather">') + len('name="get_weather">'):
            assert [c.name for c in cut.tool_calls] == ["get_weather"]
