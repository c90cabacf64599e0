"""Sparse MQA attention over selected stored rows (MLA absorbed form, as FlashMLA's MQA mode:
keys are whole rows of d_kv elements, values their first d_v elements), optionally with a
learned sink per head (DeepSeek-V4: one more logit in each head's softmax that takes weight
and gives no value)."""

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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over its selected rows (and its local-window rows), one softmax.

    q: [N, H, d_kv]; pool: [S, d_kv]; locs: [N, k] int (``-1`` = padding), rows in selection
    order; win_pool: [W, d_kv]; win_locs: [N, w] int (``-1`` = padding); sinks: [H] fp32, each
    head's sink logit (on the scores' scale: after ``scale``). Every query must have at least
    one valid row. Returns [N, H, d_v] in q's dtype; accumulation is fp32.

    Queries run in blocks of ``block_queries`` (a long prefill's gathered rows would otherwise
    be materialised whole: N x k x d_kv); a query's result does not depend on the others."""
    n = q.shape[0]
    step = block_queries(locs.shape[1] + (0 if win_locs is None else win_locs.shape[1]),
                         q.shape[-1])  # fmt: skip
    if n <= step:
        return _attend(q, pool, locs, d_v, scale, win_pool, win_locs, sinks)
    out = q.new_empty(n, q.shape[1], d_v)
    for a in range(0, n, step):
        b = a + step
        wl = None if win_locs is None else win_locs[a:b]
        out[a:b] = _attend(q[a:b], pool, locs[a:b], d_v, scale, win_pool, wl, sinks)
    return out


# gathered fp32 elements per block of queries (about 16 MB: cache-sized on a CPU)
BLOCK_ELEMENTS = 1 << 22
MIN_BLOCK = 64  # decode batches and verify blocks run whole


def block_queries(rows: int, d_kv: int) -> int:
    """Queries per block of ``sparse_attention_ref`` for ``rows`` rows a query of ``d_kv``."""
    return max(MIN_BLOCK, BLOCK_ELEMENTS // max(rows * d_kv, 1))


def _rows(pool: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
    """pool's rows at ``locs`` [N, k] (padding reads row 0) -> [N, k, d]."""
    flat = pool.index_select(0, locs.clamp(min=0).flatten())
    return flat.view(*locs.shape, pool.shape[-1])


def _attend(
    q: torch.Tensor,
    pool: torch.Tensor,
    locs: torch.Tensor,
    d_v: int,
    scale: float,
    win_pool: torch.Tensor | None,
    win_locs: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    kv = _rows(pool, locs)  # [N, k, d_kv]
    valid = locs >= 0
    if win_locs is not None:
        assert win_pool is not None
        kv = torch.cat([kv, _rows(win_pool, win_locs)], dim=1)
        valid = torch.cat([valid, win_locs >= 0], dim=1)
    kvf = kv.float()
    scores = torch.einsum("nhd,nkd->nhk", q.float(), kvf) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhk,nkd->nhd", probs, kvf[..., :d_v])
    return out.to(q.dtype)
