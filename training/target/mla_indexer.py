"""The indexer's side of the MLA training forward (``mla_forward``): its queries, weights and
keys as the inference path computes them, the top-k selection in chunks of queries, and the DSA
distillation loss (KL from the main attention's head-summed distribution to the softmax of the
index scores), per query, chunked and checkpointed so that nothing of size [B, T, H, T] is
kept at any T."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from services.worker.model.mla_indexer import DSAIndexer
from services.worker.model.rotary import Rotary
from services.worker.ops import select_topk
from training.target.indexer_loss import batched_index_scores


class Index(NamedTuple):
    """One producer's indexer over a batch of sequences (from detached inputs)."""

    q: torch.Tensor  # [B, T, H_index, d_index]
    w: torch.Tensor  # [B, T, H_index] fp32
    keys: torch.Tensor  # [B, T, d_index]


def index_inputs(
    indexer: DSAIndexer, x: torch.Tensor, q_latent: torch.Tensor, rotary: Rotary, b: int, t: int
) -> Index:
    """The indexer's queries, weights and keys of x [B*T, d] (and the q latent) as the
    inference path computes them; the weights in fp32 whatever autocast says, as serving
    keeps ``weights_proj`` (``FP32_PARAMS``)."""
    q, _ = indexer.queries(x, q_latent, rotary)
    with torch.autocast(x.device.type, enabled=False):
        w = F.linear(x.float(), indexer.weights_proj.weight.float()) * indexer.weight_scale
    keys = indexer.keys(x, x, rotary)  # its rows argument is not read
    return Index(q.view(b, t, *q.shape[1:]), w.view(b, t, -1), keys.view(b, t, -1))


def _scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, c, H, D], w [B, c, H], keys [B, S, D] -> [B, c, S] fp32 (autocast off)."""
    with torch.autocast(q.device.type, enabled=False):
        return batched_index_scores(q, w, keys)


@torch.no_grad()
def select(index: Index, k: int, per_chunk: int) -> torch.Tensor:
    """-> [B, T, k] each query's ordered top-k of its visible rows (``ops.select_topk``)."""
    b, t = index.q.shape[:2]
    out = []
    for a in range(0, t, per_chunk):
        e = min(t, a + per_chunk)
        scores = _scores(index.q[:, a:e], index.w[:, a:e], index.keys)  # [B, c, T]
        visible = torch.arange(a + 1, e + 1, device=scores.device).repeat(b)
        out.append(select_topk(scores.reshape(b * (e - a), t), visible, k).view(b, e - a, k))
    return torch.cat(out, dim=1)


def selection_mask(selection: torch.Tensor, t: int) -> torch.Tensor:
    """[B, T, k] row positions (-1 pads) -> [B, T, T] bool, True at the selected rows."""
    b = selection.shape[0]
    mask = torch.zeros(b, t, t + 1, dtype=torch.bool, device=selection.device)
    mask.scatter_(2, selection.masked_fill(selection < 0, t), True)  # pads: a spare column
    return mask[..., :t].contiguous()


def draw_queries(
    b: int, t: int, n: int | None, gen: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # fmt: skip
    """[B, n] int64: per sequence, n of the positions 0..T-1 drawn uniformly without
    replacement by ``gen`` (on its device), ascending; every position when n is None or >= T."""
    if n is None or n >= t:
        return torch.arange(t, device=device).expand(b, t)
    noise = torch.rand(b, t, generator=gen, device=gen.device if gen is not None else "cpu")
    return noise.argsort(dim=-1)[:, :n].sort(dim=-1).values.to(device)


def index_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    index: Index,
    mask: torch.Tensor | None,
    positions: torch.Tensor,
    scale: float,
    per_chunk: int,
) -> torch.Tensor:
    """The per-query KL [B, n] at ``positions`` [B, n] of one producer: q, k [B, H, T, d_qk]
    the main attention's (detached), mask its [B, T, T] selection (None: causal). Each chunk
    is checkpointed: only its inputs, which the pass holds anyway, are kept for backward."""
    inputs = (q, k, index.q, index.w, index.keys, mask)
    parts = []
    for a in range(0, positions.shape[1], per_chunk):
        pos = positions[:, a : a + per_chunk]
        parts.append(checkpoint(_chunk_kl, *inputs, pos, scale, use_reentrant=False))
    return torch.cat(parts, dim=1)


def _chunk_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    iq: torch.Tensor,
    iw: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """-> [B, c] the KL of the queries at pos [B, c]."""
    seq = torch.arange(q.shape[0], device=q.device).unsqueeze(1)  # [B, 1]
    t = k.shape[2]
    if mask is None:
        allowed = torch.arange(t, device=pos.device) <= pos.unsqueeze(-1)  # [B, c, T]
    else:
        allowed = mask[seq, pos]
    target = attention_target(q[seq, :, pos].transpose(1, 2), k, allowed, scale)
    return per_query_kl(target, _scores(iq[seq, pos], iw[seq, pos], keys), allowed)


@torch.no_grad()
def attention_target(
    q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, c, d], k [B, H, S, d], allowed [B, c, S] bool (at least one row a query) ->
    [B, c, S] fp32: the attention's probabilities summed over heads, renormalised over the
    allowed rows, zero elsewhere."""
    logits = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    p = torch.softmax(logits, dim=-1).sum(dim=1)
    return p / p.sum(dim=-1, keepdim=True)


def per_query_kl(target: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) of each query over its allowed rows: target, scores,
    allowed [B, c, S] (every query allowed at least one row) -> [B, c] fp32, >= 0. The same
    sum as ``indexer_loss.indexer_kl``, per query."""
    logq = torch.log_softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1)
    logq = logq.masked_fill(~allowed, 0.0)  # the target is 0 there
    return (torch.xlogy(target, target) - target * logq).sum(dim=-1)
