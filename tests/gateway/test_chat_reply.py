"""A chat reply's raw text as the OpenAI message: the stream of chunks the gateway sends for a
worker's text deltas (cut at random token boundaries) adds up to the non-streamed message —
reasoning under both names, tool calls with their ids and names first and then argument
fragments, ``finish_reason`` ``tool_calls``, and usage's reasoning tokens."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import pytest

from dhisparse.tokenizer import load_tokenizer
from services.gateway.chat import chat_chunks
from services.gateway.chat_reply import ReplyFormat, finish_reason, message, reasoning_tokens
from services.gateway.fanout import ChoiceStream
from services.gateway.generation import GenerationDelta
from services.gateway.metrics import GatewayMetrics

TOKENIZER = load_tokenizer("models/glm-dsa-mini")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]
GLM_REPLY = (
    "The user wants two cities.</think>Checking both.<tool_call>get_weather\n"
    "<arg_key>city</arg_key><arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    "<tool_call>noop</tool_call>"
)
DSML_REPLY = (
    "Two calls are needed.</think>\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
)
CASES = {
    "glm_4_7": GLM_REPLY,
    "deepseek_v3_2": DSML_REPLY,
    "deepseek_v4": DSML_REPLY.replace("function_calls>", "tool_calls>"),
    "deepseek_v4_1": DSML_REPLY.replace("function_calls>", " calls>")
    .replace("｜invoke", "｜ invoke")
    .replace("｜parameter", "｜ parameter"),
}


def deltas(text: str, rng: random.Random) -> list[GenerationDelta]:
    """The worker's deltas for ``text``: its tokens in random groups, each with the text they
    complete (a token that ends inside a UTF-8 sequence releases nothing, as the worker's
    detokenizer holds it back)."""
    ids = TOKENIZER.encode(text)
    cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(3, 12))))
    out, start, said = [], 0, ""
    for i, end in enumerate([*cuts, len(ids)]):
        upto = TOKENIZER.decode(ids[:end], skip_special_tokens=False)
        last = i == len(cuts)
        if upto.endswith("\ufffd") and not last:
            upto = said
        out.append(
            GenerationDelta(
                token_ids=tuple(ids[start:end]), text=upto[len(said) :],
                finish_reason="stop" if last else None, stop_reason=None,
                prompt_tokens=5, completion_tokens=end,
            )
        )  # fmt: skip
        start, said = end, upto
    assert said == text
    return out


async def stream_of(items: list[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
    for d in items:
        yield d


def streamed(fmt: ReplyFormat, items: list[GenerationDelta]) -> list[dict]:
    async def run() -> list[str]:
        s = ChoiceStream(stream_of(items), GatewayMetrics().track("m"))
        chunks = chat_chunks("id", "m", [s], 5, None, fmt, TOKENIZER, include_usage=True)
        return [c async for c in chunks]

    return [json.loads(c) for c in asyncio.run(run())]


def accumulate(chunks: list[dict]) -> dict:
    """What a client builds from the chunks (the openai library's accumulation)."""
    msg: dict = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}}
    finish = None
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        d = choice["delta"]
        for key in ("content", "reasoning_content", "reasoning"):
            msg[key] += d.get(key) or ""
        for tc in d.get("tool_calls") or []:
            slot = msg["tool_calls"].setdefault(tc["index"], {"arguments": ""})
            if "id" in tc:
                assert "id" not in slot, "a call's id comes once"
                assert slot["arguments"] == "", "the id and name come before any argument"
                slot.update(id=tc["id"], name=tc["function"]["name"])
            slot["arguments"] += tc["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    msg["finish_reason"] = finish
    msg["usage"] = chunks[-1]["usage"]
    return msg


@pytest.mark.parametrize("style", sorted(CASES))
@pytest.mark.parametrize("seed", range(4))
def test_the_stream_adds_up_to_the_message(style: str, seed: int) -> None:
    text = CASES[style]
    fmt = ReplyFormat(style=style, reasoning_open=True, tools=TOOLS)
    whole = fmt.whole(text)
    got = accumulate(streamed(fmt, deltas(text, random.Random(seed))))
    want = message(whole).model_dump()
    assert got["reasoning_content"] == got["reasoning"] == want["reasoning_content"]
    assert want["reasoning_content"] == text.split("</think>")[0]
    assert got["content"].strip() == (want["content"] or "").strip()
    calls = [got["tool_calls"][i] for i in sorted(got["tool_calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want["tool_calls"]
    ]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["days"] in (2, 3)
    assert all(c["id"].startswith("call_") for c in calls)
    assert got["finish_reason"] == finish_reason("stop", True) == "tool_calls"
    n_reasoning = reasoning_tokens(TOKENIZER, TOKENIZER.encode(text), whole.reasoning_end)
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": n_reasoning}
    assert 0 < n_reasoning < len(TOKENIZER.encode(text))


def test_reasoning_tokens_cover_the_closing_tag() -> None:
    text = "short thought</think>answer"
    ids = TOKENIZER.encode(text)
    n = reasoning_tokens(TOKENIZER, ids, len("short thought</think>"))
    assert TOKENIZER.decode(ids[:n]).startswith("short thought</think>")
    assert not TOKENIZER.decode(ids[: n - 1]).startswith("short thought</think>")


def test_a_plain_model_streams_text_only() -> None:
    fmt = ReplyFormat()
    chunks = streamed(fmt, deltas("def f(x):\n    return x</think>", random.Random(0)))
    got = accumulate(chunks)
    assert got["content"] == "def f(x):\n    return x</think>"
    assert got["reasoning_content"] == "" and got["tool_calls"] == {}
    assert got["finish_reason"] == "stop"
    assert "completion_tokens_details" not in got["usage"]
