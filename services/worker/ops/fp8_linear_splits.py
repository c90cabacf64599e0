"""Split-K of the FP8 matmul (``fp8_linear.py``): how many splits a launch takes, and the torch
form of the sum the kernel makes of them (with the device's arrival counters,
``arrivals.py``). Pure functions of the shape: a given shape always splits, and sums, in the
same order (deterministic, replayable in a CUDA graph)."""

from __future__ import annotations

import torch

from services.worker.ops.launch import TARGET_PROGRAMS


def k_splits(tiles_mn: int, k_blocks: int, interpret: bool, programs: int = TARGET_PROGRAMS) -> int:
    """How many K splits a launch of ``tiles_mn`` output tiles takes: enough programs for
    ``programs`` (decode shapes such as [576, 7168] have few output tiles and a long K), at
    most one per K block; one under the interpreter."""
    if interpret or tiles_mn >= programs:
        return 1
    return max(1, min(k_blocks, -(-programs // tiles_mn)))


def split_blocks(k_blocks: int, splits: int, k_step: int) -> tuple[int, int]:
    """``(splits, K blocks per split)`` for ``splits`` asked: the blocks per split a multiple
    of ``k_step``, and no split empty (so fewer splits than asked where K is short)."""
    per = -(-k_blocks // max(1, splits))
    per = k_step * -(-per // k_step)
    return -(-k_blocks // per), per


def sum_splits_ref(
    part: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The fused split-K sum in torch: ``0 + part[0] + part[1] + ...`` in split order, in fp32,
    then the bias, then the cast to ``dtype``; ``part [splits, M, N]`` -> ``[M, N]``. The
    kernel's order, one add at a time, so bit for bit what it writes."""
    acc = torch.zeros(part.shape[1:], dtype=torch.float32, device=part.device)
    for s in range(part.shape[0]):
        acc = acc + part[s]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(dtype)
