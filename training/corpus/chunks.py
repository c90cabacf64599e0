"""Cutting a long text into pieces that tokenize exactly as the whole does, so that one large
document does not keep the tokenizer's parallel batch on one thread.

A cut goes just before a newline that follows a printable ASCII non-space character. The
byte-level pre-tokenizer's pieces (GPT-2's pattern, no normalizer) never hold a newline
together with a non-space character, so a piece ends before that newline whatever comes after
the cut; the pattern looks ahead only, never behind, so the pieces from the newline on are
the same in the part as in the whole: the ids of the parts, concatenated, are the ids of the
whole. Special tokens contain no newline, so no cut splits one either.
"""

from __future__ import annotations

import re

CUT = re.compile(r"(?<=[!-~])(?=\n)")
PIECE_CHARS = 1 << 18


def cut(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` in consecutive pieces of at least ``size`` characters where a cut point
    follows (the last may be shorter, or longer when none does); ``"".join`` gives it back."""
    if size < 1:
        raise ValueError(f"piece size must be positive, got {size}")
    pieces = []
    start = 0
    while len(text) - start > size:
        m = CUT.search(text, start + size)
        if m is None:
            break
        pieces.append(text[start : m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces
