"""DeepSeek-V4's rotary embedding: interleaved pairs ``(2i, 2i + 1)`` of the trailing
``rope_dim`` channels of a head rotated in place (the layout stays interleaved, since V4's value
is its key), the leading channels untouched. Tables from ``rotary.Rotary`` (the transformers
formulas for plain RoPE and YaRN).

Every layer of a pass rotates at the same positions with one of two ropes (the sliding layers'
and the compressed layers'), so a ``PassRope`` computes each (rope, width) table once per pass
and every layer reads it: the same values as a table computed per call, far fewer kernels. The
rotation itself is one kernel where fused (``ops/rope_tail.py``, bit for bit its torch form)."""

from __future__ import annotations

import torch

from dhisparse.family.rope_spec import RopeSpec
from services.worker.model.rotary import Rotary
from services.worker.ops.fusion import fused
from services.worker.ops.rope_tail import rope_tail_ref, rope_tail_triton


def rope_tables(
    positions: torch.Tensor, rope: RopeSpec, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, rope_dim / 2] fp32 at positions [N], scaled by the rope's table factor."""
    return Rotary(positions, rope).tables(rope_dim)


class PassRope:
    """One pass's positions [N] with a ``Rotary`` per rope: each (rope, width) table computed
    at the first rotation and shared by the later ones."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._ropes: dict[RopeSpec, Rotary] = {}

    def tables(self, rope: RopeSpec, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self._ropes.get(rope)
        if rotary is None:
            rotary = self._ropes[rope] = Rotary(self.positions, rope)
        return rotary.tables(rope_dim)


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor | PassRope, rope: RopeSpec, rope_dim: int,
    inverse: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x: [N, ..., d] rotated at positions [N] (or a pass's, with their tables) on its last
    ``rope_dim`` channels, in fp32 and returned in x's dtype; ``inverse`` rotates by the
    opposite angle (V4 de-rotates the attention output at the query's position)."""
    if isinstance(positions, PassRope):
        cos, sin = positions.tables(rope, rope_dim)
    else:
        cos, sin = rope_tables(positions, rope, rope_dim)
    if fused(x, "rope_tail") and x.dim() in (2, 3) and x.stride(-1) == 1:
        return rope_tail_triton(x, cos, sin, inverse)
    return rope_tail_ref(x, cos, sin, inverse)
