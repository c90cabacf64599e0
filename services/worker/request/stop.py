"""Incremental text and stop strings: text is released only once no stop string can still
begin inside it."""

from __future__ import annotations

from dhisparse.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0  # characters of detok.text already released

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Adds a token; returns (releasable text delta, the stop string that matched)."""
        self.detok.add(token_id)
        text = self.detok.text
        if self.stop:
            begin = max(0, self.emitted - self.hold)
            hits = [(text.find(s, begin), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                end = i + len(s) if self.include_stop else i
                delta = text[self.emitted : end]
                self.emitted = max(self.emitted, end)
                return delta, s
        safe = len(text) - self.hold
        if safe <= self.emitted:
            return "", None
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta, None

    def finish(self) -> str:
        """Releases the held-back text at the end of a generation not ended by a stop string."""
        self.detok.flush()
        delta = self.detok.text[self.emitted :]
        self.emitted = len(self.detok.text)
        return delta
