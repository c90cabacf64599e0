"""DeepSeek-V4's hyper-connection streams collapsed and merged, one program per token and
block of channels (``hyper_streams_triton.py`` states the contract). Each rounding the torch
form makes in the streams' dtype is made here at the same point; the sums over the H streams
are fp32, in the kernel's order. A Triton kernel file holds only the kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to


@triton.jit
def hyper_collapse_kernel(
    streams_ptr, pre_ptr, out_ptr, H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_H)
    in_h, in_d = j < H, d < D
    s = tl.load(
        streams_ptr + n * H * D + j[:, None] * D + d[None, :],
        mask=in_h[:, None] & in_d[None, :],
        other=0.0,
    ).to(tl.float32)
    pre = tl.load(pre_ptr + n * H + j, mask=in_h, other=0.0)
    x = tl.sum(pre[:, None] * s, axis=0)
    tl.store(out_ptr + n * D + d, round_to(x, out_ptr.dtype.element_ty), mask=in_d)


@triton.jit
def hyper_merge_kernel(
    streams_ptr, block_out_ptr, post_ptr, comb_ptr, new_ptr, H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_H)  # the source stream; the same lanes name the target stream k
    in_h, in_d = j < H, d < D
    dt = new_ptr.dtype.element_ty
    s = tl.load(
        streams_ptr + n * H * D + j[:, None] * D + d[None, :],
        mask=in_h[:, None] & in_d[None, :],
        other=0.0,
    ).to(tl.float32)
    # comb[j, k], rounded to the streams' dtype as the torch form's matmul reads it
    comb = tl.load(
        comb_ptr + n * H * H + j[:, None] * H + j[None, :],
        mask=in_h[:, None] & in_h[None, :],
        other=0.0,
    )
    comb = round_to(comb, dt).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)  # [k, D]
    mixed = round_to(mixed, dt).to(tl.float32)
    post = round_to(tl.load(post_ptr + n * H + j, mask=in_h, other=0.0), dt).to(tl.float32)
    out = tl.load(block_out_ptr + n * D + d, mask=in_d, other=0.0).to(tl.float32)
    placed = round_to(post[:, None] * out[None, :], dt).to(tl.float32)
    tl.store(
        new_ptr + n * H * D + j[:, None] * D + d[None, :],
        round_to(placed + mixed, dt),
        mask=in_h[:, None] & in_d[None, :],
    )
