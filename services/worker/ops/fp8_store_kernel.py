"""The FP8 quantize-and-store kernel: one program per source row, written as packed bytes at its
destination row of a uint8 pool (see ``fp8_store_triton.py``, which launches it)."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import bf16_bits, e4m3_bits, pow2, scale_exp


@triton.jit
def fp8_store_kernel(
    src_ptr, stride_src,
    dst_ptr,
    pool_ptr, stride_pool,
    N_VALUES: tl.constexpr, TILE: tl.constexpr, N_TAIL: tl.constexpr, TAIL_P: tl.constexpr,
    MIN_EXP: tl.constexpr, SRC_BF16: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    loc = tl.load(dst_ptr + n).to(tl.int64)
    src = src_ptr + n * stride_src
    row = pool_ptr + tl.maximum(loc, 0) * stride_pool
    offs = tl.arange(0, TILE)
    offs4 = tl.arange(0, 4)
    # -1: a padded source row, not written (masks as tensors: the interpreter wants them so)
    keep_t = loc + offs * 0 >= 0
    keep_4 = loc + offs4 * 0 >= 0
    for t in tl.static_range(N_VALUES // TILE):
        x = tl.load(src + t * TILE + offs).to(tl.float32)
        k = tl.maximum(scale_exp(tl.max(tl.abs(x), 0)), MIN_EXP)
        q = e4m3_bits(x * pow2(-k))  # x / 2^k, exact
        tl.store(row + t * TILE + offs, q.to(tl.uint8), mask=keep_t)
        bits = ((k + 127) << 23) + tl.zeros([4], tl.int32)  # the fp32 scale, little-endian
        tl.store(row + N_VALUES + 4 * t + offs4, ((bits >> (8 * offs4)) & 0xFF).to(tl.uint8),
                 mask=keep_4)  # fmt: skip
    if N_TAIL > 0:
        offs_r = tl.arange(0, TAIL_P)
        rmask = (loc + offs_r * 0 >= 0) & (offs_r < N_TAIL)
        y = tl.load(src + N_VALUES + offs_r, mask=offs_r < N_TAIL, other=0.0)
        if SRC_BF16:
            bits = y.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            bits = bf16_bits(y.to(tl.float32))
        tail = row + N_VALUES + 4 * (N_VALUES // TILE) + 2 * offs_r
        tl.store(tail, (bits & 0xFF).to(tl.uint8), mask=rmask)
        tl.store(tail + 1, (bits >> 8).to(tl.uint8), mask=rmask)
