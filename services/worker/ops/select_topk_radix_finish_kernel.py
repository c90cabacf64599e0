"""Steps 3 and 4 of the split radix select (``select_topk_radix.py`` launches it with
``RadixTiles.chunk``), one program per query: its chunks' candidates
(``select_topk_radix_split_kernel.py``) moved together, in chunk order (so in position order),
to the start of the scratch row, then the rest of the bits over them and the sort of the k
positions, as the single-program kernel (``select_topk_radix_kernel.py``'s ``_finish``).

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.select_topk_radix_kernel import _finish, _pick


@triton.jit
def select_topk_radix_finish_kernel(
    scores_ptr, stride_scores, visible_ptr, hist_ptr, stride_hist,
    out_ptr, stride_out, scratch_ptr, stride_scratch, counts_ptr, S, K, CHUNKS,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(visible_ptr + t), 0), S)
    take = tl.minimum(n, K)
    hist = tl.load(hist_ptr + t * stride_hist + tl.arange(0, 512))
    top, need = _pick(hist, tl.zeros([], tl.int64), take, 512)
    cand = scratch_ptr + t * stride_scratch
    # each chunk's candidates down to the end of the ones before: a destination never passes
    # its source, and each block is read whole before it is written
    c = 0
    for p in range(0, CHUNKS):
        count = tl.load(counts_ptr + t * CHUNKS + p)
        for start in range(0, count, BLOCK):
            i = start + tl.arange(0, BLOCK)
            v = tl.load(cand + p * CHUNK + i, mask=i < count)
            tl.debug_barrier()
            tl.store(cand + c + i, v, mask=i < count)
            tl.debug_barrier()
        c += count
    _finish(scores_ptr + t * stride_scores, out_ptr + t * stride_out, cand, c, top, need, take,
            K, BLOCK, BLOCK_K)  # fmt: skip
