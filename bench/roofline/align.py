"""Which kernel of an eager pass each kernel of a replayed graph is: a replayed graph's
kernels carry no record_function ranges, so their regions come from the same pass run eagerly
with ranges, matched by kernel name in order.

The match is a longest common subsequence of the two name sequences (Myers' O((N+M)D) diff,
exact while the sequences differ in at most ``MAX_EDITS`` kernels, which two runs of the same
pass do). Past that, ``difflib.SequenceMatcher``'s blocks (longest runs of equal names, no junk
heuristic) anchor the match and each stretch between two anchors is matched exactly again. A
kernel the graph runs that the eager pass does not (or the reverse) costs only itself."""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher

MAX_EDITS = 256


def align(eager: Sequence[str], graph: Sequence[str]) -> list[int | None]:
    """For each kernel name of ``graph``, the index in ``eager`` of the kernel it is, or None
    when it has none. Matches keep both orders and pair equal names only."""
    out: list[int | None] = [None] * len(graph)
    for i, j in _pairs(list(eager), list(graph)):
        out[j] = i
    return out


def _pairs(a: list[str], b: list[str]) -> list[tuple[int, int]]:
    exact = _myers(a, b, MAX_EDITS)
    if exact is not None:
        return exact
    out: list[tuple[int, int]] = []
    ea = eb = 0
    for blk in SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        gap = _myers(a[ea : blk.a], b[eb : blk.b], MAX_EDITS) or []
        out += [(ea + i, eb + j) for i, j in gap]
        out += [(blk.a + k, blk.b + k) for k in range(blk.size)]
        ea, eb = blk.a + blk.size, blk.b + blk.size
    return out


def _myers(a: list[str], b: list[str], max_d: int) -> list[tuple[int, int]] | None:
    """The pairs (i, j), a[i] == b[j], of a longest common subsequence, or None when the
    shortest edit script needs more than ``max_d`` insertions and deletions."""
    n, m = len(a), len(b)
    v = [0] * (2 * max_d + 3)  # furthest x on each diagonal k (negative k wraps around)
    trace: list[list[int]] = []
    for d in range(max_d + 1):
        trace.append(v[:])
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m)
    return None


def _backtrack(trace: list[list[int]], n: int, m: int) -> list[tuple[int, int]]:
    x, y = n, m
    pairs = []
    for d in range(len(trace) - 1, -1, -1):
        v = trace[d]
        k = x - y
        prev_k = k + 1 if k == -d or (k != d and v[k - 1] < v[k + 1]) else k - 1
        prev_x = v[prev_k]
        prev_y = prev_x - prev_k
        while x > prev_x and y > prev_y:  # the diagonal: equal names
            x, y = x - 1, y - 1
            pairs.append((x, y))
        x, y = prev_x, prev_y
    return pairs[::-1]
