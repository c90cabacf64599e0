"""Text that arrives in pieces, read up to markers that a piece may split anywhere."""

from __future__ import annotations

from collections.abc import Sequence


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers`` without
    completing it: what must wait for more text before it can be read as plain text."""
    held = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:k]):
                held = k
                break
    return held


class TextBuffer:
    """The text received and not yet read."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, text: str) -> None:
        self.text += text

    def find(self, markers: Sequence[str]) -> tuple[int, str] | None:
        """Where the first of ``markers`` starts and which it is (the longest of those starting
        there); None when none is whole in the text."""
        best: tuple[int, str] | None = None
        for marker in markers:
            at = self.text.find(marker)
            if at != -1 and (
                best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))
            ):
                best = (at, marker)
        return best

    def split(self, markers: Sequence[str]) -> tuple[str, str] | None:
        """The text before the first of ``markers`` and that marker, both read; None (nothing
        read) when no marker is whole in the text yet."""
        found = self.find(markers)
        if found is None:
            return None
        at, marker = found
        before, self.text = self.text[:at], self.text[at + len(marker) :]
        return before, marker

    def take_until(self, markers: Sequence[str], *, final: bool) -> tuple[str, str | None]:
        """Like ``split``; when no marker is whole, the text that cannot begin one (all of it
        when ``final``: no more text comes) and None."""
        found = self.split(markers)
        if found is not None:
            return found
        keep = 0 if final else partial_marker(self.text, markers)
        cut = len(self.text) - keep
        out, self.text = self.text[:cut], self.text[cut:]
        return out, None

    def skip_space(self) -> None:
        self.text = self.text.lstrip()

    def take_all(self) -> str:
        out, self.text = self.text, ""
        return out
