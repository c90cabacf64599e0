"""The indexer's ordered top-k by radix select (see ``select_topk_radix.py``, which launches
it), one program per query, over the order bits of its visible scores:

1. a histogram of the top 9 bits (the sign and the exponent: an octave per bin) finds the
   digit ``b`` of the k-th largest score;
2. one more pass writes the positions above ``b`` (all selected) to the output row, and those
   at ``b`` (the candidates, usually few) to the program's scratch row, in position order;
3. histograms of the next 8, 8 and 7 bits over the candidates find the k-th largest
   score's bits ``T``, and a last pass over them writes the candidates above ``T`` and the
   lowest-positioned ones equal to it (the ties the selection keeps) after the first ones;
4. the program sorts its k positions by the ``select_topk_kernel`` key (score descending,
   position ascending) in place.

Digits are at most 9 bits: ``tl.histogram`` costs each thread work in proportion to the bins a
warp's lane owns (bins / 32) for every element. Positions past the query's visible rows (or past ``S``) are never read; output ranks past
them are -1. Order bits: ``ord(score)``, the fp32 bits mapped to an unsigned order (sign bit
flipped for positives, all bits for negatives; -0.0 read as +0.0), held in int64.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ordered(s):
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0, as a sort compares them
    u = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF  # the bits, unsigned
    return tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)


@triton.jit
def _read(row_ptr, idx_ptr, start, n, INDIRECT: tl.constexpr, BLOCK: tl.constexpr):
    """(positions, their order bits, which are inside) of the ``start``-th block of the first
    n positions of the row, or, ``INDIRECT``, of the positions listed at ``idx_ptr``."""
    i = start + tl.arange(0, BLOCK)
    inside = i < n
    if INDIRECT:
        pos = tl.load(idx_ptr + i, mask=inside, other=0).to(tl.int64)
    else:
        pos = i.to(tl.int64)
    return pos, _ordered(tl.load(row_ptr + pos, mask=inside, other=0.0)), inside


@triton.jit
def _radix_level(
    row_ptr, idx_ptr, n, prefix, need, INDIRECT: tl.constexpr, HI: tl.constexpr,
    SHIFT: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Among the scores read whose order bits above ``HI`` equal ``prefix`` (``need`` of which
    the selection still takes), the digit of bits ``SHIFT .. SHIFT + log2(BINS)`` the k-th
    largest has -> (prefix extended by that digit, how many of ``need`` remain at it)."""
    hist = _histogram(row_ptr, idx_ptr, 0, n, prefix, INDIRECT, HI, SHIFT, BINS, BLOCK)
    return _pick(hist, prefix, need, BINS)


@triton.jit
def _histogram(
    row_ptr, idx_ptr, lo, hi, prefix, INDIRECT: tl.constexpr, HI: tl.constexpr,
    SHIFT: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The histogram of bits ``SHIFT ..`` of the scores read from ``lo`` to ``hi`` whose order
    bits above ``HI`` equal ``prefix``."""
    hist = tl.zeros([BINS], tl.int32)
    for start in range(lo, hi, BLOCK):
        _, o, inside = _read(row_ptr, idx_ptr, start, hi, INDIRECT, BLOCK)
        digit = ((o >> SHIFT) & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=inside & ((o >> HI) == prefix))
    return hist


@triton.jit
def _pick(hist, prefix, need, BINS: tl.constexpr):
    """(prefix extended by the digit of the ``need``-th largest of ``hist``, how many of
    ``need`` remain at that digit)."""
    bins = tl.arange(0, BINS)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching scores with digit >= b
    # at_least falls with b: the digit is the last b that still holds ``need`` scores (the
    # top bin when need is 0, which then selects nothing more)
    digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix.to(tl.int64) * BINS + digit, need - above


@triton.jit
def _partition(
    row_ptr, idx_ptr, n, SHIFT: tl.constexpr, pivot, gt_ptr, eq_ptr, eq_limit,
    INDIRECT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Writes the positions read whose order bits from ``SHIFT`` up are above ``pivot`` to
    ``gt_ptr[0..]`` and the first ``eq_limit`` equal to it to ``eq_ptr[0..]``, in read order
    -> how many were equal."""
    gt_seen = 0
    eq_seen = 0
    for start in range(0, n, BLOCK):
        pos, o, inside = _read(row_ptr, idx_ptr, start, n, INDIRECT, BLOCK)
        gt = (inside & ((o >> SHIFT) > pivot)).to(tl.int32)
        eq = (inside & ((o >> SHIFT) == pivot)).to(tl.int32)
        gt_slot = gt_seen + tl.cumsum(gt, 0) - gt
        eq_slot = eq_seen + tl.cumsum(eq, 0) - eq
        tl.store(gt_ptr + gt_slot, pos.to(gt_ptr.dtype.element_ty), mask=gt == 1)
        tl.store(eq_ptr + eq_slot, pos.to(eq_ptr.dtype.element_ty),
                 mask=(eq == 1) & (eq_slot < eq_limit))  # fmt: skip
        gt_seen += tl.sum(gt, 0)
        eq_seen += tl.sum(eq, 0)
    return eq_seen


@triton.jit
def select_topk_radix_kernel(
    scores_ptr, stride_scores, visible_ptr,
    out_ptr, stride_out,
    scratch_ptr, stride_scratch,
    S, K,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_scores
    out = out_ptr + t * stride_out
    cand = scratch_ptr + t * stride_scratch
    n = tl.minimum(tl.maximum(tl.load(visible_ptr + t), 0), S)
    take = tl.minimum(n, K)
    # 1-2: the top 9 bits over the whole row; the sure positions out, the candidates aside
    top, need = _radix_level(row, cand, n, tl.zeros([], tl.int64), take, False, 32, 23, 512,
                             BLOCK)  # fmt: skip
    c = _partition(row, cand, n, 23, top, out, cand, n, False, BLOCK)
    tl.debug_barrier()  # the candidates written above, by any thread, are visible below
    _finish(row, out, cand, c, top, need, take, K, BLOCK, BLOCK_K)


@triton.jit
def _finish(
    row, out, cand, c, top, need, take, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Steps 3 and 4: the ``c`` candidates listed at ``cand`` (in position order, their top
    bits ``top``; ``need`` of them selected) after the ``take - need`` sure positions at
    ``out``, then the ``take`` positions sorted into selection order (-1 up to ``K``)."""
    sure = take - need
    top, need = _radix_level(row, cand, c, top, need, True, 23, 15, 256, BLOCK)
    top, need = _radix_level(row, cand, c, top, need, True, 15, 7, 256, BLOCK)
    thr, need = _radix_level(row, cand, c, top, need, True, 7, 0, 128, BLOCK)
    _partition(row, cand, c, 0, thr, out + sure, out + take - need, need, True, BLOCK)
    tl.debug_barrier()  # every slot written above is visible below
    # 4: the k positions in selection order
    rank = tl.arange(0, BLOCK_K)
    chosen = rank < take
    pos = tl.load(out + rank, mask=chosen, other=0)
    o = _ordered(tl.load(row + pos, mask=chosen, other=0.0))
    # unchosen ranks take the smallest key (-2^63), below every chosen one (even -inf's)
    high = tl.where(chosen, o - 0x80000000, -0x80000000)
    key = high * 0x100000000 + tl.where(chosen, 0xFFFFFFFF - pos, 0)
    key = tl.sort(key, descending=True)
    pos = 0xFFFFFFFF - (key & 0xFFFFFFFF)
    tl.debug_barrier()  # every slot is read before any is rewritten
    tl.store(out + rank, tl.where(chosen, pos, -1), mask=rank < K)
