"""The answer of a DeepSeek-V3.2 reply (after its reasoning): content and DSML tool calls,
read as the text arrives.

A call block is ``<｜DSML｜function_calls>`` (after the two newlines the chat format puts
before it, which are not content) holding ``<｜DSML｜invoke name="NAME">`` elements of
``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>``; ``string="true"``
marks a raw text value, ``"false"`` a JSON one. Whitespace between the tags is free, as
xgrammar's ``deepseek_v3_2`` structural tag allows it. Text after a block is content again.

A reply cut inside a block: a call whose name was read stays a call, its arguments closed as
``CallBody`` says; markup cut before an invoke's name is dropped."""

from __future__ import annotations

from typing import Literal

from dhisparse.tokenizer.answer_reader import AnswerReader
from dhisparse.tokenizer.encoding_dsv32 import (
    CALLS_CLOSE,
    CALLS_OPEN,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
)
from dhisparse.tokenizer.reply_types import ContentDelta, ReplyEvent, ToolCallBegin, new_call_id
from dhisparse.tokenizer.tool_call_body import CallBody, CallSyntax

BLOCK_OPENS = ("\n\n" + CALLS_OPEN, CALLS_OPEN)
NAME_OPEN = INVOKE_OPEN + ' name="'
NAME_CLOSE = '">'
DSML_CALL = CallSyntax(
    param_open=PARAM_OPEN + ' name="',
    key_ends={'" string="true">': True, '" string="false">': False},
    value_open="",
    value_close=PARAM_CLOSE,
    call_close=INVOKE_CLOSE + ">",
)


def _as_written(key: str, is_string: bool | None) -> bool:
    return is_string is True


class DsmlAnswer(AnswerReader):
    """Reads an answer's content and, when ``calls``, its DSML tool calls (otherwise the
    markup is content)."""

    def __init__(self, *, calls: bool) -> None:
        super().__init__()
        self._parse_calls = calls
        self._state: Literal["content", "block", "name"] = "content"

    def read_outside(self, out: list[ReplyEvent], *, final: bool) -> bool:
        if self._state == "content":
            if not self._parse_calls:
                text, tag = self.buf.take_all(), None
            else:
                text, tag = self.buf.take_until(BLOCK_OPENS, final=final)
            if text:
                out.append(ContentDelta(text))
            if tag is not None:
                self._state = "block"
            return bool(text) or tag is not None
        if self._state == "block":
            skipped, tag = self.buf.take_until([NAME_OPEN, CALLS_CLOSE], final=final)
            if tag == NAME_OPEN:
                self._state = "name"
            elif tag == CALLS_CLOSE:
                self._state = "content"
            return bool(skipped) or tag is not None
        found = self.buf.split([NAME_CLOSE])
        if found is None:
            return False
        out.append(ToolCallBegin(self.calls, new_call_id(), found[0]))
        self.open_body(CallBody(DSML_CALL, self.calls, _as_written))
        return True

    def body_closed(self) -> None:
        self._state = "block"
