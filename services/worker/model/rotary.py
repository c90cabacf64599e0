"""Rotary position embedding: plain RoPE and YaRN (the DeepSeek-V3.2 context extension) as a
``RopeSpec`` states them, with the tables of one forward pass computed once and shared by every
layer.

Frequencies follow transformers' ``_compute_yarn_parameters`` exactly (the oracle for the real
families): extrapolated and interpolated inverse frequencies blended by a linear ramp over the
correction range, and cos/sin multiplied by the attention factor."""

from __future__ import annotations

import torch

from dhisparse.family.rope_spec import RopeSpec


def inv_freq(rope: RopeSpec, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[dim / 2] fp32 inverse frequencies of a ``dim``-wide rotary part, computed on ``device``
    (a captured CUDA graph may compute them: no host-to-device copy)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = rope.correction_range(dim)
    if low == high:
        high += 0.001  # a zero-width ramp
    cols = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = ((cols - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency that is extrapolated
    return interpolation * (1 - keep) + extrapolation * keep


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
            freqs = inv_freq(self.rope, d, self.positions.device)
            angles = self.positions.float().unsqueeze(-1) * freqs  # [N, d/2]
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
