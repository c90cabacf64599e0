"""The rows a pass completes and the widths it gathers at, as the host plans them
(``kv/pass_rows.py``), against a brute-force count of every position's group."""

from __future__ import annotations

import random

import pytest

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.pass_rows import (
    completion_bucket,
    key_rows,
    plan_completions,
    visible_width,
)
from services.worker.kv.pass_state import PassState


def _brute(starts, lens, rate) -> list[tuple[int, int]]:
    """(request, row) of every group whose last position a chunk covers."""
    return [
        (r, (p + 1) // rate - 1)
        for r, (s, n) in enumerate(zip(starts, lens, strict=True))
        for p in range(s, s + n)
        if (p + 1) % rate == 0
    ]


@pytest.mark.parametrize("pad", [False, True])
def test_planned_completions_are_every_completed_group_padded_by_repeats(pad: bool) -> None:
    rng = random.Random(3)
    for _ in range(200):
        r = rng.randint(1, 6)
        starts = tuple(rng.randint(0, 300) for _ in range(r))
        lens = tuple(rng.choice([1, 1, 2, 4, 5, 37]) for _ in range(r))
        done, flat = plan_completions(starts, lens, (4, 16, 128), "cpu", pad)
        for rate in (4, 16, 128):
            want = _brute(starts, lens, rate)
            if not want:
                assert rate not in done
                continue
            c = done[rate]
            pairs = list(zip(c.reqs.tolist(), c.rows.tolist(), strict=True))
            assert pairs[: len(want)] == want
            assert len(pairs) == (completion_bucket(len(want)) if pad else len(want))
            assert set(pairs[len(want) :]) <= {want[-1]}  # padding repeats the last entry
            assert c.reqs.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        if not done:
            assert flat is None


def test_buckets_and_widths_cover_their_counts_and_grow_rarely() -> None:
    assert [completion_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [0, 1, 2, 4, 8, 8, 16]
    prev = 0
    for rows in range(0, 5000):
        w = visible_width(rows)
        assert w >= max(1, rows) and w >= prev
        prev = w
    assert visible_width(27) == 32 and visible_width(300) == key_rows(300) == 512
    assert len({visible_width(n) for n in range(1, 257)}) == 9  # 1, 2, 4, ..., 256


def test_the_pass_state_plans_the_rates_its_batch_writes_and_keys_their_counts() -> None:
    """A pass writing every source plans each compressed rate's rows; an MTP-only pass (one
    uncompressed source) plans none. The graph key names the counts and the widths."""
    state = PassState(sources=((4, 0), (1, 0), (1, 1), (128, 0)))
    batch = ForwardBatch.build([0, 1, 2, 3], [3, 126, 9, 11], [1, 2, 1, 1], "cpu")
    state.begin(batch, [], None, ())
    assert sorted(state.completed) == [4, 128]
    four = state.completed_rows(4)
    assert four.rows.tolist() == [0, 31, 2, 2] and four.reqs.tolist() == [0, 1, 3, 3]
    assert state.completed_rows(128).rows.tolist() == [0]
    key = state.graph_key()
    assert ((4, 4), (128, 1)) in key
    mtp_only = ForwardBatch.build([0, 1], [3, 126], [1, 1], "cpu", sources=(2,))
    state.begin(mtp_only, [], None, ())
    assert state.completed == {} and state.completion_rows is None
