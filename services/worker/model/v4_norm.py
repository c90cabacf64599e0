"""RMSNorm as DeepSeek-V4 applies it: normalised in fp32 and scaled by ``weight`` (held in fp32,
``v4_precision``), then cast to the input's dtype, which is the shared ``layers.RMSNorm``;
``rms_normalise``: the unweighted norm of V4's per-head query and hyper-connections, cast back
before any scaling. Both run one Triton kernel where fused (``fusion``: op ``rms_norm``)."""

from __future__ import annotations

import torch

from services.worker.model.layers import RMSNorm
from services.worker.ops.fusion import fused
from services.worker.ops.rms_norm import MAX_D, rms_norm_ref, rms_norm_triton

__all__ = ["RMSNorm", "rms_normalise"]


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in fp32, returned in x's dtype; rows wider
    than the kernel holds (``MAX_D``) in torch."""
    if fused(x, "rms_norm") and x.shape[-1] <= MAX_D:
        return rms_norm_triton(x, None, eps)
    return rms_norm_ref(x, None, eps)
