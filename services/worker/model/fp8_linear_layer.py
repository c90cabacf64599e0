"""A linear layer whose weight stays FP8: ``weight [N, K]`` e4m3 and ``weight_scale_inv
[ceil(N/128), ceil(K/128)]`` fp32 (the checkpoint's names and layout), computed by the
block-scaled matmul of ``services/worker/ops/fp8_linear.py``.

On CUDA the forward is the Triton kernel; on the CPU it is the torch reference
``fp8_linear_ref`` (dequantize, one fp32 matmul), which is the documented CPU path and the very
function the kernel's tests compare against, not a fallback: the device decides, nothing else.
The loader fills it from an FP8 checkpoint as stored (``weights.loader``), or quantizes a bf16
one into it (``--weight-dtype fp8``)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.ops.fp8_blockwise import FP8_DTYPE, scale_grid, scale_to_float
from services.worker.ops.fp8_linear import BLOCK, MODES, Mode, fp8_linear_ref, fp8_linear_triton


class FP8Linear(nn.Module):
    """``y [..., N] = x [..., K] @ W^T (+ bias)`` with ``W = weight * weight_scale_inv`` per
    128x128 block; y has x's dtype. ``mode`` "w8a16" keeps x as it is, "w8a8" quantizes it per
    1x128 group (see ``act_quant_ref``). Buffers, not parameters: the layer is not trained."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        mode: Mode = "w8a16",
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        grid = scale_grid((out_features, in_features), (BLOCK, BLOCK))
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device)
        )
        self.register_buffer(
            "weight_scale_inv", torch.ones(grid, dtype=torch.float32, device=device)
        )
        b = torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None
        self.register_buffer("bias", b)

    @classmethod
    def from_checkpoint(
        cls,
        weight_fp8: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        mode: Mode = "w8a16",
    ) -> FP8Linear:
        """The layer holding a checkpoint's pair: ``weight_fp8 [N, K]`` float8_e4m3fn and its
        ``weight_scale_inv`` grid (fp32, bf16 or float8_e8m0fnu; stored as fp32, where e8m0
        is an exact power of two), on weight_fp8's device. The tensors are copied."""
        if weight_fp8.dtype != FP8_DTYPE or weight_fp8.dim() != 2:
            raise ValueError(
                f"weight must be 2-D {FP8_DTYPE}, got {weight_fp8.dtype} {tuple(weight_fp8.shape)}"
            )
        n, k = weight_fp8.shape
        if tuple(scale.shape) != scale_grid((n, k), (BLOCK, BLOCK)):
            raise ValueError(f"scale {tuple(scale.shape)} is not the 128x128 grid of {(n, k)}")
        layer = cls(
            k, n, bias=bias is not None, mode=mode, device=weight_fp8.device,
            bias_dtype=bias.dtype if bias is not None else torch.float32,
        )  # fmt: skip
        layer.weight.copy_(weight_fp8)
        layer.weight_scale_inv.copy_(scale_to_float(scale))
        if bias is not None:
            assert layer.bias is not None
            layer.bias.copy_(bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            return fp8_linear_triton(x, self.weight, self.weight_scale_inv, self.bias, self.mode)
        return fp8_linear_ref(x, self.weight, self.weight_scale_inv, self.bias, self.mode)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode}"
        )
