"""DeepSeek-V4.1 replies read back (turns our V4.1 encoder writes parse back in
test_reply_dsv4.py): V4.1 calls live in a spaced `` calls`` block, so V4's ``tool_calls``
markup in a V4.1 reply is content and V4.1's in a V4 reply, and a reply streams as it parses
at every cut."""

from __future__ import annotations

import random

from dhisparse.tokenizer.reply import parse_reply, reply_style

from .reply_helpers import TOOLS, check_stream_is_whole

STYLE = "deepseek_v4_1"
CALL = (
    '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Oslo</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)


def test_a_v41_checkpoint_replies_in_v41s_style() -> None:
    assert reply_style("deepseek_v41") == STYLE


def test_v4s_block_is_content_in_a_v41_reply() -> None:
    v4 = CALL.replace("｜ calls>", "｜tool_calls>").replace("｜ ", "｜")
    reply = parse_reply(STYLE, "a\n\n" + v4, reasoning_open=False, tools=TOOLS)
    assert (reply.content, reply.tool_calls) == ("a\n\n" + v4, ())
    reply = parse_reply("deepseek_v4", "a\n\n" + CALL, reasoning_open=False, tools=TOOLS)
    assert (reply.content, reply.tool_calls) == ("a\n\n" + CALL, ())
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
