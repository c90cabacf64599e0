"""Block alignment of the routed (token, choice) pairs for a grouped GEMM over experts, in the
manner of vLLM's ``moe_align_block_size``: the pairs sorted by expert, each expert's run padded
to a multiple of ``block_m`` rows, and one expert id per block of rows, all on the device.

Every shape depends only on (tokens, top_k, experts, block_m), never on the routing, and nothing
is read back to the host: the alignment can be captured in a CUDA graph and replayed with new
routing in the same buffers."""

from __future__ import annotations

from typing import NamedTuple

import torch


class MoEBlocks(NamedTuple):
    """The padded row order of a grouped GEMM.

    ``sorted_ids [max_blocks * block_m] int32``: the pair id (``token * top_k + choice``) of each
    padded row, experts in ascending order, pairs of one expert in ascending pair order; padding
    rows hold ``n_pairs``. ``block_expert [max_blocks] int32``: the expert of each block of
    ``block_m`` rows, or -1 for a block past the used ones (a kernel's program exits there)."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    n_pairs: int


def max_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """A static bound on the blocks any routing of ``n_pairs`` pairs uses: at most
    ``min(E, pairs)`` experts have pairs, each wasting at most ``block_m - 1`` padding rows, so
    ``sum_e ceil(c_e / block_m) <= (pairs + min(E, pairs) * (block_m - 1)) / block_m``."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


def align_blocks(idx: torch.Tensor, n_experts: int, block_m: int) -> MoEBlocks:
    """``idx [T, top_k]`` expert ids (int32 or int64, in ``[0, n_experts]``; ``n_experts``
    marks a pair of an expert held elsewhere, which no block takes) -> ``MoEBlocks`` on idx's
    device. Torch ops of static shape only: no ``nonzero``, ``bincount`` or ``.item()``."""
    dev = idx.device
    flat = idx.reshape(-1).to(torch.int64)  # [P]
    n_pairs = flat.numel()
    n_blocks = max_blocks(n_pairs, n_experts, block_m)
    rows = n_blocks * block_m
    order = torch.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)  # [E + 1]: + held elsewhere
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts[:n_experts] + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E] cumulative blocks
    pair_start = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position of each
    expert = flat[order]  # [P] ascending
    rank = torch.arange(n_pairs, device=dev) - pair_start[expert]  # position within its expert
    first_row = torch.cat([block_end - blocks, block_end.new_zeros(1)]) * block_m  # [E + 1]
    # pairs held elsewhere land on one row past the end, dropped
    padded_pos = torch.where(expert < n_experts, first_row[expert] + rank, rows)  # [P]
    sorted_ids = torch.full((rows + 1,), n_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, padded_pos, order.to(torch.int32))
    sorted_ids = sorted_ids[:rows]
    b = torch.arange(n_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, b, right=True)  # == E past the used blocks
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return MoEBlocks(sorted_ids, block_expert, block_m, n_pairs)
