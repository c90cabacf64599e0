"""RMSNorm as DeepSeek-V4 applies it: normalised in fp32, cast back, then scaled by ``weight``
(``weight`` absent: the unweighted norm of V4's per-head query and hyper-connections)."""

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
        return self.weight * rms_normalise(x, self.eps)
