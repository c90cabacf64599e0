"""The second of the block alignment's two kernels (``moe_align_triton.py``; the contract is
``MoEBlocks``' in ``moe_align.py``). Program ``e`` owns expert ``e``'s blocks: from every
expert's count (``moe_count_kernel.py``) it finds its first block, writes its pairs' ids in
ascending pair order (a running prefix count over chunks of the pair ids), fills its last
block's padding rows with ``n_pairs`` and writes its blocks' expert id. The last program also
fills the rows and blocks past every used one (``n_pairs`` rows, expert -1). The programs'
writes are disjoint, so no order among them matters. A Triton kernel file holds only the
kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_align_kernel(
    ids_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr,
    n_pairs, n_experts, n_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < n_experts, other=0)  # [BLOCK_E]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.sum(tl.where(offs_e < expert, blocks, 0), 0)
    count = tl.sum(tl.where(offs_e == expert, counts, 0), 0)
    n_own = (count + BLOCK_M - 1) // BLOCK_M
    first_row = first_block * BLOCK_M
    # the expert's pairs, ascending: a pair's row is first_row + (earlier pairs of the expert)
    seen = tl.full([], 0, tl.int32)
    for start in range(0, n_pairs, CHUNK):
        offs_p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs_p, mask=offs_p < n_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, 0) - 1 + seen
        tl.store(sorted_ids_ptr + first_row + rank, offs_p.to(tl.int32), mask=hit > 0)
        seen += tl.sum(hit, 0)
    # the padding rows of its last block
    offs_m = tl.arange(0, BLOCK_M)
    pad = first_row + count + offs_m
    pad_ids = tl.zeros([BLOCK_M], dtype=tl.int32) + n_pairs
    tl.store(sorted_ids_ptr + pad, pad_ids, mask=pad < first_row + n_own * BLOCK_M)
    for b in range(0, n_own, BLOCK_M):
        own = b + offs_m
        own_expert = tl.zeros([BLOCK_M], dtype=tl.int32) + expert
        tl.store(block_expert_ptr + first_block + own, own_expert, mask=own < n_own)
    if expert == n_experts - 1:
        used = first_block + n_own
        for b in range(used, n_blocks, BLOCK_M):
            offs_b = b + offs_m
            none = tl.full([BLOCK_M], -1, dtype=tl.int32)
            tl.store(block_expert_ptr + offs_b, none, mask=offs_b < n_blocks)
        for r in range(used * BLOCK_M, n_blocks * BLOCK_M, CHUNK):
            offs_r = r + tl.arange(0, CHUNK)
            rest_ids = tl.zeros([CHUNK], dtype=tl.int32) + n_pairs
            tl.store(sorted_ids_ptr + offs_r, rest_ids, mask=offs_r < n_blocks * BLOCK_M)
