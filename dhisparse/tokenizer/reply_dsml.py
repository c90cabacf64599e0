"""The answer of a DeepSeek-V3.2, DeepSeek-V4 or DeepSeek-V4.1 reply (after its reasoning):
content and DSML tool calls, read as the text arrives.

A call block (a ``CallBlock``: ``<｜DSML｜function_calls>`` for V3.2, ``<｜DSML｜tool_calls>`` for V4,
``<｜DSML｜ calls>`` for V4.1, whose element tags are spaced alike, after the two newlines the
chat formats put before it, which are not content) holds
``<｜DSML｜invoke name="NAME">`` elements of
``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>``; ``string="true"``
marks a raw text value, ``"false"`` a JSON one. Whitespace between the tags is free, as
xgrammar's ``deepseek_v3_2``, ``deepseek_v4`` and ``deepseek_v4_1`` structural tags allow it. Text after a block is
content again.

A reply cut inside a block: a call whose name was read stays a call, its arguments closed as
``CallBody`` says; markup cut before an invoke's name is dropped."""

from __future__ import annotations

from typing import Literal

from dhisparse.tokenizer.answer_reader import AnswerReader
from dhisparse.tokenizer.dsml import CallBlock
from dhisparse.tokenizer.reply_types import ContentDelta, ReplyEvent, ToolCallBegin, new_call_id
from dhisparse.tokenizer.tool_call_body import CallBody, CallSyntax

NAME_CLOSE = '">'


def call_syntax(block: CallBlock) -> CallSyntax:
    """The body of an invoke in ``block``'s tags: its parameters, then its closing tag."""
    return CallSyntax(
        param_open=block.param_open + ' name="',
        key_ends={'" string="true">': True, '" string="false">': False},
        value_open="",
        value_close=block.param_close,
        call_close=block.invoke_close + ">",
    )


def _as_written(key: str, is_string: bool | None) -> bool:
    return is_string is True


class DsmlAnswer(AnswerReader):
    """Reads an answer's content and, when ``calls``, its DSML tool calls in ``block``s
    (otherwise the markup is content)."""

    def __init__(self, block: CallBlock, *, calls: bool) -> None:
        super().__init__()
        self._block = block
        self._name_open = block.invoke_open + ' name="'
        self._syntax = call_syntax(block)
        self._opens = ("\n\n" + block.open, block.open)
        self._parse_calls = calls
        self._state: Literal["content", "block", "name"] = "content"

    def read_outside(self, out: list[ReplyEvent], *, final: bool) -> bool:
        if self._state == "content":
            if not self._parse_calls:
                text, tag = self.buf.take_all(), None
            else:
                text, tag = self.buf.take_until(self._opens, final=final)
            if text:
                out.append(ContentDelta(text))
            if tag is not None:
                self._state = "block"
            return bool(text) or tag is not None
        if self._state == "block":
            skipped, tag = self.buf.take_until([self._name_open, self._block.close], final=final)
            if tag == self._name_open:
                self._state = "name"
            elif tag == self._block.close:
                self._state = "content"
            return bool(skipped) or tag is not None
        found = self.buf.split([NAME_CLOSE])
        if found is None:
            return False
        out.append(ToolCallBegin(self.calls, new_call_id(), found[0]))
        self.open_body(CallBody(self._syntax, self.calls, _as_written))
        return True

    def body_closed(self) -> None:
        self._state = "block"
