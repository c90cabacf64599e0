"""Whether an op runs as one fused Triton kernel or as the torch ops it replaces.

A fused op (norms, RoPE, the MoE router, the split-K sum of the FP8 matmul, ...) runs its
Triton kernel inside ``kernel_fusion()`` on a CUDA tensor, and its torch form elsewhere: on
other devices, outside the block (fusion is off by default: the engine turns it on for its
passes with ``--fused-kernels``), inside ``unfused_kernels()``, and in a pass that records
gradients (the kernels have no backward; serving passes record none). So a benchmark can serve
one model with and without fusion side by side (a CUDA graph captured in either keeps its
choice when replayed), and a test can compare the two through a whole model. The choice holds
in the thread (and asyncio context) that entered it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

import torch

_FUSED: ContextVar[bool] = ContextVar("dhisparse_kernel_fusion", default=False)


def fused(t: torch.Tensor) -> bool:
    """True when an op on ``t`` runs its fused Triton kernel: ``t`` is on a CUDA device,
    fusion is on (``kernel_fusion``) and no gradient is recorded."""
    return t.is_cuda and _FUSED.get() and not torch.is_grad_enabled()


@contextmanager
def kernel_fusion(on: bool = True) -> Iterator[None]:
    """Within the block, fused ops run their kernels (``on``) or their torch forms."""
    token = _FUSED.set(on)
    try:
        yield
    finally:
        _FUSED.reset(token)


def unfused_kernels() -> AbstractContextManager[None]:
    """Within the block, every fused op runs its torch form (``kernel_fusion(False)``)."""
    return kernel_fusion(False)
