"""Small building blocks: RMSNorm and the SwiGLU MLP (rotary embedding: ``rotary``)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.ops.fusion import fused
from services.worker.ops.rms_norm import add_rms_norm_triton, rms_norm_triton


class RMSNorm(nn.Module):
    """RMSNorm in fp32, returned in x's dtype: one Triton kernel where ``fused(x)``, else the
    torch form below."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused(x, "rms_norm"):
            return rms_norm_triton(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual join before this norm: -> (``self(residual + x)``, ``residual + x``),
        one kernel where fused (the sum bit for bit torch's ``residual + x``)."""
        if fused(x, "add_norm") and x.dtype == residual.dtype and x.shape == residual.shape:
            return add_rms_norm_triton(x, residual, self.weight, self.eps)
        summed = residual + x
        return self(summed), summed


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden [..., d] @ weight [V, d]^T`` -> ``[..., V]`` fp32. On a GPU with hidden and
    head both bf16 (or fp16), one GEMM of the stored operands with fp32 accumulation and fp32 output (the same
    products as widening both first: a bf16 x bf16 product is exact in fp32), so the head is
    never copied to fp32 — for a 129K x 7K vocabulary that copy would be 3.7 GB per step.
    Elsewhere, both widened to fp32."""
    if hidden.is_cuda and hidden.dtype == weight.dtype in (torch.bfloat16, torch.float16):
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
        return out.reshape(*hidden.shape[:-1], weight.shape[0])
    return hidden.float() @ weight.float().t()


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))
