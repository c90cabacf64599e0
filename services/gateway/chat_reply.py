"""A chat choice's raw text as OpenAI's assistant message: reasoning, content and tool calls, whole
or as stream deltas, through the family's reply parser (``dhisparse.tokenizer.reply``).

The reasoning goes out under both ``reasoning_content`` (SGLang's and DeepSeek's name, which agent
clients read) and ``reasoning`` (vLLM's). A choice that called a tool and stopped finishes with
``tool_calls``; one cut by ``max_tokens`` keeps ``length``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dhisparse.tokenizer import Tokenizer
from dhisparse.tokenizer.reply import (
    ContentDelta,
    ReasoningDelta,
    Reply,
    ReplyEvent,
    ToolArgumentsDelta,
    ToolCallBegin,
    parse_reply,
    reply_parser,
)
from services.gateway.responses import (
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ResponseToolCall,
)


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's replies read: the family's ``style`` (None: plain text), whether the
    prompt left a reasoning block open, and the tools whose calls are parsed (None: none)."""

    style: str | None = None
    reasoning_open: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None

    @property
    def reads_markers(self) -> bool:
        """Whether the parser looks for the format's tags (reasoning or tool calls), which a
        tokenizer may hold as special tokens (so the worker's text must keep those)."""
        return self.style is not None and (self.reasoning_open or bool(self.tools))

    def whole(self, text: str) -> Reply:
        if self.style is None:
            return Reply(content=text, reasoning="", tool_calls=())
        return parse_reply(self.style, text, reasoning_open=self.reasoning_open, tools=self.tools)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


def finish_reason(reason: str | None, called: bool) -> str:
    """``tool_calls`` for a choice that called a tool and ended of itself."""
    if reason == "stop" and called:
        return "tool_calls"
    return reason or "abort"


def message(reply: Reply) -> ChatResponseMessage:
    """The non-streamed assistant message; ``content`` is null when a call stands alone."""
    calls = [
        ResponseToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in reply.tool_calls
    ]
    content: str | None = reply.content
    if calls and not content.strip():
        content = None
    reasoning = reply.reasoning or None
    return ChatResponseMessage(
        content=content,
        reasoning_content=reasoning,
        reasoning=reasoning,
        tool_calls=calls or None,
    )


def reasoning_tokens(tokenizer: Tokenizer, token_ids: Sequence[int], reasoning_chars: int) -> int:
    """How many of a reply's tokens its reasoning took: the fewest whose text covers the
    reasoning's ``reasoning_chars`` characters (its closing tag included)."""
    if reasoning_chars <= 0 or not token_ids:
        return 0
    lo, hi = 0, len(token_ids)
    while lo < hi:  # the least k with len(decode(ids[:k])) >= reasoning_chars
        mid = (lo + hi) // 2
        if len(tokenizer.decode(list(token_ids[:mid]))) >= reasoning_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


class ReplyStream:
    """One streamed choice: text deltas in, ``DeltaMessage``s out."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self._parser = (
            None
            if fmt.style is None
            else reply_parser(fmt.style, reasoning_open=fmt.reasoning_open, tools=fmt.tools)
        )
        self.called = False  # a tool call began

    @property
    def reasoning_end(self) -> int:
        """Where the reasoning ended in the text fed so far (``Reply.reasoning_end``)."""
        return 0 if self._parser is None else self._parser.reasoning_end

    def feed(self, text: str, *, last: bool) -> list[DeltaMessage]:
        """The deltas ``text`` releases (``last``: the choice's final text, so nothing is held)."""
        if self._parser is None:
            return [DeltaMessage(content=text)] if text else []
        events = self._parser.feed(text) if text else []
        if last:
            events += self._parser.finish()
        return self._deltas(events)

    def _deltas(self, events: Sequence[ReplyEvent]) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for e in events:
            if isinstance(e, ContentDelta):
                if out and out[-1].content is not None and out[-1].tool_calls is None:
                    out[-1].content += e.text
                else:
                    out.append(DeltaMessage(content=e.text))
            elif isinstance(e, ReasoningDelta):
                if out and out[-1].reasoning_content is not None:
                    out[-1].reasoning_content += e.text
                    out[-1].reasoning = out[-1].reasoning_content
                else:
                    out.append(DeltaMessage(reasoning_content=e.text, reasoning=e.text))
            elif isinstance(e, ToolCallBegin):
                self.called = True
                call = DeltaToolCall(
                    index=e.index, id=e.id, type="function",
                    function=FunctionCall(name=e.name, arguments=""),
                )  # fmt: skip
                out.append(DeltaMessage(tool_calls=[call]))
            elif isinstance(e, ToolArgumentsDelta):
                call = DeltaToolCall(index=e.index, function=FunctionCall(arguments=e.text))
                out.append(DeltaMessage(tool_calls=[call]))
        return out
