"""The FP8 gather-and-dequantize kernel: one program per output row, read from its pool row
(``-1``: padding, zeros) and dequantized (see ``fp8_gather_triton.py``, which launches it)."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import bf16_value, e4m3_value


@triton.jit
def fp8_gather_kernel(
    pool_ptr, stride_pool,
    src_ptr,
    out_ptr, stride_out,
    N_VALUES: tl.constexpr, TILE: tl.constexpr, N_TAIL: tl.constexpr, TAIL_P: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    loc = tl.load(src_ptr + m).to(tl.int64)
    # -1: padding reads no bytes; every field loads as 0, so the row is +0.0
    row = pool_ptr + tl.maximum(loc, 0) * stride_pool
    out = out_ptr + m * stride_out
    offs = tl.arange(0, TILE)
    offs4 = tl.arange(0, 4)
    for t in tl.static_range(N_VALUES // TILE):
        b = tl.load(row + t * TILE + offs, mask=loc + offs * 0 >= 0, other=0).to(tl.int32)
        sb = tl.load(row + N_VALUES + 4 * t + offs4, mask=loc + offs4 * 0 >= 0, other=0)
        scale = tl.sum(sb.to(tl.int32) << (8 * offs4), 0).to(tl.float32, bitcast=True)
        v = e4m3_value(b) * scale
        tl.store(out + t * TILE + offs, v.to(out_ptr.dtype.element_ty))
    if N_TAIL > 0:
        offs_r = tl.arange(0, TAIL_P)
        rmask = offs_r < N_TAIL
        tail = row + N_VALUES + 4 * (N_VALUES // TILE) + 2 * offs_r
        lo = tl.load(tail, mask=(loc + offs_r * 0 >= 0) & rmask, other=0).to(tl.int32)
        hi = tl.load(tail + 1, mask=(loc + offs_r * 0 >= 0) & rmask, other=0).to(tl.int32)
        v = bf16_value(lo | (hi << 8))
        tl.store(out + N_VALUES + offs_r, v.to(out_ptr.dtype.element_ty), mask=rmask)
