"""The routed experts with FP4 weights: ``moe.Experts``'s forward contract over DeepSeek-V4's
released e2m1 experts with UE8M0 scales per 32 columns, computed W4A16 by
``services/worker/ops/fp4_moe.py``.

On CUDA the forward is the grouped Triton kernel (static shapes, no host synchronisation: it
can be captured in a CUDA graph and replayed with new routing); on the CPU it is the torch
reference ``fp4_moe_ref``, the very function the kernel's tests compare against: the device
decides, nothing else. ``from_checkpoint`` takes each expert's ``w1`` / ``w3`` / ``w2`` as the
checkpoint stores them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from services.worker.ops.fp4_e2m1 import FP4_GROUP, fp4_scale_grid, ue8m0_exponents
from services.worker.ops.fp4_moe import dequantize_expert, fp4_moe_ref, fp4_moe_triton
from services.worker.ops.moe_pairs import check_limit

# A checkpoint's (packed int8 or uint8 [R, C / 2], scale [R, C / 32] float8_e8m0fnu, or
# float32 / bfloat16 powers of two).
FP4Pair = tuple[torch.Tensor, torch.Tensor]


def _check_pair(name: str, pair: FP4Pair, shape: tuple[int, int]) -> None:
    """``shape`` is the packed one, ``[R, C / 2]``."""
    w, s = pair
    if w.dtype not in (torch.int8, torch.uint8) or tuple(w.shape) != shape:
        raise ValueError(
            f"{name} must be packed int8 or uint8 {shape}, got {w.dtype} {tuple(w.shape)}"
        )
    if tuple(s.shape) != fp4_scale_grid(shape):
        raise ValueError(
            f"{name}'s scale {tuple(s.shape)} is not the per-32 grid {fp4_scale_grid(shape)}"
        )


class FP4Experts(nn.Module):
    """The E routed experts, ``forward(x [T, D], idx [T, k], w [T, k]) -> [T, D]`` as
    ``moe.Experts``: ``sum_j w[:, j] * expert_{idx[:, j]}(x)``, SwiGLU experts; an id of E (an
    expert held elsewhere) adds nothing. ``limit``: None for the plain SwiGLU, or V4's clamp
    (``silu(min(gate, limit)) * clamp(up, -limit, limit)``, its ``swiglu_limit``). x is bf16 or
    fp32.

    Buffers (not parameters: the layer is not trained), stacked over E (``ops/fp4_moe.py``):
    ``gate_up_proj [E, 2I, D / 2]`` uint8 (gate rows, then up rows, two e2m1 codes a byte) with
    ``gate_up_proj_scale [E, 2I, D / 32]`` uint8 UE8M0 exponents, ``down_proj [E, D, I / 2]``
    uint8 with ``down_proj_scale [E, D, I / 32]`` uint8. The scales stay the checkpoint's bits:
    a quarter of fp32's bytes, read by the kernel as they are."""

    gate_up_proj: torch.Tensor
    gate_up_proj_scale: torch.Tensor
    down_proj: torch.Tensor
    down_proj_scale: torch.Tensor

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        intermediate: int,
        limit: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if d_model % FP4_GROUP or intermediate % FP4_GROUP:
            raise ValueError(
                f"D = {d_model} and I = {intermediate} must be multiples of {FP4_GROUP} (a scale)"
            )
        check_limit(limit, glu=True)
        self.n, self.d_model, self.intermediate, self.limit = (
            n_experts,
            d_model,
            intermediate,
            limit,
        )
        e, d, i, u8 = n_experts, d_model, intermediate, torch.uint8
        unit = 127  # the exponent of 1.0
        self.register_buffer("gate_up_proj", torch.zeros(e, 2 * i, d // 2, dtype=u8, device=device))
        self.register_buffer(
            "gate_up_proj_scale",
            torch.full((e, 2 * i, d // FP4_GROUP), unit, dtype=u8, device=device),
        )
        self.register_buffer("down_proj", torch.zeros(e, d, i // 2, dtype=u8, device=device))
        self.register_buffer(
            "down_proj_scale", torch.full((e, d, i // FP4_GROUP), unit, dtype=u8, device=device)
        )

    @classmethod
    def from_checkpoint(
        cls,
        gate_proj: Sequence[FP4Pair],
        up_proj: Sequence[FP4Pair],
        down_proj: Sequence[FP4Pair],
        limit: float | None = None,
    ) -> FP4Experts:
        """The layer holding a checkpoint's per-expert pairs (``experts.{e}.w1`` gate and ``w3``
        up, packed ``[I, D / 2]`` with scale ``[I, D / 32]``; ``w2`` down, packed ``[D, I / 2]``
        with scale ``[D, I / 32]``), on the first weight's device; copied. ValueError when the
        counts, shapes, dtypes or scales (not powers of two) do not fit."""
        if not (len(gate_proj) == len(up_proj) == len(down_proj) > 0):
            raise ValueError(
                f"{len(gate_proj)} gate, {len(up_proj)} up, {len(down_proj)} down experts"
            )
        if gate_proj[0][0].dim() != 2:
            raise ValueError(f"a packed weight is [R, C / 2], got {tuple(gate_proj[0][0].shape)}")
        i, half_d = gate_proj[0][0].shape
        d = 2 * half_d
        layer = cls(len(gate_proj), d, i, limit, device=gate_proj[0][0].device)
        for e, (gate, up, down) in enumerate(zip(gate_proj, up_proj, down_proj, strict=True)):
            _check_pair(f"expert {e} gate_proj", gate, (i, d // 2))
            _check_pair(f"expert {e} up_proj", up, (i, d // 2))
            _check_pair(f"expert {e} down_proj", down, (d, i // 2))
            layer.gate_up_proj[e, :i].copy_(gate[0].view(torch.uint8))
            layer.gate_up_proj[e, i:].copy_(up[0].view(torch.uint8))
            layer.gate_up_proj_scale[e, :i].copy_(ue8m0_exponents(gate[1]))
            layer.gate_up_proj_scale[e, i:].copy_(ue8m0_exponents(up[1]))
            layer.down_proj[e].copy_(down[0].view(torch.uint8))
            layer.down_proj_scale[e].copy_(ue8m0_exponents(down[1]))
        return layer

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights in fp32: ``(gate_up [E, 2I, D], down [E, D, I])``, as ``moe.Experts``
        holds them."""
        gate_up = torch.stack(
            [
                dequantize_expert(self.gate_up_proj[e], self.gate_up_proj_scale[e])
                for e in range(self.n)
            ]
        )
        down = torch.stack(
            [dequantize_expert(self.down_proj[e], self.down_proj_scale[e]) for e in range(self.n)]
        )
        return gate_up, down

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, D], idx / w [T, k] -> [T, D] in x's dtype (see ``ops/fp4_moe.py``)."""
        fn = fp4_moe_triton if x.device.type == "cuda" else fp4_moe_ref
        return fn(
            x, idx, w, self.gate_up_proj, self.gate_up_proj_scale,
            self.down_proj, self.down_proj_scale, self.limit,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n}, d_model={self.d_model}, intermediate={self.intermediate}, "
            f"limit={self.limit}"
        )
