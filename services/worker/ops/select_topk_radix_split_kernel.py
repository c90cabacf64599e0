"""Step 2 of the split radix select (``select_topk_radix.py`` launches it with
``RadixTiles.chunk``): program (query, chunk) reads the digit of the k-th largest score's top
9 order bits from the query's histogram (``select_topk_radix_count_kernel.py``), writes its
chunk's positions above that digit (all selected) to the output row at slots it takes from the
query's counter (any order: the selection is sorted last), and those at the digit (the
candidates), in position order, to the start of its chunk's span of the scratch row, with
their count.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.select_topk_radix_kernel import _pick, _read


@triton.jit
def select_topk_radix_split_kernel(
    scores_ptr, stride_scores, visible_ptr, hist_ptr, stride_hist,
    out_ptr, stride_out, scratch_ptr, stride_scratch, counts_ptr, S, K,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    lo = p * CHUNK
    n = tl.minimum(tl.maximum(tl.load(visible_ptr + t), 0), S)
    hi = tl.minimum(lo + CHUNK, n)
    hist = tl.load(hist_ptr + t * stride_hist + tl.arange(0, 512))
    top, _ = _pick(hist, tl.zeros([], tl.int64), tl.minimum(n, K), 512)
    row = scores_ptr + t * stride_scores
    out = out_ptr + t * stride_out
    cand = scratch_ptr + t * stride_scratch + lo
    sure_counter = hist_ptr + t * stride_hist + 512  # past the bins: the slots taken
    eq_seen = 0
    for start in range(lo, hi, BLOCK):
        pos, o, inside = _read(row, row, start, hi, False, BLOCK)
        gt = (inside & ((o >> 23) > top)).to(tl.int32)
        eq = (inside & ((o >> 23) == top)).to(tl.int32)
        base = tl.atomic_add(sure_counter, tl.sum(gt, 0), sem="relaxed")
        tl.store(out + base + tl.cumsum(gt, 0) - gt, pos, mask=gt == 1)
        tl.store(cand + eq_seen + tl.cumsum(eq, 0) - eq, pos.to(tl.int32), mask=eq == 1)
        eq_seen += tl.sum(eq, 0)
    tl.store(counts_ptr + t * tl.num_programs(1) + p, eq_seen)
