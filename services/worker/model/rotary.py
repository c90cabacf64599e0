"""Rotary position embedding: plain RoPE and YaRN (the DeepSeek-V3.2 context extension), with
the tables of one forward pass computed once and shared by every layer.

Frequencies follow transformers' ``_compute_yarn_parameters`` exactly (the oracle for the real
families): extrapolated and interpolated inverse frequencies blended by a linear ramp over the
correction range, and cos/sin multiplied by the attention factor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RopeKind = Literal["default", "yarn"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # cos/sin multiplier; derived from mscale when None
    truncate: bool = True

    def inv_freq(self, dim: int) -> torch.Tensor:
        """[dim / 2] fp32 inverse frequencies of a ``dim``-wide rotary part."""
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if self.kind == "default":
            return 1.0 / pos_freqs
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range(dim)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # the share of each frequency that is extrapolated
        return interpolation * (1 - keep) + extrapolation * keep

    def _correction_range(self, dim: int) -> tuple[float, float]:
        def correction_dim(rotations: float) -> float:
            ratio = self.original_max_position / (rotations * 2 * math.pi)
            return dim * math.log(ratio) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    @property
    def table_factor(self) -> float:
        """The multiplier on cos and sin (1 for plain RoPE)."""
        if self.kind == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The factor on the attention softmax scale: mscale(factor, mscale_all_dim)^2 under YaRN
        (DeepSeek-V3.2: 1.36889^2, so 192^-0.5 becomes 0.1352338), else 1."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


class Rotary:
    """Positions of one forward pass with their rotary tables computed once per width: every
    layer rotates at the same positions, so the tables are shared."""

    def __init__(self, positions: torch.Tensor, rope: RopeSpec | float) -> None:
        self.positions = positions
        self.rope = rope if isinstance(rope, RopeSpec) else RopeSpec(theta=float(rope))
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [N, d/2] fp32."""
        t = self._tables.get(d)
        if t is None:
            inv_freq = self.rope.inv_freq(d).to(self.positions.device)
            angles = self.positions.float().unsqueeze(-1) * inv_freq  # [N, d/2]
            f = self.rope.table_factor
            t = self._tables[d] = (angles.cos() * f, angles.sin() * f)
        return t


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor | Rotary, theta: float = 10000.0,
    interleaved: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Rotary embedding of x: [N, ..., d] (d even) at positions: [N], or a ``Rotary`` of them
    (whose RopeSpec wins over ``theta``). Rotate-half pairs (i, i + d/2) by default;
    ``interleaved`` rotates the pairs (2i, 2i + 1) and returns them de-interleaved
    (``[even' ; odd']``), the layout transformers caches for DeepSeek's MLA: dot products equal
    those of the interleaved layout."""
    d = x.shape[-1]
    rotary = positions if isinstance(positions, Rotary) else Rotary(positions, theta)
    cos, sin = rotary.tables(d)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
