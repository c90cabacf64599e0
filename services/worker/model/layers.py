"""Small building blocks: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary:
    """Positions of one forward pass with their rotary tables computed once per width: every
    layer rotates at the same positions, so the tables are shared (the same numbers
    ``apply_rope`` computes from a position tensor, without recomputing them per layer)."""

    def __init__(self, positions: torch.Tensor, theta: float) -> None:
        self.positions = positions
        self.theta = theta
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [N, d/2] fp32."""
        t = self._tables.get(d)
        if t is None:
            t = self._tables[d] = _tables(self.positions, self.theta, d)
        return t


def _tables(positions: torch.Tensor, theta: float, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    dev = positions.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    angles = positions.float().unsqueeze(-1) * inv_freq  # [N, d/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor | Rotary, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form). x: [N, ..., d] with d even; positions: [N], or a
    ``Rotary`` of them (whose theta wins)."""
    d = x.shape[-1]
    if isinstance(positions, Rotary):
        cos, sin = positions.tables(d)
    else:
        cos, sin = _tables(positions, theta, d)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))
