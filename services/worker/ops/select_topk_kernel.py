"""The indexer's ordered top-k of one query's scores in one program (see
``select_topk_triton.py``, which launches it): each visible score and its position packed into
one int64 key that orders by score descending, then position ascending, so Triton's bitonic
top-k of the keys is the selection in order; positions past the query's visible rows (or past
``K``) are -1.

Key: ``(ord(score) - 2^31) * 2^32 + (2^32 - 1 - position)``, ``ord`` the fp32 bits mapped to
an unsigned order (sign bit flipped for positives, all bits for negatives; -0.0 read as +0.0).
Invisible rows take the smallest high half, below every visible score (even -inf)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def select_topk_kernel(
    scores_ptr, stride_scores, visible_ptr,
    out_ptr, stride_out,
    S, K,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    visible = tl.load(visible_ptr + t)
    seen = (offs < visible) & (offs < S)
    s = tl.load(scores_ptr + t * stride_scores + offs, mask=seen, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0, as a sort compares them
    u = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF  # the bits, unsigned
    ordered = tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)
    high = tl.where(seen, ordered - 0x80000000, -0x80000000)
    key = high * 0x100000000 + (0xFFFFFFFF - offs.to(tl.int64))
    top = tl.topk(key, BLOCK_K)  # descending
    pos = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    rank = tl.arange(0, BLOCK_K)
    keep = rank < tl.minimum(tl.minimum(visible, S), K)
    tl.store(out_ptr + t * stride_out + rank, tl.where(keep, pos, -1), mask=rank < K)
