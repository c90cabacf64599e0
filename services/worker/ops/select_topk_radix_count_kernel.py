"""Step 1 of the split radix select (``select_topk_radix.py`` launches it with
``RadixTiles.chunk``): program (query, chunk) adds the histogram of the top 9 order bits of
its chunk of the query's visible scores to the query's row of ``hist`` (zeros before the
launch). The single-program form is ``select_topk_radix_kernel.py``.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.select_topk_radix_kernel import _histogram


@triton.jit
def select_topk_radix_count_kernel(
    scores_ptr, stride_scores, visible_ptr, hist_ptr, stride_hist, S,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * CHUNK
    n = tl.minimum(tl.maximum(tl.load(visible_ptr + t), 0), S)
    hi = tl.minimum(lo + CHUNK, n)
    if lo < hi:
        row = scores_ptr + t * stride_scores
        hist = _histogram(row, row, lo, hi, tl.zeros([], tl.int64), False, 32, 23, 512, BLOCK)
        bins = tl.arange(0, 512)
        tl.atomic_add(hist_ptr + t * stride_hist + bins, hist, mask=hist > 0, sem="relaxed")
