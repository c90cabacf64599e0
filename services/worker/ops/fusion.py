"""Whether an op runs as one fused Triton kernel or as the torch ops it replaces.

A fused op (norms, RoPE, the MoE router, the split-K sum of the FP8 matmul, ...) runs its
Triton kernel on a CUDA tensor and its torch form elsewhere: the device decides, as for the FP8
matmul. The kernels have no backward, so a pass that records gradients (a drafter's training)
runs the torch forms too; serving passes record none. Inside ``unfused_kernels()`` every fused op runs its torch form on every device, so a
benchmark can serve one model with and without fusion side by side (a CUDA graph captured
inside it keeps the torch form when replayed outside), and a test can compare the two through a
whole model. The choice holds in the thread (and asyncio context) that entered it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_UNFUSED: ContextVar[bool] = ContextVar("dhisparse_unfused_kernels", default=False)


def fused(t: torch.Tensor) -> bool:
    """True when an op on ``t`` runs its fused Triton kernel: ``t`` is on a CUDA device, no
    gradient is recorded and no ``unfused_kernels()`` is active."""
    return t.is_cuda and not _UNFUSED.get() and not torch.is_grad_enabled()


@contextmanager
def unfused_kernels() -> Iterator[None]:
    """Within the block, every fused op runs its torch form."""
    token = _UNFUSED.set(True)
    try:
        yield
    finally:
        _UNFUSED.reset(token)
