"""One tool call's parameters in a markup format (DSML's ``parameter`` tags, GLM's
``arg_key``/``arg_value`` pairs), read as they arrive into the JSON text of its arguments.

The arguments are written as ``{"key": value, ...}`` (``json.dumps``'s separators). A string
parameter's value is the text between its tags as written (stripped where the format's
grammar counts whitespace around a value as formatting: ``strip_strings``), streamed as it
arrives. Any other
value is the JSON its text holds once whole (the text as written, stripped), or that stripped
text as a string when it is not JSON; it ends at the first closing tag outside its JSON strings
(a JSON string may hold the tag: xgrammar's grammars let it). Text between parameters other
than the tags is skipped.

A body cut short (the reply ended inside the call) still closes into a JSON object: a string
value keeps what arrived, a parameter whose non-string value never closed is left out."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from dhisparse.tokenizer.reply_types import ReplyEvent, ToolArgumentsDelta
from dhisparse.tokenizer.text_buffer import TextBuffer

# Whether a parameter's value is a string: from the parameter's name and what its key's closing
# tag said (DSML's string="true|false"; None where the tag says nothing).
StringRule = Callable[[str, bool | None], bool]


@dataclass(frozen=True)
class CallSyntax:
    """The tags of a call's body: a parameter opens with ``param_open``, its key ends with one
    of ``key_ends`` (each saying whether the value is a string, or None), its value lies
    between ``value_open`` (empty: right after the key) and ``value_close``; ``call_close``
    ends the call. ``strip_strings``: whitespace around a string value is formatting, not
    part of it (GLM's ``<arg_value>``, which xgrammar's grammar lets pad with whitespace)."""

    param_open: str
    key_ends: Mapping[str, bool | None]
    value_open: str
    value_close: str
    call_close: str
    strip_strings: bool = False


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def json_value(text: str) -> str:
    """The JSON text of a non-string value written as ``text``."""
    stripped = text.strip()
    try:
        json.loads(stripped, parse_constant=_not_json)
    except ValueError:
        return json.dumps(stripped, ensure_ascii=False)
    return stripped


def _inside_json_string(text: str) -> bool:
    """Whether ``text``, the start of a value, ends inside a JSON string of it (only a value
    that opens as an array, an object or a string has one)."""
    if text.lstrip()[:1] not in ('"', "[", "{"):
        return False
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and inside:
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _json_end(text: str, close: str) -> int:
    """Where the value at the start of ``text`` ends: the first ``close`` outside its JSON
    strings; -1 when none has arrived."""
    at = text.find(close)
    while at != -1 and _inside_json_string(text[:at]):
        at = text.find(close, at + 1)
    return at


def _string_part(text: str) -> str:
    """``text`` escaped as the inside of a JSON string (escaping is per character, so the
    parts of a string escape to the parts of its escape)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class CallBody:
    """Reads the body of the call ``index`` from a shared buffer, after its name and up to and
    with ``call_close``, telling its arguments as ``ToolArgumentsDelta``s (the first is ``{``)."""

    def __init__(self, syntax: CallSyntax, index: int, is_string: StringRule) -> None:
        self._syntax = syntax
        self._index = index
        self._is_string = is_string
        self._state: Literal["between", "key", "value_open", "string", "json", "done"] = "between"
        self._key = ""
        self._hint: bool | None = None
        self._written = 0
        self._value_began = False  # a string value's first character other than padding came
        self._held = ""  # a string value's trailing whitespace, written once text follows it
        self.events: list[ReplyEvent] = [ToolArgumentsDelta(index, "{")]

    @property
    def done(self) -> bool:
        return self._state == "done"

    def _write(self, text: str) -> None:
        self.events.append(ToolArgumentsDelta(self._index, text))

    def _write_key(self) -> None:
        comma = ", " if self._written else ""
        self._written += 1
        self._write(f"{comma}{json.dumps(self._key, ensure_ascii=False)}: ")

    def _open_value(self) -> None:
        if self._is_string(self._key, self._hint):
            self._write_key()
            self._write('"')
            self._state = "string"
            self._value_began, self._held = False, ""
        else:
            self._state = "json"

    def _write_string(self, text: str) -> None:
        """A part of a string value; under ``strip_strings`` its padding is left out."""
        if self._syntax.strip_strings:
            if not self._value_began:
                text = text.lstrip()
                self._value_began = bool(text)
            text = self._held + text
            kept = text.rstrip()
            self._held = text[len(kept) :]
            text = kept
        if text:
            self._write(_string_part(text))

    def _close(self) -> None:
        self._write("}")
        self._state = "done"

    def step(self, buf: TextBuffer, *, final: bool) -> bool:
        """Reads what it can of ``buf``; whether it read anything."""
        s = self._syntax
        if self._state == "between":
            skipped, tag = buf.take_until([s.param_open, s.call_close], final=final)
            if tag == s.call_close:
                self._close()
            elif tag == s.param_open:
                self._state = "key"
            return bool(skipped) or tag is not None
        if self._state == "key":
            found = buf.split([*s.key_ends, s.call_close])
            if found is None:
                return False
            key, tag = found
            if tag == s.call_close:
                self._close()
                return True
            self._key, self._hint = key.strip(), s.key_ends[tag]
            if s.value_open:
                self._state = "value_open"
            else:
                self._open_value()
            return True
        if self._state == "value_open":
            skipped, tag = buf.take_until([s.value_open, s.call_close], final=final)
            if tag == s.call_close:
                self._close()
            elif tag == s.value_open:
                self._open_value()
            return bool(skipped) or tag is not None
        if self._state == "string":
            text, tag = buf.take_until([s.value_close], final=final)
            if text:
                self._write_string(text)
            if tag is not None:
                self._write('"')
                self._state = "between"
            return bool(text) or tag is not None
        if self._state == "json":
            end = _json_end(buf.text, s.value_close)
            if end == -1:
                return False
            self._write_key()
            self._write(json_value(buf.text[:end]))
            buf.text = buf.text[end + len(s.value_close) :]
            self._state = "between"
            return True
        return False

    def cut(self) -> None:
        """Closes a body the reply ended inside (after ``step`` with ``final`` read it all)."""
        if self._state == "string":
            self._write('"')
        if self._state != "done":
            self._close()
