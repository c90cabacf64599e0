"""Shared by the reply parser's tests: tools with typed parameters, random replies' values,
and a reply read as a stream cut at random places."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from dhisparse.tokenizer.reply import (
    Reply,
    ReplyEvent,
    ToolArgumentsDelta,
    ToolCallBegin,
    parse_reply,
    reply_parser,
)
from dhisparse.tokenizer.reply_types import assemble

# Open element and member schemas: xgrammar reads a bare "array" or "object" as an empty one.
_OPEN = {"array": {"items": {}}, "object": {"additionalProperties": True}}


def tool(name: str, **types: str) -> dict[str, Any]:
    properties = {k: {"type": t, **_OPEN.get(t, {})} for k, t in types.items()}
    schema = {"type": "object", "properties": properties, "required": list(types)}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    tool("get_weather", city="string", days="integer", metric="boolean"),
    tool("search", query="string", tags="array", filters="object", limit="number"),
    tool("now"),
]
TYPES = {
    t["function"]["name"]: {
        k: v["type"] for k, v in t["function"]["parameters"]["properties"].items()
    }
    for t in TOOLS
}

# Text a value or a stretch of content may hold: letters, markup-looking characters,
# quotes and backslashes (escaped in JSON), non-ASCII, newlines.
_CHARS = string.ascii_letters + string.digits + ' \n\t<>/"\\{}[],:=_-.ü晴'


def random_text(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, n)))


def random_value(rng: random.Random, kind: str) -> Any:
    if kind == "string":
        return random_text(rng) if rng.random() < 0.8 else rng.choice(["123", "true", "null"])
    if kind == "integer":
        return rng.randint(-1000, 1000)
    if kind == "number":
        return rng.choice([0.5, -2.25, 3, 1e-3])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [random_text(rng, 4), rng.randint(0, 9), None][: rng.randint(0, 3)]
    return {"k": random_text(rng, 4), "n": [1, {"x": False}]}


def random_calls(rng: random.Random, most: int = 3) -> list[tuple[str, dict[str, Any]]]:
    """Random calls of TOOLS: (name, arguments), each argument of its parameter's type."""
    calls = []
    for _ in range(rng.randint(0, most)):
        name = rng.choice(list(TYPES))
        keys = [k for k in TYPES[name] if rng.random() < 0.8]
        calls.append((name, {k: random_value(rng, TYPES[name][k]) for k in keys}))
    return calls


def pieces(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at random places: sometimes at every character, sometimes in a few pieces."""
    if rng.random() < 0.2:
        return list(text)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def streamed(
    style: str,
    text_pieces: Sequence[str],
    *,
    reasoning_open: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[Reply, list[ReplyEvent]]:
    """The reply the stream's events tell, and the events, fed ``text_pieces`` one by one."""
    parser = reply_parser(style, reasoning_open=reasoning_open, tools=tools)
    events: list[ReplyEvent] = []
    for piece in text_pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return assemble(events, parser.reasoning_end), events


def without_ids(reply: Reply) -> Reply:
    return replace(reply, tool_calls=tuple(replace(c, id="") for c in reply.tool_calls))


def check_stream_is_whole(
    style: str,
    text: str,
    rng: random.Random,
    *,
    reasoning_open: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> Reply:
    """Asserts that the reply streamed at random cuts is the whole reply (ids aside) and that
    its events have OpenAI's shape; returns the whole reply."""
    whole = parse_reply(style, text, reasoning_open=reasoning_open, tools=tools)
    reply, events = streamed(style, pieces(text, rng), reasoning_open=reasoning_open, tools=tools)
    assert without_ids(reply) == without_ids(whole), text
    begun: set[int] = set()
    for e in events:
        if isinstance(e, ToolCallBegin):
            assert e.id.startswith("call_") and len(e.id) == 29 and e.id[5:].isalnum()
            assert e.name and e.index == len(begun)
            begun.add(e.index)
        elif isinstance(e, ToolArgumentsDelta):
            assert e.index in begun and e.text
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    return whole
