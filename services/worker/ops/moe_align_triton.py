"""``align_blocks`` (``moe_align.py``) as two Triton kernels: ``moe_count_kernel.py`` counts each
expert's pairs, ``moe_align_kernel.py`` places them; one program per expert in each, instead of
the torch form's ~30 kernels (a radix argsort among them). The output equals ``align_blocks``'
bit for bit (``MoEBlocks``' contract: the pairs of an expert in ascending pair order, so
nothing depends on the order of atomics or threads).

Each program reads every pair id, so the work grows as E x P: ``align`` takes the kernels up to
``FUSED_MAX_PAIRS`` pairs (every decode batch: 2048 tokens of top-8) and the torch form past
it, where its sort scales better; both give the same ``MoEBlocks``. Grids and buffers depend on
(P, E, block_m) alone and nothing is read back to the host: capturable in a CUDA graph."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.fusion import fused
from services.worker.ops.moe_align import MoEBlocks, align_blocks, max_blocks
from services.worker.ops.moe_align_kernel import moe_align_kernel
from services.worker.ops.moe_count_kernel import moe_count_kernel

FUSED_MAX_PAIRS = 16384
_CHUNK = 1024  # pair ids per step of a program's scan


def align_blocks_triton(idx: torch.Tensor, n_experts: int, block_m: int) -> MoEBlocks:
    """Same contract as ``align_blocks``: ``idx [T, top_k]`` int32 / int64 ids in
    ``[0, n_experts]`` (``n_experts``: held elsewhere, in no block) -> ``MoEBlocks``."""
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert ids must be int32 or int64, got {idx.dtype}")
    flat = idx.reshape(-1).contiguous()  # [P]
    n_pairs = flat.numel()
    n_blocks = max_blocks(n_pairs, n_experts, block_m)
    dev = idx.device
    sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    if n_blocks == 0:
        return MoEBlocks(sorted_ids, block_expert, block_m, n_pairs)
    counts = torch.empty(n_experts, dtype=torch.int32, device=dev)  # [E]
    moe_count_kernel[(n_experts,)](flat, counts, n_pairs, CHUNK=_CHUNK)
    moe_align_kernel[(n_experts,)](
        flat, counts, sorted_ids, block_expert,
        n_pairs, n_experts, n_blocks,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(n_experts), CHUNK=_CHUNK,
    )  # fmt: skip
    return MoEBlocks(sorted_ids, block_expert, block_m, n_pairs)


def align(idx: torch.Tensor, n_experts: int, block_m: int) -> MoEBlocks:
    """``align_blocks``' output: the kernels for a fused op of at most ``FUSED_MAX_PAIRS`` pairs,
    the torch form otherwise (the choice is by shape and device; the output is the same)."""
    if fused(idx, "moe_align") and idx.numel() <= FUSED_MAX_PAIRS:
        return align_blocks_triton(idx, n_experts, block_m)
    return align_blocks(idx, n_experts, block_m)
