"""Indexer scores and the top-k selection's semantics: order, ties, visibility, padding."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops import index_scores, select_topk


def reference_select(scores: list[float], visible: int, k: int) -> list[int]:
    order = sorted(range(visible), key=lambda s: (-scores[s], s))
    return order[:k] + [-1] * max(0, k - visible)


@pytest.mark.parametrize("seed", range(5))
def test_select_topk_matches_definition(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t, s, k = 23, 57, 16
    # Few distinct values: many exact ties, which must break towards the lower position.
    scores = torch.randint(0, 6, (t, s), generator=g).float()
    visible = torch.randint(0, s + 1, (t,), generator=g)
    sel = select_topk(scores, visible, k)
    assert sel.shape == (t, k) and sel.dtype == torch.int64
    for i in range(t):
        assert sel[i].tolist() == reference_select(scores[i].tolist(), int(visible[i]), k)


def test_select_topk_short_history_pads() -> None:
    scores = torch.tensor([[3.0, 1.0, 2.0]])
    sel = select_topk(scores, torch.tensor([2]), 5)
    assert sel.tolist() == [[0, 1, -1, -1, -1]]


def test_invisible_rows_never_selected_even_with_top_scores() -> None:
    scores = torch.tensor([[0.0, 0.0, 9.0, 9.0]])
    assert select_topk(scores, torch.tensor([2]), 2).tolist() == [[0, 1]]


def test_index_scores_definition() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=g)
    w = torch.randn(3, 4, generator=g)
    keys = torch.randn(10, 8, generator=g)
    got = index_scores(q, w, keys)
    want = torch.zeros(3, 10)
    for t in range(3):
        for s in range(10):
            want[t, s] = sum(w[t, h] * torch.relu(q[t, h] @ keys[s]) for h in range(4))
    torch.testing.assert_close(got, want)
    per_query = index_scores(q, w, keys.unsqueeze(0).expand(3, -1, -1))
    torch.testing.assert_close(per_query, got)
