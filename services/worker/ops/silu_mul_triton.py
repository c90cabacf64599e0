"""SwiGLU's activation, ``F.silu(gate) * up``, as one Triton kernel (``silu_mul_kernel.py``)
instead of torch's two: the dense MLP's and the shared experts' (``MLP.forward`` in
``services/worker/model/mla_moe.py``, whose torch code is the reference).

``silu_mul_triton(gate, up)``: ``gate``, ``up`` [..., N] of one dtype (fp32, bf16, fp16) ->
``[..., N]`` in that dtype. As torch: ``silu(g) = g / (1 + exp(-g))`` in fp32 rounded to the
dtype, then its product with ``up`` in fp32 rounded to the dtype. Only the kernel's exp may
differ from torch's in the last fp32 bit, so each result is torch's or one step of the dtype
from it (for fp32, a few ulps). Static grid, no host synchronisation: capturable in a CUDA
graph."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.silu_mul_kernel import silu_mul_kernel

BLOCK_N = 1024
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in _ROUND:
        raise ValueError(
            f"gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)}: "
            "one shape, one of fp32 / bf16 / fp16"
        )
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # [M, N]
    out = torch.empty_like(g)
    if g.numel() == 0:
        return out.view(gate.shape)
    silu_mul_kernel[(g.shape[0], triton.cdiv(n, BLOCK_N))](
        g, g.stride(0), g.stride(1),
        u, u.stride(0), u.stride(1),
        out, out.stride(0), out.stride(1),
        n,
        BLOCK_N=BLOCK_N, ROUND=_ROUND[gate.dtype],
    )  # fmt: skip
    return out.view(gate.shape)
