"""A producer layer's selection (eq. 1): each query token's ordered top-k of the rows of its
source that it sees, scored by the indexer over the index-key cache, the same way for decode
steps, verify rounds and prefill chunks (DeepSeek-V4.1: inside the pass's candidate blocks,
``candidate_blocks``)."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.pass_rows import key_rows
from services.worker.kv.workspace import SCORE_BLOCK, SHORT_CHUNK
from services.worker.model.candidate_blocks import ScoreStep
from services.worker.ops import index_scores, select_topk
from services.worker.ops.fusion import fused
from services.worker.serving.cache import KVCache


def select_rows(
    cfg: ModelConfig,
    i: int,
    q: torch.Tensor,
    w: torch.Tensor,
    batch: ForwardBatch,
    kv: KVCache,
    s: int,
    step: ScoreStep | None = None,
) -> torch.Tensor:
    """[N, k] ordered top-k row positions per query token of producer ``i`` over its visible
    rows of source ``s``, from the indexer's queries q [N, H, d_index] and weights w [N, H].
    ``step``: applied to the scores before the top-k (a candidate source's or consumer's)."""
    k = cfg.index_topk
    src = cfg.sources[s]
    m, lag = src.compress, src.lag
    # complete rows at or before each query
    num_visible = (
        ((batch.positions + 1 - lag) // m).clamp(min=0) if lag else (batch.positions + 1) // m
    )
    # the host knows how far each request sees: no read-back
    ends = [cfg.rows_for_tokens(s, e) for e in batch.ends()]
    n, width = batch.num_tokens, key_rows(max(ends))

    def top(scores: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if step is not None:
            scores = step(scores, num_visible[a:b], slice(a, b), n, width)
        return select_topk(scores, num_visible[a:b], k)

    if batch.is_decode:
        return top(kv.index_keys.decode_scores(i, q, w, batch.slots, num_visible, width), 0, n)
    if max(batch.lens) <= SHORT_CHUNK:  # verify rounds: every request at once
        # at the bucketed width, as a decode pass: a captured verify pass keeps its shapes
        if fused(q, "index_scores"):
            # each query token scored as a decode query of its request's slot, by the decode
            # pass's kernel: no [R, K, H, S] intermediate, and the scores a decode pass gives
            scores = kv.index_keys.decode_scores(i, q, w, batch.token_slot, num_visible, width)
        else:
            scores = short_chunk_scores(i, q, w, batch, kv, num_visible, width)
        return top(scores, 0, n)
    out = torch.empty(n, k, dtype=torch.int64, device=q.device)
    cu = batch.cu
    for r in range(batch.num_requests):
        a, b = cu[r], cu[r + 1]
        keys = kv.index_keys.gather(i, batch.slots[r : r + 1], num_visible[b - 1 : b], ends[r])
        for c in range(a, b, SCORE_BLOCK):
            e = min(b, c + SCORE_BLOCK)
            out[c:e] = top(index_scores(q[c:e], w[c:e], keys[0]), c, e)
    return out


def short_chunk_scores(
    i: int,
    q: torch.Tensor,
    w: torch.Tensor,
    batch: ForwardBatch,
    kv: KVCache,
    num_visible: torch.Tensor,
    max_visible: int,
) -> torch.Tensor:
    """[N, S] index scores of every token of a batch of short chunks: each request's queries,
    padded to the longest chunk, against its own keys in one batched product (the same
    per-query reduction as ``index_scores``). ``max_visible``: S, at least the most rows any
    request sees (keys beyond a request's rows are zero; top-k masks them)."""
    # each request's keys up to what its last (most-seeing) token sees: [R, S, D]
    seen = num_visible[batch.last_token_index]
    return chunk_scores(q, w, batch, kv.index_keys.gather(i, batch.slots, seen, max_visible))


def chunk_scores(
    q: torch.Tensor, w: torch.Tensor, batch: ForwardBatch, keys: torch.Tensor
) -> torch.Tensor:
    """[N, S] scores of ``batch``'s query tokens (q [N, H, D], w [N, H]) against their
    requests' keys [R, S, D], all requests in one fp32 product over queries padded to the
    longest chunk."""
    keys = keys.float()
    col = torch.arange(batch.num_tokens, device=q.device) - batch.cu_lens[batch.token_req]
    shape = (batch.num_requests, max(batch.lens))
    qp = q.new_zeros(*shape, *q.shape[1:]).float()
    qp[batch.token_req, col] = q.float()
    wp = w.new_zeros(*shape, w.shape[1]).float()
    wp[batch.token_req, col] = w.float()
    logits = torch.einsum("rkhd,rsd->rkhs", qp, keys)
    scores = (logits.relu() * wp.unsqueeze(-1)).sum(dim=2)  # [R, Kmax, S]
    return scores[batch.token_req, col]
