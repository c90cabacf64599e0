"""The routed experts with FP8 weights: ``moe.Experts``'s forward contract over the block-scaled
e4m3 weights of the checkpoint, computed by ``services/worker/ops/fp8_moe.py``.

On CUDA the forward is the grouped Triton kernel (static shapes, no host synchronisation: it
can be captured in a CUDA graph and replayed with new routing); on the CPU it is the torch
reference ``fp8_moe_ref``, the documented CPU path and the very function the kernel's tests
compare against, not a fallback: the device decides, nothing else. The loader fills it from
an FP8 checkpoint's experts as stored, one expert's matrices at a time (``weights.mla_names``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from services.worker.ops.fp8_blockwise import (
    FP8_DTYPE,
    dequantize_blockwise,
    quantize_blockwise,
    scale_grid,
    scale_to_float,
)
from services.worker.ops.fp8_linear import BLOCK, MODES, Mode
from services.worker.ops.fp8_moe import dequantize_gate_up, fp8_moe_ref, fp8_moe_triton
from services.worker.ops.moe_pairs import check_limit

# A checkpoint's (e4m3 weight [R, C], weight_scale_inv [ceil(R/128), ceil(C/128)]).
FP8Pair = tuple[torch.Tensor, torch.Tensor]


def _check_pair(name: str, pair: FP8Pair, shape: tuple[int, int]) -> None:
    w, s = pair
    if w.dtype != FP8_DTYPE or tuple(w.shape) != shape:
        raise ValueError(f"{name} must be {FP8_DTYPE} {shape}, got {w.dtype} {tuple(w.shape)}")
    if tuple(s.shape) != scale_grid(shape, (BLOCK, BLOCK)):
        raise ValueError(f"{name}'s scale {tuple(s.shape)} is not the 128x128 grid of {shape}")


class FP8Experts(nn.Module):
    """The E routed experts, ``forward(x [T, D], idx [T, k], w [T, k]) -> [T, D]`` as
    ``moe.Experts``: ``sum_j w[:, j] * expert_{idx[:, j]}(x)``, SwiGLU experts.

    Buffers (not parameters: the layer is not trained), per expert stacked over E:
    ``gate_up_proj [E, 2I, D]`` e4m3 (gate rows, then up rows) with ``gate_up_proj_scale_inv
    [E, 2 * ceil(I/128), ceil(D/128)]`` fp32, gate's grid over up's (the stacked weight's grid
    when I % 128 == 0; see ``ops/fp8_moe.py``), and ``down_proj [E, D, I]`` e4m3 with
    ``down_proj_scale_inv [E, ceil(D/128), ceil(I/128)]`` fp32. ``mode`` "w8a16" keeps x as
    it is, "w8a8" quantizes the activations of both GEMMs per 1x128 group. ``limit``: None for
    the plain SwiGLU, or DeepSeek-V4's clamp (``silu(min(gate, limit)) * clamp(up, -limit,
    limit)``, its config's ``swiglu_limit``)."""

    gate_up_proj: torch.Tensor
    gate_up_proj_scale_inv: torch.Tensor
    down_proj: torch.Tensor
    down_proj_scale_inv: torch.Tensor

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        intermediate: int,
        mode: Mode = "w8a16",
        device: torch.device | str | None = None,
        limit: float | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        check_limit(limit, glu=True)
        self.n, self.d_model, self.intermediate, self.mode = n_experts, d_model, intermediate, mode
        self.limit = limit
        e, d, i = n_experts, d_model, intermediate
        gate_rows, d_cols = scale_grid((i, d), (BLOCK, BLOCK))
        down_grid = scale_grid((d, i), (BLOCK, BLOCK))
        self.register_buffer(
            "gate_up_proj", torch.zeros(e, 2 * i, d, dtype=FP8_DTYPE, device=device)
        )
        self.register_buffer(
            "gate_up_proj_scale_inv", torch.ones(e, 2 * gate_rows, d_cols, device=device)
        )
        self.register_buffer("down_proj", torch.zeros(e, d, i, dtype=FP8_DTYPE, device=device))
        self.register_buffer("down_proj_scale_inv", torch.ones(e, *down_grid, device=device))

    @classmethod
    def from_checkpoint(
        cls,
        gate_proj: Sequence[FP8Pair],
        up_proj: Sequence[FP8Pair],
        down_proj: Sequence[FP8Pair],
        mode: Mode = "w8a16",
        limit: float | None = None,
    ) -> FP8Experts:
        """The layer holding a checkpoint's per-expert pairs (``experts.{e}.gate_proj``, ``up_proj``
        ``[I, D]`` and ``down_proj [D, I]``: e4m3 weight and its ``weight_scale_inv`` grid, fp32,
        bf16 or float8_e8m0fnu, stored as fp32), on the first weight's device. Copied; gate and
        up keep their own scale grids whatever I is; ``limit`` as the constructor's."""
        if not (len(gate_proj) == len(up_proj) == len(down_proj) > 0):
            raise ValueError(
                f"{len(gate_proj)} gate, {len(up_proj)} up, {len(down_proj)} down experts"
            )
        i, d = gate_proj[0][0].shape
        layer = cls(len(gate_proj), d, i, mode, device=gate_proj[0][0].device, limit=limit)
        sr = -(-i // BLOCK)
        for e, (gate, up, down) in enumerate(zip(gate_proj, up_proj, down_proj, strict=True)):
            _check_pair(f"expert {e} gate_proj", gate, (i, d))
            _check_pair(f"expert {e} up_proj", up, (i, d))
            _check_pair(f"expert {e} down_proj", down, (d, i))
            layer.gate_up_proj[e, :i].copy_(gate[0])
            layer.gate_up_proj[e, i:].copy_(up[0])
            layer.gate_up_proj_scale_inv[e, :sr].copy_(scale_to_float(gate[1]))
            layer.gate_up_proj_scale_inv[e, sr:].copy_(scale_to_float(up[1]))
            layer.down_proj[e].copy_(down[0])
            layer.down_proj_scale_inv[e].copy_(scale_to_float(down[1]))
        return layer

    @classmethod
    def from_experts(
        cls,
        experts: nn.Module,
        mode: Mode = "w8a16",
        scale_dtype: str = "F32",
        limit: float | None = None,
    ) -> FP8Experts:
        """``experts`` (a ``moe.Experts``: gate_up_proj [E, 2I, D], down_proj [E, D, I]) quantized
        per 128x128 block as the checkpoint writer does
        (``quantize_blockwise``; gate and up each on its own grid), on their device; ``limit``
        as the constructor's."""
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        i = gate_up.shape[1] // 2
        gates = [quantize_blockwise(w, (BLOCK, BLOCK), scale_dtype) for w in gate_up[:, :i]]
        ups = [quantize_blockwise(w, (BLOCK, BLOCK), scale_dtype) for w in gate_up[:, i:]]
        downs = [quantize_blockwise(w, (BLOCK, BLOCK), scale_dtype) for w in down]
        return cls.from_checkpoint(gates, ups, downs, mode, limit)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights in fp32: ``(gate_up [E, 2I, D], down [E, D, I])``, as ``moe.Experts``
        holds them."""
        g, gs = self.gate_up_proj, self.gate_up_proj_scale_inv
        d, ds = self.down_proj, self.down_proj_scale_inv
        gate_up = torch.stack([dequantize_gate_up(g[e], gs[e]) for e in range(self.n)])
        down = torch.stack(
            [dequantize_blockwise(d[e], ds[e], (BLOCK, BLOCK)) for e in range(self.n)]
        )
        return gate_up, down

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, D], idx / w [T, k] -> [T, D] in x's dtype (see ``ops/fp8_moe.py``)."""
        fn = fp8_moe_triton if x.device.type == "cuda" else fp8_moe_ref
        return fn(
            x, idx, w, self.gate_up_proj, self.gate_up_proj_scale_inv,
            self.down_proj, self.down_proj_scale_inv, self.mode, self.limit,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n}, d_model={self.d_model}, intermediate={self.intermediate}, "
            f"mode={self.mode}, limit={self.limit}"
        )
