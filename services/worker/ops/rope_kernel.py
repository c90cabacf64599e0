"""The rotary-embedding kernel: one program per token and block of heads rotates the first
``2 * HALF`` elements of each head's last dimension (see ``rope.py``, which launches it and
holds the torch form) and, with ``D_REST`` > 0, copies the ``D_REST`` elements after them.

Pairs are (i, i + HALF) (rotate-half) or, with ``INTERLEAVED``, (2i, 2i + 1); either way the
output is ``[x1 cos - x2 sin ; x2 cos + x1 sin]`` (interleaved input comes out
de-interleaved), each product and sum rounded in fp32 as torch's separate ops round them, then
rounded once to the output's dtype. The launch turns fp fusion off, so no multiply-add is
contracted and the result is bit for bit torch's.

``rope_pairs`` and ``store_rotated`` are the rotation's two halves, which the kernels that end
in a RoPE (``mla_row_kernel``, ``index_key_kernel``) call too.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to


@triton.jit
def rope_pairs(offs_i, HALF, INTERLEAVED: tl.constexpr):
    """The offsets (first, second) of the pairs ``offs_i`` (< HALF) within a rotated part."""
    if INTERLEAVED:
        offs_1 = 2 * offs_i
        offs_2 = offs_1 + 1
    else:
        offs_1 = offs_i
        offs_2 = offs_1 + HALF
    return offs_1, offs_2


@triton.jit
def store_rotated(out_row, offs_i, HALF, x1, x2, cos, sin, mask):
    """Stores pairs (x1, x2) (fp32) rotated by (cos, sin), de-interleaved: ``x1 cos - x2 sin``
    at ``out_row + offs_i`` and ``x2 cos + x1 sin`` HALF after, each rounded once to the
    output's dtype."""
    out_dtype = out_row.dtype.element_ty
    tl.store(out_row + offs_i, round_to(x1 * cos - x2 * sin, out_dtype), mask=mask)
    tl.store(out_row + HALF + offs_i, round_to(x2 * cos + x1 * sin, out_dtype), mask=mask)


@triton.jit
def rope_kernel(
    x_ptr, stride_xn, stride_xh,
    cos_ptr, sin_ptr, stride_cn,
    out_ptr, stride_on, stride_oh,
    H, HALF, D_REST,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    mask = (offs_h < H)[:, None] & mask_i[None, :]
    cos = tl.load(cos_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)[None, :]
    sin = tl.load(sin_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)[None, :]
    x_row = x_ptr + n * stride_xn + offs_h[:, None].to(tl.int64) * stride_xh
    offs_1, offs_2 = rope_pairs(offs_i[None, :], HALF, INTERLEAVED)
    x1 = tl.load(x_row + offs_1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + offs_2, mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + n * stride_on + offs_h[:, None].to(tl.int64) * stride_oh
    out_dtype = out_ptr.dtype.element_ty
    store_rotated(out_row, offs_i[None, :], HALF, x1, x2, cos, sin, mask)
    if BLOCK_REST > 0:
        offs_r = tl.arange(0, BLOCK_REST)[None, :]
        mask_r = (offs_h < H)[:, None] & (offs_r < D_REST)
        rest = tl.load(x_row + 2 * HALF + offs_r, mask=mask_r, other=0.0)
        tl.store(out_row + 2 * HALF + offs_r, rest.to(out_dtype), mask=mask_r)
