"""The indexer's ordered top-k selection (``select_topk``'s contract) by radix select, one
program per query (``select_topk_radix_kernel.py``): two streaming passes over the query's
visible scores (a histogram of the top 11 order bits, then the split into sure positions and
candidates), three over the candidates (11 and 10 more bits, their share) and one sort of k
keys, in place of a sort of the whole row (``select_topk_ref``) or
one program's bitonic top-k of it (``select_topk_triton``, rows of up to ``KERNEL_WIDTH``). Any
width; the work per query grows with its visible scores, not with the launch's width. Fixed
shapes and no host reads: a CUDA graph holds it. Gives the same positions as the others,
exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from services.worker.ops.select_topk_radix_kernel import select_topk_radix_kernel


@dataclass(frozen=True)
class RadixTiles:
    """A program's shape: ``block`` scores per streamed step (a power of two), ``warps``."""

    block: int = 4096
    warps: int = 8

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"block {self.block} must be a power of two >= 16")


MAX_K = 4096  # the sorted selection is one program's registers


def select_topk_radix(
    scores: torch.Tensor, num_visible: torch.Tensor, k: int, tiles: RadixTiles | None = None
) -> torch.Tensor:
    """scores [T, S] fp32 (contiguous rows), num_visible [T] -> positions [T, k] int64: score
    descending, ties by the lower position, -1 past the visible rows (k may exceed S)."""
    t, s = scores.shape
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be fp32 with contiguous rows, not {scores.dtype}")
    if num_visible.shape != (t,):
        raise ValueError(f"num_visible {tuple(num_visible.shape)} does not match {t} queries")
    if not 0 <= k <= MAX_K:
        raise ValueError(f"k = {k}; one program sorts at most {MAX_K} positions")
    if s >= 2**31:
        raise ValueError(f"{s} scores per query; positions must fit 31 bits")
    tiles = tiles or RadixTiles()
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return out
    scratch = torch.empty(t, s, dtype=torch.int32, device=scores.device)  # the candidates
    select_topk_radix_kernel[(t,)](
        scores, scores.stride(0), num_visible.to(torch.int32).contiguous(),
        out, out.stride(0),
        scratch, scratch.stride(0),
        s, k,
        BLOCK=tiles.block, BLOCK_K=triton.next_power_of_2(k),
        num_warps=tiles.warps,
    )  # fmt: skip
    return out
