"""The loop shared by the answer parsers of the markup formats: text in, events out, a call's
body handed to its ``CallBody`` while one is open."""

from __future__ import annotations

from abc import ABC, abstractmethod

from dhisparse.tokenizer.reply_types import ReplyEvent
from dhisparse.tokenizer.text_buffer import TextBuffer
from dhisparse.tokenizer.tool_call_body import CallBody


class AnswerReader(ABC):
    """Reads an answer from ``buf`` step by step; a subclass reads what lies outside call
    bodies (``read_outside``) and opens a body with ``open_body``."""

    def __init__(self) -> None:
        self.buf = TextBuffer()
        self.calls = 0
        self._body: CallBody | None = None

    def feed(self, text: str) -> list[ReplyEvent]:
        """The events ``text`` releases."""
        self.buf.add(text)
        out: list[ReplyEvent] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[ReplyEvent]:
        """The events of the text held back; a call the answer ended inside is closed."""
        out: list[ReplyEvent] = []
        while self._step(out, final=True):
            pass
        if self._body is not None:
            self._body.cut()
            out += self._body.events
            self._body = None
        self.end_outside(out)
        return out

    def open_body(self, body: CallBody) -> None:
        self._body = body
        self.calls += 1

    @abstractmethod
    def read_outside(self, out: list[ReplyEvent], *, final: bool) -> bool:
        """Reads what it can outside a call body; whether it read anything."""

    def body_closed(self) -> None:
        """A call's body has been read up to and with its closing tag (by default nothing
        follows from it)."""
        return

    def end_outside(self, out: list[ReplyEvent]) -> None:
        """The answer has ended (outside any body); by default nothing is left to release."""
        return

    def _step(self, out: list[ReplyEvent], *, final: bool) -> bool:
        if self._body is None:
            return self.read_outside(out, final=final)
        read = self._body.step(self.buf, final=final)
        out += self._body.events
        self._body.events = []
        if self._body.done:
            self._body = None
            self.body_closed()
        return read
