"""RMSNorm as DeepSeek-V4 applies it: normalised in fp32 and scaled by ``weight`` (held in fp32,
``v4_precision``), then cast to the input's dtype; ``rms_normalise``: the unweighted norm of
V4's per-head query and hyper-connections, cast back before any scaling."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)
