"""The indexer's ordered top-k by radix select (see ``select_topk_radix.py``, which launches
it): one program per query streams its visible scores three times to find, 11 + 11 + 10 bits
at a time by histogram, the k-th largest score's order bits ``T`` and how many of the k lie
strictly above it; a fourth pass writes the positions above ``T`` and the lowest-positioned
ones equal to it (the ties the selection keeps) into the output row; the program then sorts
those k positions by the ``select_topk_kernel`` key (score descending, position ascending) in
place. Positions past the query's visible rows (or past ``S``) are never read; output ranks
past them are -1.

Order bits: ``ord(score)``, the fp32 bits mapped to an unsigned order (sign bit flipped for
positives, all bits for negatives; -0.0 read as +0.0), held in int64.

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
def _radix_level(
    row_ptr, n, prefix, need, HI: tl.constexpr, SHIFT: tl.constexpr, BINS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Among the scores whose order bits above ``HI`` equal ``prefix`` (``need`` of which the
    selection still takes), the digit of bits ``SHIFT .. SHIFT + log2(BINS)`` the k-th largest
    has -> (prefix extended by that digit, how many of ``need`` remain at or below it)."""
    hist = tl.zeros([BINS], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        o = _ordered(tl.load(row_ptr + offs, mask=inside, other=0.0))
        match = inside & ((o >> HI) == prefix)
        digit = ((o >> SHIFT) & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=match)
    bins = tl.arange(0, BINS)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching scores with digit >= b
    # at_least falls with b: the digit is the last b that still holds ``need`` scores (the
    # top bin when need is 0, which then selects nothing more)
    digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix.to(tl.int64) * BINS + digit, need - above


@triton.jit
def select_topk_radix_kernel(
    scores_ptr, stride_scores, visible_ptr,
    out_ptr, stride_out,
    S, K,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_scores
    out = out_ptr + t * stride_out
    n = tl.minimum(tl.maximum(tl.load(visible_ptr + t), 0), S)
    take = tl.minimum(n, K)
    prefix, need = _radix_level(row, n, tl.zeros([], tl.int64), take, 32, 21, 2048, BLOCK)
    prefix, need = _radix_level(row, n, prefix, need, 21, 10, 2048, BLOCK)
    thr, need = _radix_level(row, n, prefix, need, 10, 0, 1024, BLOCK)
    # compaction: the scores above thr in slots 0.., the first ``need`` equal to it after them
    n_above = take - need
    above_seen = 0
    equal_seen = 0
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        o = _ordered(tl.load(row + offs, mask=inside, other=0.0))
        gt = (inside & (o > thr)).to(tl.int32)
        eq = (inside & (o == thr)).to(tl.int32)
        gt_slot = above_seen + tl.cumsum(gt, 0) - gt
        eq_rank = equal_seen + tl.cumsum(eq, 0) - eq
        keep_eq = (eq == 1) & (eq_rank < need)
        slot = tl.where(gt == 1, gt_slot, n_above + eq_rank)
        tl.store(out + slot, offs.to(tl.int64), mask=(gt == 1) | keep_eq)
        above_seen += tl.sum(gt, 0)
        equal_seen += tl.sum(eq, 0)
    tl.debug_barrier()  # the slots written above, by any thread, are visible below
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
