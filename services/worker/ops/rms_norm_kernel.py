"""The RMSNorm kernel, optionally joined with the residual add before it: one program per row
(see ``rms_norm.py``, which launches it and holds the torch forms).

With ``HAS_RESIDUAL`` the program first forms ``summed = residual + x`` as torch's ``h + a``
does (both widened to fp32, added, rounded once to x's dtype), stores it, and normalizes it.
The norm is in fp32: ``y = (x * rsqrt(mean(x^2) + eps)) * weight`` (``HAS_WEIGHT`` False: no
weight, ``y = x * rsqrt(mean(x^2) + eps)``), stored in the output's dtype.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to


@triton.jit
def rms_norm_kernel(
    x_ptr, stride_xm,
    res_ptr, stride_rm,
    w_ptr,
    out_ptr, stride_om,
    sum_ptr, stride_sm,
    D, eps,
    BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(x_ptr + row * stride_xm + offs_d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rm + offs_d, mask=mask, other=0.0)
        x = round_to(r.to(tl.float32) + x.to(tl.float32), x.dtype)
        tl.store(sum_ptr + row * stride_sm + offs_d, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / D
    rstd = tl.rsqrt(mean_sq + eps)
    y = xf * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_d, round_to(y, out_ptr.dtype.element_ty), mask=mask)
