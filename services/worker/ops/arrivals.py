"""Arrival counters for kernels whose programs split one output tile and whose last arriving
program finishes it (sums the splits in split order, so the result does not depend on which
program arrives last). A counter is 0 between launches: the finishing program resets it, so a
launch captured in a CUDA graph can be replayed.

One buffer per device, shared by every such launch on it: launches on one stream run one after
another, and the engine issues a device's forward passes (eager or replayed) on one stream at a
time, so no two launches count in the same buffer at once. The buffer is made outside any
graph capture (a capture's allocation would belong to that graph's pool)."""

from __future__ import annotations

import torch

CAPACITY = 4096  # tiles a launch may split: split launches have fewer than TARGET_PROGRAMS
_BUFFERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """[CAPACITY] int32 zeros on ``device`` (at least ``tiles`` of them are used)."""
    if tiles > CAPACITY:
        raise ValueError(f"{tiles} split tiles in one launch; the counters hold {CAPACITY}")
    buf = _BUFFERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "arrival counters are first needed inside a CUDA graph capture: run the pass "
                "once eagerly before capturing it"
            )
        buf = _BUFFERS[device] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return buf
