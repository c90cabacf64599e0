"""What a model's reply is made of once parsed: OpenAI's assistant message (``Reply``) and the
events a streamed reply is told in, in the order its text holds them."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A tool call's id as OpenAI writes one: ``call_`` and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool; ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    """A whole reply: its answer text (``content``), its ``reasoning`` and its tool calls.
    ``reasoning_end`` is the character offset in the raw reply text where the reasoning ended,
    its closing tag included (the whole text when the reasoning never closed, 0 when the reply
    has none): the boundary that counts reasoning tokens."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    reasoning_end: int = 0


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    """A tool call starts: its place among the reply's calls (from 0), its id and its name.
    Its arguments follow as ``ToolArgumentsDelta``s of the same index."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgumentsDelta:
    """A piece of the arguments' JSON text of the call ``index``; a call's pieces in order
    make its whole ``arguments``."""

    index: int
    text: str


ReplyEvent = ContentDelta | ReasoningDelta | ToolCallBegin | ToolArgumentsDelta


def coalesce(events: list[ReplyEvent]) -> list[ReplyEvent]:
    """``events`` without empty pieces, neighbouring pieces of one kind (and one call) joined."""
    out: list[ReplyEvent] = []
    for e in events:
        if isinstance(e, ToolCallBegin):
            out.append(e)
            continue
        if not e.text:
            continue
        last = out[-1] if out else None
        if isinstance(e, ToolArgumentsDelta) and isinstance(last, ToolArgumentsDelta):
            if last.index == e.index:
                out[-1] = ToolArgumentsDelta(e.index, last.text + e.text)
                continue
        elif type(last) is type(e) and isinstance(e, ContentDelta | ReasoningDelta):
            out[-1] = type(e)(last.text + e.text)  # type: ignore[union-attr]
            continue
        out.append(e)
    return out


def assemble(events: list[ReplyEvent], reasoning_end: int = 0) -> Reply:
    """The reply a stream's events tell, all of them in order."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[tuple[str, str, list[str]]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ToolCallBegin):
            if e.index != len(calls):
                raise ValueError(f"tool call {e.index} begins out of order")
            calls.append((e.id, e.name, []))
        else:
            calls[e.index][2].append(e.text)
    return Reply(
        content="".join(content),
        reasoning="".join(reasoning),
        tool_calls=tuple(ToolCall(i, name, "".join(args)) for i, name, args in calls),
        reasoning_end=reasoning_end,
    )
