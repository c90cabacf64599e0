"""A reply's reasoning block, split from its answer as the text arrives.

The reasoning runs up to ``</think>``. It opens with the reply when the prompt ended inside a
reasoning block (``reasoning_open``), or when the reply itself opens one: ``<think>`` before
anything but whitespace. Markup inside the reasoning (a tool call written before ``</think>``)
is reasoning text: only the answer holds content and tool calls, as vLLM's GLM-4.7 parser
reads it and as xgrammar's structural tags constrain it (no tool-call markup in reasoning)."""

from __future__ import annotations

from typing import Literal

from dhisparse.tokenizer.text_buffer import TextBuffer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningSplitter:
    """Routes each piece of a reply to its reasoning or its answer, holding back only text that
    may still be ``<think>`` opening the reply or ``</think>`` closing the reasoning."""

    def __init__(self, *, reasoning_open: bool) -> None:
        self._state: Literal["start", "reasoning", "answer"] = (
            "reasoning" if reasoning_open else "start"
        )
        self._buf = TextBuffer()
        self._received = 0
        self._end = 0

    @property
    def reasoning_end(self) -> int:
        """The offset in the reply just past the reasoning's closing tag; while the reasoning is
        open, all the text received so far; 0 for a reply without reasoning."""
        return self._received if self._state == "reasoning" else self._end

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer): the text ``text`` releases to each; ``final``: no more text
        comes, so nothing is held back. The reasoning released precedes the answer released."""
        self._received += len(text)
        self._buf.add(text)
        if self._state == "start":
            rest = self._buf.text.lstrip()
            if rest.startswith(THINK_OPEN):
                self._buf.text = rest[len(THINK_OPEN) :]
                self._state = "reasoning"
            elif THINK_OPEN.startswith(rest) and not final:
                return "", ""
            else:
                self._state = "answer"
        if self._state == "answer":
            return "", self._buf.take_all()
        reasoning, closed = self._buf.take_until([THINK_CLOSE], final=final)
        if closed is None:
            return reasoning, ""
        self._state = "answer"
        self._end = self._received - len(self._buf.text)
        return reasoning, self._buf.take_all()
