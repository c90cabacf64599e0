"""DeepSeek-V4's rotary embedding: interleaved pairs ``(2i, 2i + 1)`` of the trailing
``rope_dim`` channels of a head rotated in place (the layout stays interleaved, since V4's value
is its key), the leading channels untouched. Frequencies from ``rotary.inv_freq``, the
transformers formulas for plain RoPE and YaRN."""

from __future__ import annotations

import torch

from dhisparse.family.rope_spec import RopeSpec
from services.worker.model.rotary import inv_freq


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec, rope_dim: int, inverse: bool = False
) -> torch.Tensor:
    """x: [N, ..., d] rotated at positions: [N] on its last ``rope_dim`` channels, in fp32 and
    returned in x's dtype; ``inverse`` rotates by the opposite angle (V4 de-rotates the
    attention output at the query's position)."""
    angles = positions.float().unsqueeze(-1) * inv_freq(rope, rope_dim, x.device)  # [N, r/2]
    f = rope.table_factor
    cos, sin = angles.cos() * f, angles.sin() * f
    if inverse:
        sin = -sin
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    tail = x[..., -rope_dim:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)
