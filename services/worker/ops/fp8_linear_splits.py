"""Split-K of the FP8 matmul (``fp8_linear.py``): how many splits a launch takes, the arrival
counters with which the kernel sums the splits itself, and the torch form of that sum. Pure
functions of the shape: a given shape always splits, and sums, in the same order
(deterministic, replayable in a CUDA graph)."""

from __future__ import annotations

import torch

from services.worker.ops.launch import TARGET_PROGRAMS

# The most output tiles a launch with several K splits may have: the size of the split-K
# arrival counters (``make_split_counters``). ``Tiles.split_programs`` stays within
# it, so a default split launch always fits.
MAX_SPLIT_TILES = 1024


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


def make_split_counters(device: torch.device) -> torch.Tensor:
    """A zeroed ``[MAX_SPLIT_TILES] int32`` buffer of split-K arrival counters for ``device``.

    Contract: the fused split-K sum leaves every counter it uses at zero when its launch ends,
    so the buffer is zero between launches; launches that share a buffer must not overlap in
    time. Launches issued to one stream serialize (so do the kernels of one graph replay), so a
    buffer is safe for any number of launches in one stream's order; work on concurrent
    streams takes one buffer per stream, or per owner whose calls are ordered (``FP8Linear``
    owns one). Made outside graph capture: a buffer allocated while capturing would belong to
    that graph's memory pool and outlive it here."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "split-K counters are made outside CUDA graph capture: run the op once eagerly "
            "(warm-up) before capturing it"
        )
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


# One buffer per device for callers that pass none: every launch that uses it must be issued
# in one stream order (``make_split_counters``'s contract).
_DEVICE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def device_split_counters(device: torch.device) -> torch.Tensor:
    """The buffer of ``device`` for callers that pass none (made on first use)."""
    if device not in _DEVICE_COUNTERS:
        _DEVICE_COUNTERS[device] = make_split_counters(device)
    return _DEVICE_COUNTERS[device]


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
