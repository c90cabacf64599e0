"""The first of the block alignment's two kernels (``moe_align_triton.py``): program ``e``
counts the pairs routed to expert ``e``, scanning all pair ids in chunks of ``CHUNK``, and
writes ``counts[e]`` (int32). A Triton kernel file holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_count_kernel(ids_ptr, counts_ptr, n_pairs, CHUNK: tl.constexpr):
    expert = tl.program_id(0)
    total = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, n_pairs, CHUNK):
        offs_p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs_p, mask=offs_p < n_pairs, other=-1)
        total += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(total, 0))
