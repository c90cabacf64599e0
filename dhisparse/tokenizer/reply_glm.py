"""The answer of a GLM-4.7 / GLM-5 reply (after its reasoning): content and tool calls, read
as the text arrives, as vLLM's ``glm47`` tool parser reads them.

A call is ``<tool_call>NAME`` (the name ends at a newline, at the first ``<arg_key>`` or at
``</tool_call>`` for a call without arguments), then ``<arg_key>K</arg_key>`` ``<arg_value>V
</arg_value>`` pairs with free whitespace between the tags, then ``</tool_call>``. A value is a
string when the tool's JSON schema types that parameter ``"string"``; otherwise it is the JSON
it holds, or a string when it holds none (``CallBody``).

Content is the answer's text as written but for the whitespace that separates it from a tool
call (the chat template writes a newline before each ``<tool_call>``), so whitespace is held
back only until text, a call or the end follows it. A reply cut inside a call: a call whose name
was read stays a call, its arguments closed as ``CallBody`` says; one cut before its name ends
is dropped, like a nameless call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from dhisparse.tokenizer.answer_reader import AnswerReader
from dhisparse.tokenizer.reply_types import ContentDelta, ReplyEvent, ToolCallBegin, new_call_id
from dhisparse.tokenizer.tool_call_body import CallBody, CallSyntax

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
ARG_KEY = "<arg_key>"
NAME_ENDS = ("\n", ARG_KEY, CALL_CLOSE)
GLM_CALL = CallSyntax(
    param_open=ARG_KEY,
    key_ends={"</arg_key>": None},
    value_open="<arg_value>",
    value_close="</arg_value>",
    call_close=CALL_CLOSE,
    strip_strings=True,
)


def string_parameters(tools: Sequence[Mapping[str, Any]], name: str) -> frozenset[str]:
    """The parameters of the tool ``name`` whose schema types them ``"string"`` (OpenAI's
    tool shape: ``{"type": "function", "function": {"name", "parameters"}}``)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") != name:
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        return frozenset(
            key
            for key, schema in properties.items()
            if isinstance(schema, Mapping) and schema.get("type") == "string"
        )
    return frozenset()


class _Content:
    """Releases the answer's text as written but for the whitespace that only separates it
    from a tool call: the whitespace before ``<tool_call>`` and after ``</tool_call>``. Only
    whitespace that may yet precede a call is held back."""

    def __init__(self) -> None:
        self._after_call = False  # the stretch follows a call: its leading whitespace goes
        self._space = ""

    def add(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = self._space + text
        kept = body.rstrip()
        self._space = body[len(kept) :]
        return kept

    def before_call(self) -> None:
        """A call follows: the whitespace held back is dropped."""
        self._space = ""

    def after_call(self) -> None:
        self._after_call = True

    def end(self) -> str:
        """The answer has ended: the whitespace held back, which no call follows."""
        space, self._space = self._space, ""
        return space


class GlmAnswer(AnswerReader):
    """Reads an answer's content and, when ``tools`` are given, its tool calls (otherwise the
    markup is content)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        super().__init__()
        self._tools = tuple(tools or ())
        self._content = _Content()
        self._state: Literal["content", "name", "nameless"] = "content"

    def read_outside(self, out: list[ReplyEvent], *, final: bool) -> bool:
        if self._state == "content":
            if not self._tools:
                text, tag = self.buf.take_all(), None
            else:
                text, tag = self.buf.take_until([CALL_OPEN], final=final)
            kept = self._content.add(text)
            if kept:
                out.append(ContentDelta(kept))
            if tag is not None:
                self._content.before_call()
                self._state = "name"
            return bool(text) or tag is not None
        if self._state == "nameless":
            skipped, tag = self.buf.take_until([CALL_CLOSE], final=final)
            if tag is not None:
                self._state = "content"
            return bool(skipped) or tag is not None
        self.buf.skip_space()
        found = self.buf.find(NAME_ENDS)
        if found is None:
            return False
        at, end = found
        name = self.buf.text[:at].strip()
        self.buf.text = self.buf.text[at + (len(end) if end == "\n" else 0) :]
        if not name:
            self._state = "nameless"
            return True
        strings = string_parameters(self._tools, name)
        out.append(ToolCallBegin(self.calls, new_call_id(), name))
        self.open_body(CallBody(GLM_CALL, self.calls, lambda key, _: key in strings))
        return True

    def body_closed(self) -> None:
        self._state = "content"
        self._content.after_call()

    def end_outside(self, out: list[ReplyEvent]) -> None:
        space = self._content.end()
        if space:
            out.append(ContentDelta(space))
