"""Parsing a DeepSeek-V3.2 completion back into an assistant message: the inverse of
``encoding_dsv32``'s assistant turn (reasoning, content, DSML tool calls)."""

from __future__ import annotations

import re
from typing import Any

from dhisparse.tokenizer.encoding_dsv32 import (
    BOS,
    CALLS_CLOSE,
    CALLS_OPEN,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    ThinkingMode,
    to_json,
)


class _Cursor:
    """Reads a completion from left to right."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    @property
    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def until(self, *stops: str) -> tuple[str, str | None]:
        """The text up to the nearest of ``stops`` and that stop, both consumed (the earlier
        of two stops found at one place); the rest and None when no stop follows."""
        best, found = len(self.text), None
        for stop in stops:
            at = self.text.find(stop, self.pos)
            if at != -1 and at < best:
                best, found = at, stop
        read = self.text[self.pos : best]
        self.pos = best + len(found) if found else len(self.text)
        return read, found


_CALL_NAME = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAMETER = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"not a DeepSeek-V3.2 completion: {what}")


def _match(pattern: re.Pattern[str], text: str, what: str) -> re.Match[str]:
    found = pattern.match(text)
    if found is None:
        raise ValueError(f"not a DeepSeek-V3.2 completion: {what}")
    return found


def _parse_calls(cur: _Cursor) -> list[dict[str, Any]]:
    """The invokes after ``\\n\\n<｜DSML｜function_calls``, up to and with its closing tag."""
    calls = []
    while not cur.at_end:
        gap, stop = cur.until(INVOKE_OPEN, CALLS_CLOSE)
        _expect(gap == ">\n", "text between tool calls")
        if stop == CALLS_CLOSE:
            break
        _expect(stop is not None, "an unclosed tool call block")
        head, stop = cur.until(PARAM_OPEN, INVOKE_CLOSE)
        name = _match(_CALL_NAME, head, "a tool call without its name").group(1)
        args: dict[str, tuple[str, bool]] = {}
        while stop == PARAM_OPEN:
            # Up to the closing tag less its '<', which the pattern takes as the value's end.
            body, _ = cur.until(PARAM_CLOSE[1:-1])
            key, is_string, value = _match(_PARAMETER, body, "a malformed parameter").groups()
            _expect(key not in args, f"parameter {key!r} given twice")
            args[key] = (value, is_string == "true")
            gap, stop = cur.until(PARAM_OPEN, INVOKE_CLOSE)
            _expect(gap == ">\n", "text between parameters")
        arguments = ", ".join(
            f"{to_json(k)}: {to_json(v) if is_string else v}" for k, (v, is_string) in args.items()
        )
        calls.append(
            {"type": "function", "function": {"name": name, "arguments": f"{{{arguments}}}"}}
        )
    return calls


def parse_completion(text: str, thinking_mode: ThinkingMode) -> dict[str, Any]:
    """The assistant message of a completion (generated text up to and with its EOS): role,
    content, reasoning_content and OpenAI-style tool_calls (``arguments`` as JSON text; a
    string parameter's value as written, any other as the JSON it was written as). Only
    well-formed completions parse; anything else is a ValueError."""
    cur = _Cursor(text)
    tools_start = "\n\n" + CALLS_OPEN[:-1]
    reasoning = ""
    if thinking_mode == "thinking":
        reasoning, stop = cur.until(THINK_CLOSE, tools_start)
        _expect(stop == THINK_CLOSE, "the reasoning does not end with </think>")
    content, stop = cur.until(EOS, tools_start)
    calls: list[dict[str, Any]] = []
    if stop == tools_start:
        calls = _parse_calls(cur)
        trailing, stop = cur.until(EOS)
        _expect(not trailing, "text after the tool calls")
    else:
        _expect(stop == EOS, "no end of sentence")
    _expect(cur.at_end, "text after the end of sentence")
    for special in (BOS, EOS, THINK_OPEN, THINK_CLOSE, DSML):
        _expect(special not in content and special not in reasoning, f"{special} in the text")
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": calls,
    }
