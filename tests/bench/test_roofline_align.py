"""Giving a replayed graph's kernels the regions of an eager pass: the name alignment
(``bench/roofline/align.py``) on synthetic sequences, and the trace helpers that place kernels
in ranges and steps (``bench/roofline/trace.py``)."""

from __future__ import annotations

import random

from bench.roofline.align import align
from bench.roofline.trace import Kernel, Range, by_step, innermost

LAYER = ["norm", "gemm", "gemm", "rope", "topk", "attn", "gemm", "add"]


def test_identical_sequences_match_one_to_one() -> None:
    seq = LAYER * 3
    assert align(seq, seq) == list(range(len(seq)))


def test_an_inserted_kernel_is_unmatched_and_the_rest_keep_their_place() -> None:
    eager = LAYER * 2
    graph = [*LAYER[:3], "memcpy", *LAYER[3:], *LAYER]
    m = align(eager, graph)
    assert m[3] is None
    assert [j for j in m if j is not None] == list(range(len(eager)))


def test_a_deleted_kernel_leaves_a_gap_in_the_eager_side() -> None:
    eager = LAYER * 2
    graph = LAYER + LAYER[:4] + LAYER[5:]  # the second layer's topk gone
    m = align(eager, graph)
    assert None not in m
    assert len(graph) + 1 == len(eager) and 8 + 4 not in m
    assert m[8 + 4] == 8 + 5  # the attn after the gap is the eager attn


def test_repeated_names_pair_in_order_and_never_cross() -> None:
    eager = ["a", "b", "a", "b", "a"]
    graph = ["a", "a", "b", "a"]
    m = align(eager, graph)
    got = [j for j in m if j is not None]
    assert got == sorted(got) and len(set(got)) == len(got)
    assert all(eager[j] == graph[i] for i, j in enumerate(m) if j is not None)
    assert len(got) == 4  # every graph kernel has a counterpart


def test_unrelated_names_match_nothing() -> None:
    assert align(["x", "y"], ["p", "q", "r"]) == [None, None, None]
    assert align([], ["p"]) == [None]


def test_the_innermost_open_range_names_a_launch() -> None:
    spans = [Range("step", 0, 100), Range("attn", 10, 50), Range("attn.q_a_proj", 12, 20)]
    assert innermost(15, spans) == "attn.q_a_proj"
    assert innermost(30, spans) == "attn"
    assert innermost(60, spans) == "step"
    assert innermost(200, spans) is None and innermost(None, spans) is None


def test_kernels_are_split_by_the_step_their_launch_falls_in() -> None:
    ks = [Kernel("k", 1.0, s, launch) for s, launch in ((5, 1), (6, 2), (30, 25), (40, None))]
    steps, lost = by_step(ks, [Range("step", 0, 10), Range("step", 20, 30)])
    assert [len(s) for s in steps] == [2, 1] and lost == 1


def _lcs_length(a: list[str], b: list[str]) -> int:
    """The plain dynamic-programming reference."""
    d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            d[i + 1][j + 1] = d[i][j] + 1 if x == y else max(d[i][j + 1], d[i + 1][j])
    return d[-1][-1]


def test_the_match_is_a_longest_common_subsequence_over_random_sequences() -> None:
    r = random.Random(0)
    for _ in range(200):
        a = [r.choice("abc") for _ in range(r.randint(0, 14))]
        b = [r.choice("abc") for _ in range(r.randint(0, 14))]
        m = align(a, b)
        got = [j for j in m if j is not None]
        assert got == sorted(got) and len(set(got)) == len(got)
        assert all(a[j] == b[i] for i, j in enumerate(m) if j is not None)
        assert len(got) == _lcs_length(a, b)


def test_sequences_past_the_exact_edit_limit_still_align_their_common_runs() -> None:
    r = random.Random(1)
    eager = [f"k{r.randint(0, 9)}" for _ in range(600)]
    graph = [f"k{r.randint(0, 9)}" for _ in range(300)] + eager[100:400]
    m = align(eager, graph)
    assert m[300:] == list(range(100, 400))  # the shared run, whatever precedes it
