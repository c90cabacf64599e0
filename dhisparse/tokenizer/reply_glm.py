"""The answer of a GLM-4.7 / GLM-5 reply (after its reasoning): content and tool calls, read
as the text arrives, as vLLM's ``glm47`` tool parser reads them.

A call is ``<tool_call>NAME`` (the name ends at a newline, at the first ``<arg_key>`` or at
``</tool_call>`` for a call without arguments), then ``<arg_key>K</arg_key>`` ``<arg_value>V
</arg_value>`` pairs with free whitespace between the tags, then ``</tool_call>``. A value is a
string when the tool's JSON schema types that parameter ``"string"``; otherwise it is the JSON
it holds, or a string when it holds none (``CallBody``).

Content is each stretch of text between tool calls without its surrounding whitespace, as the
chat template writes it (``content.strip()``, a newline before each ``<tool_call>``), so
whitespace is held back only until text follows it. A reply cut inside a call: a call whose name
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


class _Stripped:
    """Releases stretches of text without their leading and trailing whitespace, holding back
    only whitespace that may yet be trailing."""

    def __init__(self) -> None:
        self._started = False
        self._space = ""

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = self._space + text
        kept = body.rstrip()
        self._space = body[len(kept) :]
        return kept

    def end(self) -> None:
        """Ends a stretch: the whitespace held back is dropped."""
        self._started = False
        self._space = ""


class GlmAnswer(AnswerReader):
    """Reads an answer's content and, when ``tools`` are given, its tool calls (otherwise the
    markup is content)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        super().__init__()
        self._tools = tuple(tools or ())
        self._content = _Stripped()
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
                self._content.end()
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

    def end_outside(self, out: list[ReplyEvent]) -> None:
        self._content.end()
