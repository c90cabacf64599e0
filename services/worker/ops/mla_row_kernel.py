"""The MLA stored-row kernel: one program per token turns the kv_a projection's output
``[latent ; k_rope]`` into the stored row ``[rms_norm(latent) ; rope(k_rope)]`` (see
``norm_rope.py``, which launches it and holds the torch form).

The norm is ``rms_norm_kernel``'s (fp32, one rounding to the output's dtype); the RoPE is
``rope_kernel``'s for one head (pairs (2i, 2i + 1) with ``INTERLEAVED``, else (i, i + HALF),
written de-interleaved), bit for bit torch's with fp fusion off.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to
from services.worker.ops.rope_kernel import rope_pairs, store_rotated


@triton.jit
def mla_row_kernel(
    x_ptr, stride_xn,
    w_ptr,
    cos_ptr, sin_ptr, stride_cn,
    out_ptr, stride_on,
    D_NORM, HALF, eps,
    BLOCK_NORM: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + n * stride_xn
    out_row = out_ptr + n * stride_on
    out_dtype = out_ptr.dtype.element_ty
    # the latent's RMSNorm
    offs_d = tl.arange(0, BLOCK_NORM)
    mask_d = offs_d < D_NORM
    x = tl.load(x_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D_NORM + eps)
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(out_row + offs_d, round_to((x * rstd) * w, out_dtype), mask=mask_d)
    # k_rope's RoPE, after the latent
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    cos = tl.load(cos_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)
    sin = tl.load(sin_ptr + n * stride_cn + offs_i, mask=mask_i, other=0.0)
    offs_1, offs_2 = rope_pairs(offs_i, HALF, INTERLEAVED)
    x1 = tl.load(x_row + D_NORM + offs_1, mask=mask_i, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + D_NORM + offs_2, mask=mask_i, other=0.0).to(tl.float32)
    store_rotated(out_row + D_NORM, offs_i, HALF, x1, x2, cos, sin, mask_i)
