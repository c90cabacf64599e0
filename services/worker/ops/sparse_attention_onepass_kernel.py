"""The one-pass sparse MQA attention kernel: one program per (query token, block of HB heads,
split of the selected rows), every value column in the program, and each gathered block of
BLOCK_K rows loaded once for both products: its first DV columns (the values, the latent) are
the keys' first part and the values, the rest (the rope part) the keys' tail. The query's heads
are loaded once, before the rows. Rows come from a pool in the query's dtype, or, with
``FP8``, from packed FP8 rows (``fp8_kv_format.py``: e4m3 values in tiles of TILE with one
fp32 scale each, then the bf16 tail), dequantized in registers (exact, as ``fp8_gather``: by
the e4m3 bits in integer arithmetic, or with ``CAST`` by the device's fp8 conversion).
The local-window rows (in the query's dtype) go to the first split. Splits combine as in
``sparse_attention_kernel.py`` (its ``combine_partials``), by the last program to arrive with
``COMBINE``, else by the launcher (see ``sparse_attention_onepass.py``, which launches it);
with ``HAS_SINK`` the heads' sinks join the softmax once, as there (``with_sink`` for a single
split, the combine for several).

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import e4m3_value
from services.worker.ops.sparse_attention_kernel import combine_partials, softmax_step, with_sink


@triton.jit
def _accumulate(
    q_a, q_b, m_i, l_i, acc, pool_ptr, stride_pool, scale_ptr, stride_scale, tail_ptr,
    stride_tail, tail_off, locs_ptr, row_lo, row_hi, scale, DV, DT,
    DA: tl.constexpr, DB: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    TILE: tl.constexpr, CAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    offs_a = tl.arange(0, DA)
    amask = offs_a < DV
    offs_b = tl.arange(0, DB)
    bmask = offs_b < DT
    for start in range(row_lo, row_hi, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        loc = tl.load(locs_ptr + offs_k, mask=offs_k < row_hi, other=-1).to(tl.int64)
        valid = loc >= 0
        ma = valid[:, None] & amask[None, :]
        if FP8:
            byte = tl.load(pool_ptr + loc[:, None] * stride_pool + offs_a[None, :], mask=ma,
                           other=0)  # fmt: skip
            if CAST:  # the device's conversion (sm_89 on), exact as the bits' below
                v = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                v = e4m3_value(byte.to(tl.int32))
            bits = tl.load(scale_ptr + loc[:, None] * stride_scale + (offs_a // TILE)[None, :],
                           mask=ma, other=0)  # fmt: skip
            a = (v * bits.to(tl.float32, bitcast=True)).to(q_a.dtype)
        else:
            a = tl.load(pool_ptr + loc[:, None] * stride_pool + offs_a[None, :], mask=ma,
                        other=0.0)  # fmt: skip
        b = tl.load(
            tail_ptr + loc[:, None] * stride_tail + tail_off + offs_b[None, :],
            mask=valid[:, None] & bmask[None, :],
            other=0.0,
        ).to(q_b.dtype)  # [BLOCK_K, DB]
        s = tl.dot(q_a, tl.trans(a), input_precision=PREC)
        s += tl.dot(q_b, tl.trans(b), input_precision=PREC)
        p, alpha, m_new, l_i = softmax_step(s, valid, scale, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(a.dtype), a, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def sparse_attention_onepass_kernel(
    q_ptr, stride_qn, stride_qh,
    pool_ptr, stride_pool, scale_ptr, stride_scale, tail_ptr, stride_tail, tail_off,
    locs_ptr, stride_locs, K,
    win_pool_ptr, stride_win_pool,
    win_locs_ptr, stride_win_locs, W,
    out_ptr, stride_on, stride_oh,
    part_ptr, stride_pn, stride_ps, stride_ph, ml_ptr, count_ptr, sink_ptr,
    H, DV, DT, scale, ROWS_PER_SPLIT,
    HB: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, TILE: tl.constexpr, CAST: tl.constexpr, HAS_WIN: tl.constexpr,
    PREC: tl.constexpr,
    SPLIT: tl.constexpr, COMBINE: tl.constexpr, HAS_SINK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    row_lo = sp * ROWS_PER_SPLIT
    row_hi = tl.minimum(row_lo + ROWS_PER_SPLIT, K)
    offs_h = hb * HB + tl.arange(0, HB)
    hmask = offs_h < H
    offs_a = tl.arange(0, DA)
    amask = offs_a < DV
    offs_b = tl.arange(0, DB)
    q_heads = q_ptr + n * stride_qn + offs_h[:, None] * stride_qh
    q_a = tl.load(q_heads + offs_a[None, :], mask=hmask[:, None] & amask[None, :], other=0.0)
    q_b = tl.load(q_heads + DV + offs_b[None, :], mask=hmask[:, None] & (offs_b < DT)[None, :],
                  other=0.0)  # fmt: skip
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DA], tl.float32)
    m_i, l_i, acc = _accumulate(
        q_a, q_b, m_i, l_i, acc, pool_ptr, stride_pool, scale_ptr, stride_scale, tail_ptr,
        stride_tail, tail_off, locs_ptr + n * stride_locs, row_lo, row_hi, scale, DV, DT,
        DA, DB, BLOCK_K, FP8, TILE, CAST, PREC,
    )  # fmt: skip
    if HAS_WIN:
        # the window's rows (in the query's dtype) go to the first split
        m_i, l_i, acc = _accumulate(
            q_a, q_b, m_i, l_i, acc, win_pool_ptr, stride_win_pool, win_pool_ptr, 0,
            win_pool_ptr, stride_win_pool, DV, win_locs_ptr + n * stride_win_locs, 0,
            tl.where(sp == 0, W, 0), scale, DV, DT, DA, DB, BLOCK_K, False, TILE, CAST, PREC,
        )  # fmt: skip
    omask = hmask[:, None] & amask[None, :]
    if SPLIT:
        # partials: acc [N, S, H, DA] fp32, (max, denominator) [2, N, S, H] fp32
        part = part_ptr + n * stride_pn + offs_h[:, None] * stride_ph + offs_a[None, :]
        tl.store(part + sp * stride_ps, acc, mask=omask)
        splits = tl.num_programs(2)
        ml = ml_ptr + (n * splits + sp) * H + offs_h
        den_off = tl.num_programs(0) * splits * H
        tl.store(ml, m_i, mask=hmask)
        tl.store(ml + den_off, l_i, mask=hmask)
        if COMBINE:
            tile = count_ptr + n * tl.num_programs(1) + hb
            # release: this split's partials are visible before its arrival is counted
            if tl.atomic_add(tile, 1, sem="acq_rel") == splits - 1:
                combine_partials(
                    part, stride_ps, ml_ptr + n * splits * H + offs_h, den_off, sink_ptr + offs_h,
                    H, splits, omask, hmask, HB, DA, HAS_SINK,
                    out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_a[None, :],
                )  # fmt: skip
                tl.atomic_xchg(tile, 0)
    else:
        if HAS_SINK:
            acc, l_i = with_sink(acc, m_i, l_i, sink_ptr + offs_h, hmask)
        tl.store(
            out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_a[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=omask,
        )
