"""SwiGLU's ``silu(gate) * up`` in one pass (``silu_mul_triton.py`` states the contract): one
program per (row, ``BLOCK_N`` columns), in fp32, each of torch's two roundings to the output
dtype kept (``ROUND``: 0 fp32, 1 bf16, 2 fp16; bf16 rounded in integers, which the interpreter's
own cast does not do). A Triton kernel file holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import bf16_bits, bf16_value


@triton.jit
def _round(v, ROUND: tl.constexpr):
    """v (fp32) rounded to the output dtype, to nearest even, held as fp32; NaN as it is."""
    if ROUND == 1:
        v = tl.where(v != v, v, bf16_value(bf16_bits(v)))
    elif ROUND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def silu_mul_kernel(
    gate_ptr, stride_gm, stride_gn,
    up_ptr, stride_um, stride_un,
    out_ptr, stride_om, stride_on,
    N,
    BLOCK_N: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    g = tl.load(gate_ptr + row * stride_gm + offs_n * stride_gn, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_um + offs_n * stride_un, mask=mask, other=0.0)
    g = g.to(tl.float32)
    silu = _round(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ROUND)  # torch's F.silu, then its cast
    out = _round(silu * u.to(tl.float32), ROUND).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + offs_n * stride_on, out, mask=mask)
