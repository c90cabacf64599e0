"""A model's raw reply text as OpenAI's assistant message: reasoning, content and tool calls,
whole (``parse_reply``) or as a stream of events (``reply_parser``).

The reply formats (``style``) are those of xgrammar's built-in structural tags, so a reply
constrained by one reads back here: ``"deepseek_v3_2"``, ``"deepseek_v4"`` and
``"deepseek_v4_1"`` (DSML tool calls in a ``function_calls``, a ``tool_calls`` and a spaced
`` calls`` block, ``reply_dsml``) and ``"glm_4_7"`` (GLM-4.7 /
GLM-5 tool calls, ``reply_glm``); all reason in a ``<think>`` block (``reasoning``). Text deltas may split any tag anywhere: text that may still be part of a tag
is held back until it cannot be, and everything else is released at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from dhisparse.tokenizer.dsml import V4_BLOCK, V32_BLOCK, V41_BLOCK, CallBlock
from dhisparse.tokenizer.reasoning import ReasoningSplitter
from dhisparse.tokenizer.reply_dsml import DsmlAnswer
from dhisparse.tokenizer.reply_glm import GlmAnswer
from dhisparse.tokenizer.reply_types import (
    ContentDelta,
    ReasoningDelta,
    Reply,
    ReplyEvent,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallBegin,
    assemble,
    coalesce,
)

__all__ = [
    "ContentDelta",
    "ReasoningDelta",
    "Reply",
    "ReplyEvent",
    "ReplyParser",
    "ToolArgumentsDelta",
    "ToolCall",
    "ToolCallBegin",
    "parse_reply",
    "reply_parser",
    "reply_style",
]

# The DSML styles by their call block.
_DSML_BLOCKS: dict[str, CallBlock] = {
    "deepseek_v3_2": V32_BLOCK,
    "deepseek_v4": V4_BLOCK,
    "deepseek_v4_1": V41_BLOCK,
}
STYLES = (*_DSML_BLOCKS, "glm_4_7")
# The most whitespace characters in a row that a constrained reply may write where its grammar
# allows formatting whitespace (xgrammar's ``max_whitespace_cnt``): enough for indented JSON,
# and a model that drifts into whitespace still reaches the end of its structure.
GRAMMAR_MAX_WHITESPACE = 16
_STYLE_OF_MODEL = {
    "deepseek_v32": "deepseek_v3_2",
    "deepseek_v4": "deepseek_v4",
    "deepseek_v41": "deepseek_v4_1",
    "glm_moe_dsa": "glm_4_7",
}


def reply_style(model_type: str | None) -> str | None:
    """The reply format of a checkpoint's chat family (``hf_files.chat_family``: its
    ``model_type``, ``deepseek_v41`` for a DeepSeek-V4.1 checkpoint); None for one without a
    parser."""
    return _STYLE_OF_MODEL.get(model_type or "")


class AnswerParser(Protocol):
    """Reads the answer part of a reply (after its reasoning)."""

    def feed(self, text: str) -> list[ReplyEvent]: ...

    def finish(self) -> list[ReplyEvent]: ...


class ReplyParser:
    """One reply's text in, as it arrives; its events out, in the text's order. ``feed`` may
    be called any number of times, then ``finish`` once."""

    def __init__(self, *, reasoning_open: bool, answer: AnswerParser) -> None:
        self._reasoning = ReasoningSplitter(reasoning_open=reasoning_open)
        self._answer = answer

    @property
    def reasoning_end(self) -> int:
        """The character offset in the text fed where the reasoning ended (``Reply``)."""
        return self._reasoning.reasoning_end

    def feed(self, text: str) -> list[ReplyEvent]:
        """The events ``text`` releases (none while it may be part of a tag)."""
        return self._read(text, final=False)

    def finish(self) -> list[ReplyEvent]:
        """The events of the text still held back: the reply has ended."""
        return self._read("", final=True)

    def _read(self, text: str, *, final: bool) -> list[ReplyEvent]:
        reasoning, answer = self._reasoning.feed(text, final=final)
        events: list[ReplyEvent] = [ReasoningDelta(reasoning)]
        if answer:
            events += self._answer.feed(answer)
        if final:
            events += self._answer.finish()
        return coalesce(events)


def reply_parser(
    style: str, *, reasoning_open: bool, tools: Sequence[Mapping[str, Any]] | None
) -> ReplyParser:
    """A parser of one reply in ``style``. ``reasoning_open``: the prompt ended inside a
    reasoning block, so the reply starts in it. ``tools`` (OpenAI's tool objects): None or
    empty reads no tool calls (their markup is content); GLM reads the parameters' types from
    their schemas."""
    if style in _DSML_BLOCKS:
        answer: AnswerParser = DsmlAnswer(_DSML_BLOCKS[style], calls=bool(tools))
    elif style == "glm_4_7":
        answer = GlmAnswer(tools)
    else:
        raise ValueError(f"unknown reply style {style!r}; known: {', '.join(STYLES)}")
    return ReplyParser(reasoning_open=reasoning_open, answer=answer)


def read_reply(parser: ReplyParser, text: str) -> Reply:
    """The whole reply ``parser`` reads from ``text``: the stream's events, assembled."""
    events = parser.feed(text) + parser.finish()
    return assemble(events, parser.reasoning_end)


def parse_reply(
    style: str, text: str, *, reasoning_open: bool, tools: Sequence[Mapping[str, Any]] | None
) -> Reply:
    """The whole reply ``text`` in ``style``: what ``reply_parser``'s events tell when fed it
    in one piece (and so, ids aside, in any pieces)."""
    return read_reply(reply_parser(style, reasoning_open=reasoning_open, tools=tools), text)
