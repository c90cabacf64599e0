"""The lightning indexer on the training side: batched scores over whole sequences, the
selection they imply, and the DSA distillation loss that trains the indexer.

Selection must match the inference path exactly: scores are the same sum over heads of
``w_h * relu(q_h . k_s)`` in fp32 (batched here instead of per request) and the top-k is
``ops.select_topk`` itself, ties to the lower position."""

from __future__ import annotations

import torch

from services.worker.ops import select_topk


def batched_index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``I[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . keys[b, s])``.

    q: [B, T, H, D], w: [B, T, H], keys: [B, S, D] -> [B, T, S] fp32 (under autocast the
    product runs in the autocast dtype). Equal to ``ops.index_scores`` per sequence."""
    b, t, h, d = q.shape
    logits = torch.bmm(q.float().reshape(b, t * h, d), keys.float().transpose(1, 2))
    logits = logits.view(b, t, h, -1)  # [B, T, H, S]
    return (logits.relu() * w.float().unsqueeze(-1)).sum(dim=2)


def causal_mask(t: int, device: torch.device, m: int = 1) -> torch.Tensor:
    """[T, T // m] bool: stored row s of a source packing m tokens per row is visible to the
    query at position t when its group is complete, ``s < (t + 1) // m`` (s <= t for m = 1)."""
    rows = torch.arange(t // m, device=device)
    return rows.unsqueeze(0) < ((torch.arange(t, device=device) + 1) // m).unsqueeze(1)


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool: token row p is in the local window of the query at t, ``t - W < p <= t``."""
    pos = torch.arange(t, device=device)
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    return (diff >= 0) & (diff < window)


def select_rows(scores: torch.Tensor, k: int, m: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference path's selection over a source packing m tokens per row, for whole
    sequences.

    scores: [B, T, S = T // m] -> selection [B, T, k] int64 (row positions in selection order,
    ``-1`` padding) and its mask [B, T, S] bool (True where a row is selected)."""
    b, t, s = scores.shape
    num_visible = ((torch.arange(t, device=scores.device) + 1) // m).repeat(b)
    sel = select_topk(scores.detach().reshape(b * t, s), num_visible, k)  # [B*T, k]
    mask = torch.zeros(b * t, s + 1, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, sel.masked_fill(sel < 0, s), True)  # padding lands in a spare column
    return sel.view(b, t, k), mask[:, :s].view(b, t, s)


@torch.no_grad()
def attention_target(
    q: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """The indexer's target: the main attention's probabilities summed over heads and
    renormalised over the allowed rows (DSA's dense warm-up distribution).

    q: [B, H, T, d_kv], rows: [B, S, d_kv], allowed: [B or 1, T, S] bool -> [B, T, S] fp32,
    zero outside ``allowed`` (and for a query that is allowed no row: a compressed source
    before its first complete group)."""
    logits = torch.matmul(q, rows.unsqueeze(1).transpose(-1, -2)).float() * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=1)  # [B, T, S]
    return p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Mean over queries of ``KL(target || softmax(scores))``, both over the allowed rows.

    target: [B, T, S] (a distribution over ``allowed``, zero elsewhere), scores: [B, T, S],
    allowed: [B or 1, T, S] bool -> [] fp32, >= 0. Queries allowed no row do not count."""
    some = allowed.any(dim=-1, keepdim=True)  # [B or 1, T, 1]
    x = scores.float().masked_fill(~allowed, float("-inf"))
    x = x.masked_fill(~some, 0.0)  # a query allowed nothing: finite, so no NaN (nor its grad)
    logq = torch.log_softmax(x, dim=-1).masked_fill(~allowed, 0.0)  # target is 0 there
    target = target.float()
    per_query = (torch.xlogy(target, target) - target * logq).sum(dim=-1)  # [B, T]
    counted = some.squeeze(-1).expand_as(per_query)
    return per_query[counted].mean() if counted.any() else per_query.sum() * 0.0
