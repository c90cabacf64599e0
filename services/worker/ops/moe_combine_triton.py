"""The MoE combine as one Triton kernel (``moe_combine_kernel.py``): the last step of the grouped
MoEs (``moe_pairs.combine``, for ``fp8_moe.py`` and ``fp4_moe.py``), whose torch form is its
reference.

``combine_triton(y, idx, n_experts, dtype)``: ``y [T * k, D]`` fp32, the down projection's
weighted output per (token, choice) pair, pair ``t * k + j``; ``idx [T, k]`` the pairs' expert
ids, ``n_experts`` marking one held elsewhere, whose row is undefined and counts as zero ->
``[T, D]`` in ``dtype``: each token's k rows summed in ``sum_choices``' pairwise halves and
cast once, bit for bit the torch form's ``sum_choices(torch.where(held, y, 0)).to(dtype)``.

The kernel takes k a power of two (``fits``: the halves are then a reshape; V3.2 and GLM-5
route to 8); ``moe_pairs.combine`` gives other k (V4's 6) the torch form: a choice by shape,
with the same output. Static grid (T, ceil(D / BLOCK_D)), nothing read back to the host:
capturable in a CUDA graph."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.moe_combine_kernel import moe_combine_kernel

BLOCK_D = 256


def fits(top_k: int) -> bool:
    """Whether the kernel takes ``top_k`` choices per token (a power of two)."""
    return top_k >= 1 and top_k & (top_k - 1) == 0


def combine_triton(
    y: torch.Tensor, idx: torch.Tensor, n_experts: int, dtype: torch.dtype
) -> torch.Tensor:
    """See the module docstring; raises ValueError for a k that is not a power of two."""
    t, k = idx.shape
    if not fits(k):
        raise ValueError(f"the combine kernel sums a power of two of choices, not {k}")
    if y.dim() != 2 or y.shape[0] != t * k or y.dtype != torch.float32:
        raise ValueError(f"y must be [{t * k}, D] fp32, got {y.dtype} {tuple(y.shape)}")
    d = y.shape[1]
    out = torch.empty(t, d, dtype=dtype, device=y.device)
    if t == 0 or d == 0:
        return out
    moe_combine_kernel[(t, triton.cdiv(d, BLOCK_D))](
        y, y.stride(0), y.stride(1),
        idx, idx.stride(0), idx.stride(1),
        out, out.stride(0), out.stride(1),
        n_experts, d,
        K=k, LOG2_K=k.bit_length() - 1, BLOCK_D=BLOCK_D, BF16=dtype == torch.bfloat16,
    )  # fmt: skip
    return out
