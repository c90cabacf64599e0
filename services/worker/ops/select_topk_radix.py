"""The indexer's ordered top-k selection (``select_topk``'s contract) by radix select: two
streaming passes over each query's visible scores (a histogram of the top 9 order bits, then
the split into sure positions and candidates), four over the candidates (8, 8 and 7 more bits,
their share) and one sort of k keys, in place of a sort of the whole row (``select_topk_ref``)
or one program's bitonic top-k of it (``select_topk_triton``, rows of up to ``KERNEL_WIDTH``).
Any width; the work per query grows with its visible scores, not with the launch's width.

One program per query (``select_topk_radix_kernel.py``), or, with ``RadixTiles.chunk``, the
two passes over the whole row split into chunks of that many scores, a program each
(``select_topk_radix_count_kernel.py``, ``select_topk_radix_split_kernel.py``), then one
program per query for the rest (``select_topk_radix_finish_kernel.py``): a batch of few
queries then reads its rows on many SMs. Fixed shapes and no host reads: a CUDA graph holds
either. Both give the same positions as the torch form, exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from services.worker.ops.select_topk_radix_count_kernel import select_topk_radix_count_kernel
from services.worker.ops.select_topk_radix_finish_kernel import select_topk_radix_finish_kernel
from services.worker.ops.select_topk_radix_kernel import select_topk_radix_kernel
from services.worker.ops.select_topk_radix_split_kernel import select_topk_radix_split_kernel


@dataclass(frozen=True)
class RadixTiles:
    """A program's shape: ``block`` scores per streamed step (a power of two), ``warps``;
    ``chunk``: scores per program of the two passes over the whole row (a multiple of
    ``block``), or 0 for one program per query throughout."""

    block: int = 4096
    warps: int = 8
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"block {self.block} must be a power of two >= 16")
        if self.chunk < 0 or self.chunk % self.block:
            raise ValueError(f"chunk {self.chunk} must be 0 or a multiple of {self.block}")


MAX_K = 4096  # the sorted selection is one program's registers
BINS = 512  # of the top 9 order bits; the split form's histogram row also holds a counter


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
    visible = num_visible.to(torch.int32).contiguous()
    scratch = torch.empty(t, s, dtype=torch.int32, device=scores.device)  # the candidates
    block_k = triton.next_power_of_2(k)
    if not tiles.chunk:
        select_topk_radix_kernel[(t,)](
            scores, scores.stride(0), visible, out, out.stride(0), scratch, scratch.stride(0),
            s, k, BLOCK=tiles.block, BLOCK_K=block_k, num_warps=tiles.warps,
        )  # fmt: skip
        return out
    chunks = triton.cdiv(s, tiles.chunk)
    hist = torch.zeros(t, BINS + 1, dtype=torch.int32, device=scores.device)
    counts = torch.empty(t, chunks, dtype=torch.int32, device=scores.device)
    shape = {"CHUNK": tiles.chunk, "BLOCK": tiles.block, "num_warps": tiles.warps}
    select_topk_radix_count_kernel[(t, chunks)](
        scores, scores.stride(0), visible, hist, hist.stride(0), s, **shape
    )  # fmt: skip
    rows = (hist, hist.stride(0), out, out.stride(0), scratch, scratch.stride(0), counts, s, k)
    select_topk_radix_split_kernel[(t, chunks)](scores, scores.stride(0), visible, *rows, **shape)
    select_topk_radix_finish_kernel[(t,)](
        scores, scores.stride(0), visible, *rows, chunks, BLOCK_K=block_k, **shape
    )  # fmt: skip
    return out
