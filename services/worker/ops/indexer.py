"""Lightning-indexer scores and the model's top-k selection."""

from __future__ import annotations

import torch

from services.worker.ops.fusion import fused
from services.worker.ops.select_topk_triton import MAX_WIDTH, select_topk_triton


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``I[t, s] = sum_h w[t, h] * relu(q[t, h] . keys[t, s])``.

    q: [T, H, D], w: [T, H], keys: [T, S, D] (per-query keys) or [S, D] (shared) -> [T, S] fp32.
    Computed in fp32 with reductions over fixed small dims so a query's scores do not depend on
    what else is in the batch.
    """
    q = q.float()
    keys = keys.float()
    if keys.dim() == 2:
        logits = torch.einsum("thd,sd->ths", q, keys)
    else:
        logits = torch.einsum("thd,tsd->ths", q, keys)
    return (logits.relu() * w.float().unsqueeze(-1)).sum(dim=1)


def select_topk(scores: torch.Tensor, num_visible: torch.Tensor, k: int) -> torch.Tensor:
    """The model's ordered top-k selection (``select_topk_ref``'s contract); fused, one kernel
    for rows of at most ``MAX_WIDTH`` scores (``select_topk_triton``)."""
    if fused(scores, "select_topk") and scores.shape[1] <= MAX_WIDTH:
        return select_topk_triton(scores, num_visible, k)
    return select_topk_ref(scores, num_visible, k)


def select_topk_ref(scores: torch.Tensor, num_visible: torch.Tensor, k: int) -> torch.Tensor:
    """The model's ordered top-k selection, in torch.

    scores: [T, S] fp32, num_visible: [T] (rows 0..num_visible-1 are visible to query t).
    Returns positions [T, k] int64 in selection order: score descending, ties broken by the
    lower position first; ``-1`` pads when fewer than k rows are visible.
    """
    t, s = scores.shape
    cols = torch.arange(s, device=scores.device)
    visible = cols.unsqueeze(0) < num_visible.unsqueeze(1)
    masked = scores.masked_fill(~visible, float("-inf"))
    # A stable descending sort keeps equal scores in ascending position order.
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices
    if s < k:
        order = torch.cat([order, order.new_full((t, k - s), -1)], dim=1)
    sel = order[:, :k].clone()
    rank = torch.arange(k, device=scores.device).unsqueeze(0)
    # masked_fill, not a boolean-mask assignment: no device sync, so a CUDA graph can hold it
    return sel.masked_fill_(rank >= num_visible.clamp(max=k).unsqueeze(1), -1)
