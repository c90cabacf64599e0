"""Lightning-indexer scores and the model's top-k selection."""

from __future__ import annotations

import torch

from services.worker.ops.fusion import fused
from services.worker.ops.select_topk_radix import MAX_K, RadixTiles, select_topk_radix
from services.worker.ops.select_topk_triton import MAX_WIDTH, select_topk_triton

# from this many queries a launch, wider rows take radix select (``select_topk_radix``): with
# fewer, torch's sort of the whole row is as fast at k = 2048 (``python -m bench select-topk``)
RADIX_QUERIES = 16
# a row of more scores than this is read in chunks of it, a program each; a chunked row of one
# chunk would only add the chunks' bookkeeping
RADIX_CHUNK = 16384


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
    """The model's ordered top-k selection (``select_topk_ref``'s contract), the same positions
    whichever form computes it. Fused: one kernel for rows of at most ``MAX_WIDTH`` scores
    (``select_topk_triton``); wider rows by radix select from ``RADIX_QUERIES`` queries (rows
    of up to ``RADIX_CHUNK`` scores one program per query, wider ones in chunks of it across
    programs); else the torch form. The choice is a function of the shapes only."""
    t, s = scores.shape
    if fused(scores, "select_topk"):
        if s <= MAX_WIDTH:
            return select_topk_triton(scores, num_visible, k)
        if t >= RADIX_QUERIES and k <= MAX_K and scores.stride(1) == 1:
            tiles = RadixTiles(8192, 16) if s <= RADIX_CHUNK else RadixTiles(4096, 8, RADIX_CHUNK)
            return select_topk_radix(scores, num_visible, k, tiles)
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
