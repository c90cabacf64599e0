"""Sparse MQA attention over selected rows, as a Triton kernel (decode and verification).

One program per (query token, block of heads): the query's rows are gathered from the pool by
location, BLOCK_K at a time, and an online softmax accumulates over them and then over its
local-window rows. Scores are accumulated over the row width in chunks of DC so that wide rows
(576 elements in GLM/DeepSeek MLA) stay within registers and shared memory; every head of the
block shares each gathered row (MQA), so a row is read once per head block. Matches
``sparse_attention_ref`` up to floating-point reassociation. The kernel itself is
``sparse_attention_kernel.py``; this module checks shapes and picks the grid."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.sparse_attention_kernel import sparse_attention_kernel


def sparse_attention_triton(
    q: torch.Tensor,
    pool: torch.Tensor,
    locs: torch.Tensor,
    d_v: int,
    scale: float,
    win_pool: torch.Tensor | None = None,
    win_locs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``sparse_attention_ref``: q [N, H, d_kv], pool [S, d_kv], locs [N, k]
    int (-1 pads), optional win_pool [W, d_kv] / win_locs [N, w] -> [N, H, d_v]."""
    n, h, d = q.shape
    if pool.shape[1] != d or locs.shape[0] != n:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, pool {tuple(pool.shape)}, "
                         f"locs {tuple(locs.shape)}")  # fmt: skip
    if pool.stride(1) != 1 or q.stride(2) != 1:
        raise ValueError("pool rows and query heads must be contiguous")
    locs = locs.contiguous()
    has_win = win_locs is not None
    if has_win:
        assert win_pool is not None
        win_locs = win_locs.contiguous()
    else:
        win_pool, win_locs = pool, locs  # unused
    out = torch.empty(n, h, d_v, dtype=q.dtype, device=q.device)
    hb = max(16, min(64, triton.next_power_of_2(h)))  # tl.dot needs >= 16 rows on a GPU
    grid = (n, triton.cdiv(h, hb))
    sparse_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        pool, pool.stride(0),
        locs, locs.stride(0), locs.shape[1],
        win_pool, win_pool.stride(0),
        win_locs, win_locs.stride(0), win_locs.shape[1] if has_win else 0,
        out, out.stride(0), out.stride(1),
        h, d, d_v, scale,
        HB=hb, DC=64, DVP=triton.next_power_of_2(d_v), BLOCK_K=32, HAS_WIN=has_win,
        # fp32 models get fp32 products (no TF32), so they match the reference closely.
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_stages=2,
    )  # fmt: skip
    return out
