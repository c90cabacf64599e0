"""A block-diagonal projection: ``groups`` independent maps ``[d_in] -> [d_out]``, held as one
``weight [groups * d_out, d_in]`` (group g's rows ``[g * d_out, (g + 1) * d_out)``), the layout
DeepSeek-V4's grouped output projection ``wo_a`` has in its checkpoints.

In the serving dtype the forward is one batched matmul. In FP8 (``WeightFormat.fp8``) the
weight stays e4m3 with its checkpoint's ``weight_scale_inv`` grid of 128x128 blocks over the
whole matrix; where a group's rows begin on a block row (``d_out % 128 == 0``, every released
V4 config) each group runs the block-scaled matmul on its rows' views (``FP8Linear``'s kernel on
CUDA), otherwise (a group's rows sharing a block row with the next group's, tiny test configs)
the weight is dequantized and the groups run as one fp32 batched matmul: the computation
``fp8_linear_ref`` defines, which the kernel path equals up to fp32 reassociation."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.model.weight_format import WeightFormat
from services.worker.ops.fp8_blockwise import FP8_DTYPE, dequantize_blockwise, scale_grid
from services.worker.ops.fp8_linear import BLOCK, fp8_linear_ref, fp8_linear_triton


class GroupedLinear(nn.Module):
    """``forward(x [N, groups, d_in]) -> [N, groups * d_out]`` in x's dtype: group g's input
    through its block of rows. ``weight`` (a parameter in the serving dtype, or an e4m3 buffer
    with the fp32 buffer ``weight_scale_inv``)."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __init__(self, groups: int, d_in: int, d_out: int, fmt: WeightFormat) -> None:
        super().__init__()
        self.groups, self.d_in, self.d_out, self.fp8 = groups, d_in, d_out, fmt.fp8
        self.mode = fmt.mode
        shape = (groups * d_out, d_in)
        if not fmt.fp8:
            self.weight = nn.Parameter(torch.empty(shape))
            return
        self.register_buffer("weight", torch.zeros(shape, dtype=FP8_DTYPE))
        grid = scale_grid(shape, (BLOCK, BLOCK))
        self.register_buffer("weight_scale_inv", torch.ones(grid, dtype=torch.float32))

    @property
    def block_aligned(self) -> bool:
        """Whether every group's rows begin on a row of 128x128 scale blocks."""
        return self.d_out % BLOCK == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if not self.fp8:
            w = self.weight.view(self.groups, self.d_out, self.d_in)
            return torch.einsum("ngi,goi->ngo", x, w).reshape(n, -1)
        if not self.block_aligned:
            dense = dequantize_blockwise(self.weight, self.weight_scale_inv, (BLOCK, BLOCK))
            w = dense.view(self.groups, self.d_out, self.d_in)
            return torch.einsum("ngi,goi->ngo", x.float(), w).reshape(n, -1).to(x.dtype)
        fn = fp8_linear_triton if x.device.type == "cuda" else fp8_linear_ref
        rows = self.d_out // BLOCK
        outs = [
            fn(
                x[:, g],
                self.weight[g * self.d_out : (g + 1) * self.d_out],
                self.weight_scale_inv[g * rows : (g + 1) * rows],
                None,
                self.mode,
            )
            for g in range(self.groups)
        ]
        return torch.cat(outs, dim=-1)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, d_in={self.d_in}, d_out={self.d_out}, fp8={self.fp8}"
