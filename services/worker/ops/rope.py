"""Rotary embedding of the first ``d_rope`` elements of a tensor's last dimension as one kernel
(``rope_kernel.py``), reading the tables a ``Rotary`` holds and writing into a given output, or
a slice of one, so that no ``torch.cat`` assembles the result.

``rope_ref`` is the torch form (``model.rotary.apply_rope`` on the first ``d_rope`` elements,
the rest concatenated after them); the kernel equals it bit for bit, both layouts, every dtype:
the same fp32 products and sums in the same order, one rounding to the output's dtype."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.rope_kernel import rope_kernel

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """``x [N, ..., D]``, ``cos``/``sin [N, d_rope / 2]`` fp32 (``Rotary.tables(d_rope)``) ->
    ``[rope(x[..., :d_rope]) ; x[..., d_rope:]]`` in x's dtype. Rotate-half pairs
    (i, i + d_rope/2); ``interleaved`` pairs (2i, 2i + 1), returned de-interleaved."""
    d = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    c, s = cos.view(shape), sin.view(shape)
    xf = x[..., :d].float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rot, x[..., d:]], dim=-1)


def as_heads(t: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` or ``[N, H, D]`` as a ``[N, H, D]`` view."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() != 3:
        raise ValueError(f"expected [N, D] or [N, H, D], got {tuple(t.shape)}")
    return t


def check_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The rotary kernels' inputs: x of ``X_DTYPES``, and fp32 tables ``[N, half]`` of one
    layout with unit last stride that fit x (``2 * half <= D``)."""
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}, got {x.dtype}")
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape != (x.shape[0], half) or 2 * half > x.shape[-1]:
        raise ValueError(f"tables {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must be fp32 tables of one layout")
    if cos.stride(1) != 1:
        raise ValueError("the tables need a unit last stride")


def rope_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [N, D]`` or ``[N, H, D]`` (unit last stride), ``cos``/``sin [N, d_rope / 2]`` fp32
    with unit last stride -> ``out``: ``rope_ref(x, cos, sin, interleaved)`` when out's last
    dimension is D, only its first ``d_rope`` elements (x's first ``d_rope``, rotated) when
    that is ``d_rope``. ``out``: default a new tensor like x; else of x's leading shape, any
    float dtype (the values are rounded to it), unit last stride, e.g. a column slice of a
    preallocated row. Returns ``out``."""
    check_tables(x, cos, sin)
    half = cos.shape[-1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if out.shape[:-1] != x.shape[:-1] or out.shape[-1] not in (x.shape[-1], 2 * half):
        raise ValueError(f"out {tuple(out.shape)} does not fit x {tuple(x.shape)}")
    x3, o3 = as_heads(x), as_heads(out)
    if x3.stride(2) != 1 or o3.stride(2) != 1:
        raise ValueError("x and out need a unit last stride")
    n, h = x3.shape[0], x3.shape[1]
    rest = out.shape[-1] - 2 * half
    if n == 0 or h == 0:
        return out
    block_h = min(triton.next_power_of_2(h), 16)
    rope_kernel[(n, triton.cdiv(h, block_h))](
        x3, x3.stride(0), x3.stride(1),
        cos, sin, cos.stride(0),
        o3, o3.stride(0), o3.stride(1),
        h, half, rest,
        BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
        INTERLEAVED=interleaved,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
