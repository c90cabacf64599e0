"""DSpark's confidence scheduler: widths are prefixes chosen by survival within the budget,
and the greedy rule is optimal for expected accepted tokens (checked by brute force)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.speculative.confidence import ConfidenceScheduler, CostCurve, survival


def _expected_tokens(surv: list[list[float]], widths: list[int]) -> float:
    return sum(1 + sum(s[: w - 1]) for s, w in zip(surv, widths, strict=True))


@settings(max_examples=80, deadline=None)
@given(
    conf=st.lists(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), min_size=1, max_size=3),
    caps=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    extra=st.integers(0, 9),
)
def test_greedy_is_optimal_within_the_budget(
    conf: list[list[float]], caps: list[int], extra: int
) -> None:
    r = len(conf)
    caps = caps[:r]
    budget = r + extra
    c = torch.tensor(conf, dtype=torch.float64)
    widths = ConfidenceScheduler(token_budget=budget).widths(c, caps)
    assert all(1 <= w <= k for w, k in zip(widths, caps, strict=True))
    assert sum(widths) <= budget
    surv = survival(c).tolist()
    best = max(
        _expected_tokens(surv, list(ws))
        for ws in itertools.product(*(range(1, k + 1) for k in caps))
        if sum(ws) <= budget
    )
    assert _expected_tokens(surv, widths) == pytest.approx(best, abs=1e-9)


def test_confident_requests_get_wider_blocks() -> None:
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.1, 0.9, 0.9, 0.9]])
    # survivals: .9 .81 .73 .66 | .5 .25 .. | .1 .09 ..: the 5 extra tokens go 4 + 1 + 0
    assert ConfidenceScheduler(token_budget=8).widths(conf, [5, 5, 5]) == [5, 2, 1]
    # No budget: everything within the caps; a survival floor cuts the tails.
    assert ConfidenceScheduler().widths(conf, [5, 3, 2]) == [5, 3, 2]
    assert ConfidenceScheduler(min_survival=0.3).widths(conf, [5, 5, 5]) == [5, 2, 1]
    with pytest.raises(ValueError):
        ConfidenceScheduler(token_budget=2).widths(conf, [5, 5, 5])


def test_cost_curve_stops_where_throughput_peaks() -> None:
    conf = torch.full((2, 7), 0.6)
    # Free verification up to 6 tokens, then each token costs as much as a whole pass: the
    # best round verifies exactly 6 (2 anchors + 4 proposals).
    cost = CostCurve(((6, 1.0), (7, 2.0)))
    widths = ConfidenceScheduler(cost=cost).widths(conf, [8, 8])
    assert sum(widths) == 6 and sorted(widths) == [3, 3]
    # A flat curve admits everything; a steep one nothing beyond the anchors.
    assert ConfidenceScheduler(cost=CostCurve(((1, 1.0),))).widths(conf, [8, 8]) == [8, 8]
    steep = CostCurve(((2, 1.0), (3, 10.0)))
    assert ConfidenceScheduler(cost=steep).widths(conf, [8, 8]) == [1, 1]


def test_cost_curve_interpolates() -> None:
    c = CostCurve(((4, 1.0), (8, 2.0), (16, 2.5)))
    assert c(1) == 1.0 and c(6) == 1.5 and c(12) == 2.25 and c(24) == 3.0
    with pytest.raises(ValueError):
        CostCurve(((4, 1.0), (4, 2.0)))
