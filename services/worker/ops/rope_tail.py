"""DeepSeek-V4's rotary embedding of the trailing ``rope_dim`` channels of each head as one
kernel (``rope_tail_kernel.py``): interleaved pairs (2i, 2i + 1) rotated in place of the
layout, the leading channels copied, in one pass instead of some ten torch ops.

``rope_tail_ref`` is the torch form (the lines ``model.v4_rope.rope_tail`` runs unfused); the
kernel equals it bit for bit, every dtype: the same fp32 products and sums, one rounding to
x's dtype."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.rope import as_heads, check_tables
from services.worker.ops.rope_tail_kernel import rope_tail_kernel


def rope_tail_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``x [N, ..., D]``, ``cos``/``sin [N, rope_dim / 2]`` fp32 -> x with its last
    ``rope_dim`` channels rotated (pairs (2i, 2i + 1), the layout kept), in x's dtype;
    ``inverse``: by the opposite angle."""
    if inverse:
        sin = -sin
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    tail = x[..., -rope_dim:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def rope_tail_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Same contract as ``rope_tail_ref`` for ``x [N, D]`` or ``[N, H, D]`` (unit last stride)
    and fp32 tables of one layout with unit last stride: a new contiguous tensor like x."""
    check_tables(x, cos, sin)
    half, d = cos.shape[-1], x.shape[-1]
    x3 = as_heads(x)
    if x3.stride(2) != 1:
        raise ValueError("x needs a unit last stride")
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    n, h = x3.shape[0], x3.shape[1]
    lead = d - 2 * half
    if n and h:
        block_h = min(triton.next_power_of_2(h), 16)
        rope_tail_kernel[(n, triton.cdiv(h, block_h))](
            x3, x3.stride(0), x3.stride(1),
            cos, sin, cos.stride(0),
            out, out.stride(0), out.stride(1),
            h, half, lead,
            BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_LEAD=triton.next_power_of_2(lead) if lead else 0,
            INVERSE=inverse,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(x.shape)
