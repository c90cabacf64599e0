"""Sparse MQA attention over selected stored rows (MLA absorbed form, as FlashMLA's MQA mode:
keys are whole rows of d_kv elements, values their first d_v elements)."""

from __future__ import annotations

import torch


def sparse_attention_ref(
    q: torch.Tensor,
    pool: torch.Tensor,
    locs: torch.Tensor,
    d_v: int,
    scale: float,
    win_pool: torch.Tensor | None = None,
    win_locs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over its selected rows (and its local-window rows), one softmax.

    q: [N, H, d_kv]; pool: [S, d_kv]; locs: [N, k] int (``-1`` = padding), rows in selection
    order; win_pool: [W, d_kv]; win_locs: [N, w] int (``-1`` = padding). Every query must have
    at least one valid row. Returns [N, H, d_v] in q's dtype; accumulation is fp32.
    """
    kv = pool[locs.clamp(min=0)]  # [N, k, d_kv]
    valid = locs >= 0
    if win_locs is not None:
        assert win_pool is not None
        kv = torch.cat([kv, win_pool[win_locs.clamp(min=0)]], dim=1)
        valid = torch.cat([valid, win_locs >= 0], dim=1)
    kvf = kv.float()
    scores = torch.einsum("nhd,nkd->nhk", q.float(), kvf) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhk,nkd->nhd", probs, kvf[..., :d_v])
    return out.to(q.dtype)
