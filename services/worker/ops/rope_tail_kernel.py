"""DeepSeek-V4's rotary kernel: one program per token and block of heads rotates the last
``2 * HALF`` elements of each head (pairs (2i, 2i + 1), the layout kept interleaved) and copies
the ``D_LEAD`` elements before them (see ``rope_tail.py``, which launches it and holds the torch
form).

Each product and sum is rounded in fp32 as torch's separate ops round them, then rounded once
to the output's dtype; the launch turns fp fusion off, so no multiply-add is contracted and
the result is bit for bit the torch form's. ``INVERSE`` rotates by the opposite angle with the
negated sine, as the torch form does.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to


@triton.jit
def rope_tail_kernel(
    x_ptr, stride_xn, stride_xh,
    cos_ptr, sin_ptr, stride_cn,
    out_ptr, stride_on, stride_oh,
    H, HALF, D_LEAD,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_LEAD: tl.constexpr,
    INVERSE: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (offs_h < H)[:, None]
    x_row = x_ptr + n * stride_xn + offs_h[:, None].to(tl.int64) * stride_xh
    out_row = out_ptr + n * stride_on + offs_h[:, None].to(tl.int64) * stride_oh
    out_dtype = out_ptr.dtype.element_ty
    if BLOCK_LEAD > 0:
        offs_l = tl.arange(0, BLOCK_LEAD)[None, :]
        mask_l = mask_h & (offs_l < D_LEAD)
        lead = tl.load(x_row + offs_l, mask=mask_l, other=0.0)
        tl.store(out_row + offs_l, lead.to(out_dtype), mask=mask_l)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    mask = mask_h & mask_i[None, :]
    cos = tl.load(cos_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)[None, :]
    sin = tl.load(sin_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)[None, :]
    if INVERSE:
        sin = -sin
    offs_even = D_LEAD + 2 * offs_i[None, :]
    even = tl.load(x_row + offs_even, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(x_row + offs_even + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_row + offs_even, round_to(even * cos - odd * sin, out_dtype), mask=mask)
    tl.store(out_row + offs_even + 1, round_to(odd * cos + even * sin, out_dtype), mask=mask)
