"""Which kernel of an eager pass each kernel of a replayed graph is: a replayed graph's
kernels carry no record_function ranges, so their regions come from the same pass run eagerly
with ranges, matched by kernel name in order.

The match is ``difflib.SequenceMatcher``'s: the longest run of equal names, then the same on
each side of it, recursively, with no junk heuristic (repeated names, which a decoder's layers
are made of, must match like any other). A kernel the graph runs that the eager pass does not
(or the reverse) costs only itself, never its neighbours' match."""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher


def align(eager: Sequence[str], graph: Sequence[str]) -> list[int | None]:
    """For each kernel name of ``graph``, the index in ``eager`` of the kernel it is, or None
    when it has none. Matches keep both orders and pair equal names only."""
    out: list[int | None] = [None] * len(graph)
    sm = SequenceMatcher(None, list(eager), list(graph), autojunk=False)
    for b in sm.get_matching_blocks():
        for k in range(b.size):
            out[b.b + k] = b.a + k
    return out
