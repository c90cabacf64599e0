"""The index-key kernel: one program per token takes the indexer's ``wk`` output ``[D]``
through LayerNorm with bias, then RoPE of its first ``2 * HALF`` elements (see
``norm_rope.py``, which launches it and holds the torch form).

The LayerNorm is in fp32 (``mean``, ``var = mean((x - mean)^2)``, ``(x - mean) * rstd * w +
b``) and its output is rounded to the output's dtype, as the torch form's LayerNorm returns it,
before the RoPE reads it: the rotated part re-reads its pairs' inputs and normalizes them with
the row's statistics, so no element moves between lanes. The RoPE is ``rope_kernel``'s (pairs
(2i, 2i + 1) with ``INTERLEAVED``, written de-interleaved; else (i, i + HALF)); the elements
after the rotated ones are the LayerNorm's output.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to
from services.worker.ops.rope_kernel import rope_pairs, store_rotated


@triton.jit
def index_key_kernel(
    x_ptr, stride_xn,
    w_ptr, b_ptr,
    cos_ptr, sin_ptr, stride_cn,
    out_ptr, stride_on,
    D, HALF, eps,
    BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + n * stride_xn
    out_row = out_ptr + n * stride_on
    out_dtype = out_ptr.dtype.element_ty
    # the row's LayerNorm statistics, and its elements after the rotated part
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    x = tl.load(x_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask_d, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / D + eps)
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mask_rest = mask_d & (offs_d >= 2 * HALF)
    tl.store(out_row + offs_d, round_to(xc * rstd * w + b, out_dtype), mask=mask_rest)
    # the rotated part: each pair's inputs normalized, rounded, rotated
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    cos = tl.load(cos_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)
    sin = tl.load(sin_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)
    offs_1, offs_2 = rope_pairs(offs_i, HALF, INTERLEAVED)
    x1 = tl.load(x_row + offs_1, mask=mask_i, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + offs_2, mask=mask_i, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs_1, mask=mask_i, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs_2, mask=mask_i, other=0.0).to(tl.float32)
    b1 = tl.load(b_ptr + offs_1, mask=mask_i, other=0.0).to(tl.float32)
    b2 = tl.load(b_ptr + offs_2, mask=mask_i, other=0.0).to(tl.float32)
    k1 = round_to((x1 - mean) * rstd * w1 + b1, out_dtype).to(tl.float32)
    k2 = round_to((x2 - mean) * rstd * w2 + b2, out_dtype).to(tl.float32)
    store_rotated(out_row, offs_i, HALF, k1, k2, cos, sin, mask_i)
