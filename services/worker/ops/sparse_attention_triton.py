"""Sparse MQA attention over selected rows, as a Triton kernel (decode and verification).

One program per (query token, block of heads): the query's rows are gathered from the pool by
location, BLOCK_K at a time, and an online softmax accumulates over them and then over its
local-window rows. Scores are accumulated over the row width in chunks of DC so that wide rows
(576 elements in GLM/DeepSeek MLA) stay within registers and shared memory; every head of the
block shares each gathered row (MQA), so a row is read once per head block. Matches
``sparse_attention_ref`` up to floating-point reassociation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accumulate(
    q_ptr, stride_qh, offs_h, hmask, m_i, l_i, acc, pool_ptr, stride_pool, locs_ptr, n_rows,
    scale, D, offs_v, vmask, BLOCK_K: tl.constexpr, DC: tl.constexpr, HB: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    offs_c = tl.arange(0, DC)
    for start in range(0, n_rows, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        loc = tl.load(locs_ptr + offs_k, mask=offs_k < n_rows, other=-1)
        valid = loc >= 0
        s = tl.zeros([HB, BLOCK_K], tl.float32)
        for d0 in range(0, D, DC):
            dmask = (d0 + offs_c) < D
            q = tl.load(
                q_ptr + offs_h[:, None] * stride_qh + (d0 + offs_c)[None, :],
                mask=hmask[:, None] & dmask[None, :],
                other=0.0,
            )  # [HB, DC]
            rows = tl.load(
                pool_ptr + loc[:, None] * stride_pool + (d0 + offs_c)[None, :],
                mask=valid[:, None] & dmask[None, :],
                other=0.0,
            )  # [BLOCK_K, DC]
            s += tl.dot(q, tl.trans(rows).to(q.dtype), input_precision=PREC)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vals = tl.load(
            pool_ptr + loc[:, None] * stride_pool + offs_v[None, :],
            mask=valid[:, None] & vmask[None, :],
            other=0.0,
        )  # [BLOCK_K, DVP]
        acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sparse_attention_kernel(
    q_ptr, stride_qn, stride_qh,
    pool_ptr, stride_pool,
    locs_ptr, stride_locs, K,
    win_pool_ptr, stride_win_pool,
    win_locs_ptr, stride_win_locs, W,
    out_ptr, stride_on, stride_oh,
    H, D, DV, scale,
    HB: tl.constexpr, DC: tl.constexpr, DVP: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_WIN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * HB + tl.arange(0, HB)
    hmask = offs_h < H
    offs_v = tl.arange(0, DVP)
    vmask = offs_v < DV
    q_row = q_ptr + n * stride_qn
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DVP], tl.float32)
    m_i, l_i, acc = _accumulate(
        q_row, stride_qh, offs_h, hmask, m_i, l_i, acc, pool_ptr, stride_pool,
        locs_ptr + n * stride_locs, K, scale, D, offs_v, vmask, BLOCK_K, DC, HB, PREC,
    )  # fmt: skip
    if HAS_WIN:
        m_i, l_i, acc = _accumulate(
            q_row, stride_qh, offs_h, hmask, m_i, l_i, acc, win_pool_ptr, stride_win_pool,
            win_locs_ptr + n * stride_win_locs, W, scale, D, offs_v, vmask, BLOCK_K, DC, HB,
            PREC,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_v[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & vmask[None, :],
    )


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
    _sparse_attention_kernel[grid](
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
