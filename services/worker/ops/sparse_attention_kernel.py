"""The sparse MQA attention kernel: one program per (query token, block of HB heads, split of the
selected rows and block of VB value columns), an online softmax over its split of the query's
rows gathered by location (each value block recomputes the split's scores), and
in the first split over the local-window rows too (see ``sparse_attention_triton.py``, which
launches it). With one split the program writes the normalised output; with more it writes its
split's running max, denominator and unnormalised accumulator, and with ``COMBINE`` the last
program of a (token, head block, value block) to arrive (``arrivals.py``) combines the splits in split order
into the output and resets its counter; without, the launcher combines them. With ``HAS_SINK``
each head's sink logit (fp32, on the scores' scale) joins the softmax's denominator once: in
the normalisation of a single split (``with_sink``), or in the combine of several (never in a
partial).

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_step(s, valid, scale, m_i, l_i):
    """One block of an online softmax: the block's scores ``s`` [heads, rows] (rows not
    ``valid`` masked), scaled, against the running max ``m_i`` and denominator ``l_i`` of
    the rows before -> (the block's weights p, the factor alpha that rescales what came
    before, the new max, the new denominator). A head with no valid row yet keeps max -inf
    and adds nothing."""
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(
    q_ptr, stride_qh, offs_h, hmask, m_i, l_i, acc, pool_ptr, stride_pool, locs_ptr, row_lo,
    row_hi, scale, D, offs_v, vmask, BLOCK_K: tl.constexpr, DC: tl.constexpr, HB: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    offs_c = tl.arange(0, DC)
    for start in range(row_lo, row_hi, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        loc = tl.load(locs_ptr + offs_k, mask=offs_k < row_hi, other=-1)
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
        p, alpha, m_new, l_i = softmax_step(s, valid, scale, m_i, l_i)
        vals = tl.load(
            pool_ptr + loc[:, None] * stride_pool + offs_v[None, :],
            mask=valid[:, None] & vmask[None, :],
            other=0.0,
        )  # [BLOCK_K, VB]
        acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def with_sink(acc, m_i, l_i, sinks, hmask):
    """A softmax's accumulator ``acc`` and denominator ``l_i`` over rows (running max ``m_i``)
    with the heads' sinks (at ``sinks``) joined as one more term: both rescaled to
    M = max(m_i, sink), the denominator plus ``e^(sink - M)``."""
    sink = tl.load(sinks, mask=hmask, other=0.0)
    top = tl.maximum(m_i, sink)
    w = tl.exp(m_i - top)
    return acc * w[:, None], l_i * w + tl.exp(sink - top)


@triton.jit
def combine_partials(
    part, stride_ps, ml, den_off, sinks, H, splits, mask, hmask, HB: tl.constexpr,
    VB: tl.constexpr, HAS_SINK: tl.constexpr, out,
):  # fmt: skip
    """The splits' partial softmaxes of one (token, head block, value block), in split order:
    ``sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) den_s + e^(sink - M))``, M the max over
    splits and, with ``HAS_SINK``, the heads' sinks at ``sinks`` (without, no sink term); a
    split that read no row has m = -inf and adds nothing."""
    top = tl.full([HB], float("-inf"), tl.float32)
    for s in range(0, splits):
        top = tl.maximum(top, tl.load(ml + s * H, mask=hmask, other=float("-inf")))
    if HAS_SINK:
        sink = tl.load(sinks, mask=hmask, other=0.0)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    num = tl.zeros([HB, VB], tl.float32)
    den = tl.zeros([HB], tl.float32)
    for s in range(0, splits):
        w = tl.exp(tl.load(ml + s * H, mask=hmask, other=float("-inf")) - top)
        den += tl.load(ml + den_off + s * H, mask=hmask, other=0.0) * w
        num += tl.load(part + s * stride_ps, mask=mask, other=0.0) * w[:, None]
    if HAS_SINK:
        den += tl.exp(sink - top)
    den = tl.where(hmask, den, 1.0)  # heads past H: nothing to divide
    tl.store(out, (num / den[:, None]).to(out.dtype.element_ty), mask=mask)


@triton.jit
def sparse_attention_kernel(
    q_ptr, stride_qn, stride_qh,
    pool_ptr, stride_pool,
    locs_ptr, stride_locs, K,
    win_pool_ptr, stride_win_pool,
    win_locs_ptr, stride_win_locs, W,
    out_ptr, stride_on, stride_oh,
    part_ptr, stride_pn, stride_ps, stride_ph, ml_ptr, count_ptr, sink_ptr,
    H, D, DV, scale, ROWS_PER_SPLIT, VBLOCKS,
    HB: tl.constexpr, DC: tl.constexpr, VB: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_WIN: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr,
    HAS_SINK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2) // VBLOCKS  # the program's split of the rows
    vb = tl.program_id(2) % VBLOCKS  # and its block of VB value columns
    row_lo = sp * ROWS_PER_SPLIT
    row_hi = tl.minimum(row_lo + ROWS_PER_SPLIT, K)
    offs_h = hb * HB + tl.arange(0, HB)
    hmask = offs_h < H
    offs_v = vb * VB + tl.arange(0, VB)
    vmask = offs_v < DV
    q_row = q_ptr + n * stride_qn
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, VB], tl.float32)
    m_i, l_i, acc = _accumulate(
        q_row, stride_qh, offs_h, hmask, m_i, l_i, acc, pool_ptr, stride_pool,
        locs_ptr + n * stride_locs, row_lo, row_hi, scale, D, offs_v, vmask, BLOCK_K, DC, HB,
        PREC,
    )  # fmt: skip
    if HAS_WIN:
        # the window's rows go to the first split; the others read no window row
        m_i, l_i, acc = _accumulate(
            q_row, stride_qh, offs_h, hmask, m_i, l_i, acc, win_pool_ptr, stride_win_pool,
            win_locs_ptr + n * stride_win_locs, 0, tl.where(sp == 0, W, 0), scale, D, offs_v,
            vmask, BLOCK_K, DC, HB, PREC,
        )  # fmt: skip
    if SPLIT:
        # partials: acc [N, S, H, >= DV] fp32, (max, denominator) [2, N, S, H] fp32; every
        # value block of a split stores the same max and denominator
        part = part_ptr + n * stride_pn + sp * stride_ps + offs_h[:, None] * stride_ph
        tl.store(part + offs_v[None, :], acc, mask=hmask[:, None] & vmask[None, :])
        splits = tl.num_programs(2) // VBLOCKS
        ml = ml_ptr + (n * splits + sp) * H + offs_h
        den_off = tl.num_programs(0) * splits * H
        tl.store(ml, m_i, mask=hmask)
        tl.store(ml + den_off, l_i, mask=hmask)
        if COMBINE:
            tile = count_ptr + (n * tl.num_programs(1) + hb) * VBLOCKS + vb
            # release: this split's partials are visible before its arrival is counted
            if tl.atomic_add(tile, 1, sem="acq_rel") == splits - 1:
                combine_partials(
                    part_ptr + n * stride_pn + offs_h[:, None] * stride_ph + offs_v[None, :],
                    stride_ps, ml_ptr + n * splits * H + offs_h, den_off, sink_ptr + offs_h, H,
                    splits, hmask[:, None] & vmask[None, :], hmask, HB, VB, HAS_SINK,
                    out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_v[None, :],
                )  # fmt: skip
                tl.atomic_xchg(tile, 0)
    else:
        if HAS_SINK:
            acc, l_i = with_sink(acc, m_i, l_i, sink_ptr + offs_h, hmask)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_v[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=hmask[:, None] & vmask[None, :],
        )
