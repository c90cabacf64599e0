"""The grouped W4A16 GEMM over experts held in FP4 e2m1 (``fp4_e2m1.py``): one program per
[BLOCK_M, BLOCK_N] tile of one block of expert-sorted rows (``moe_align.py``), a loop over the
packed K in blocks of ``BLOCK_KP`` bytes (``fp4_moe.py`` launches it and holds the torch
references).

Rows as in ``fp8_moe_kernel.py``: a block's rows are pairs ``p`` of ``sorted_ids`` (padding rows
hold ``n_pairs`` and are masked); row ``p`` reads activation row ``p // a_row_div`` and writes
output row ``p``; the block's expert ``e`` picks ``W[e]`` and its scales; a block with expert -1
is past the used ones and its program returns at once.

The weight ``W[e] [N, K / 2]`` uint8 holds column ``2j`` in the lower nibble of byte ``j`` and
column ``2j + 1`` in the upper; its scales ``[N, K / 32]`` uint8 are UE8M0 biased exponents.
A K step reads a [G, 16, BLOCK_N] tile of bytes (G groups of 16 bytes, one scale each) and keeps
the nibbles apart: the lower nibbles meet the even activation columns and the upper ones the
odd columns, two dots per step into one fp32 accumulator, so nothing is interleaved in
registers. Each code becomes its exact value ``e2m1 * 2**(byte - 127)`` (``_e2m1_values``:
bit placement, one fp16 -> fp32 widening, one multiply), then ``DOT_DTYPE``, exact in bf16 and
fp32 (fp32's exponent range). That holds for exponents 2..240 (scales ``2**-125 .. 2**113``).
``EVEN_K``: the packed K is a multiple of ``BLOCK_KP`` (no K masks).

``GLU``: the weight holds gate rows ``[0, N)`` and up rows ``[up_row, up_row + N)`` (their
scales the same rows of the scale grid); the program accumulates both tiles and stores
``silu(gate) * up``, with ``CLAMP`` (compile-time) the gate first clamped to <= ``limit`` and
up to [-limit, limit]. ``WEIGHTED``: the output row is multiplied by ``pair_weight[p]`` (fp32)
before the store.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

GROUP_BYTES = tl.constexpr(16)  # packed bytes per scale (32 columns)


@triton.jit
def _e2m1_values(packed, scale, HIGH: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The lower (or, ``HIGH``, upper) nibbles of ``packed`` int32 bytes [G, 16, BLOCK_N] times
    their group's ``scale`` fp32 [G, 1, BLOCK_N] (``2**(byte - 113)``) -> ``DOT_DTYPE``. The code's
    sign and three magnitude bits land on an fp16's sign, two low exponent bits and first
    mantissa bit: that fp16 is ``e2m1 * 2**-14`` (a subnormal for 0.5, exact), and the
    scale's ``2**14`` puts the value back."""
    if HIGH:
        bits = ((packed & 0x70) << 5) | ((packed & 0x80) << 8)
    else:
        bits = ((packed & 0x07) << 9) | ((packed & 0x08) << 12)
    tiny = bits.to(tl.int16).to(tl.float16, bitcast=True)
    return (tiny.to(tl.float32) * scale).to(DOT_DTYPE)


@triton.jit
def _nibble_dots(acc, a_even, a_odd, packed, exps, BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``acc`` plus the lower nibbles times the even activation columns and the upper ones times
    the odd, each group of 16 bytes scaled by ``exps`` [G, BLOCK_N] (UE8M0 bytes, int32)."""
    scale = ((exps + 14) << 23).to(tl.float32, bitcast=True)[:, None, :]  # 2**(byte - 113)
    lo = tl.reshape(_e2m1_values(packed, scale, False, DOT_DTYPE), (BLOCK_KP, BLOCK_N))
    hi = tl.reshape(_e2m1_values(packed, scale, True, DOT_DTYPE), (BLOCK_KP, BLOCK_N))
    acc = tl.dot(a_even, lo, acc, input_precision=PREC, out_dtype=tl.float32)
    return tl.dot(a_odd, hi, acc, input_precision=PREC, out_dtype=tl.float32)


@triton.jit
def fp4_moe_kernel(
    a_ptr, stride_am, stride_ak,
    w_ptr, stride_we, stride_wn, stride_wk,
    s_ptr, stride_se, stride_sn, stride_sk,
    sorted_ids_ptr, block_expert_ptr, pair_weight_ptr,
    c_ptr, stride_cm, stride_cn,
    n_pairs, N, K_PACKED, a_row_div, up_row, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
    EVEN_K: tl.constexpr, GLU: tl.constexpr, CLAMP: tl.constexpr, WEIGHTED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = BLOCK_KP // GROUP_BYTES  # scale groups per K step
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    mask_m = pair < n_pairs
    a_rows = a_ptr + (pair // a_row_div).to(tl.int64) * stride_am  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kp = tl.arange(0, BLOCK_KP)
    offs_g = tl.arange(0, G)
    # the packed columns of a step as [G, 16, 1]: group, byte within the group
    kp3 = offs_g[:, None, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :, None]
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    rows = offs_n.to(tl.int64)
    up_rows = (up_row + offs_n).to(tl.int64)
    w_rows, up_w_rows = w_e + rows * stride_wn, w_e + up_rows * stride_wn  # [BLOCK_N]
    s_rows, up_s_rows = s_e + rows * stride_sn, s_e + up_rows * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K_PACKED, BLOCK_KP)):
        kp = kb * BLOCK_KP + offs_kp  # [BLOCK_KP] packed columns
        k3 = kb * BLOCK_KP + kp3  # [G, 16, 1]
        groups = kb * G + offs_g  # [G]
        if EVEN_K:
            mask_a = mask_m[:, None]
            mask_w = mask_n[None, None, :]
            mask_s = mask_n[None, :]
        else:
            mask_a = mask_m[:, None] & (kp < K_PACKED)[None, :]
            mask_w = mask_n[None, None, :] & (k3 < K_PACKED)
            mask_s = mask_n[None, :] & (groups * GROUP_BYTES < K_PACKED)[:, None]
        a_even = a_rows[:, None] + (2 * kp)[None, :] * stride_ak  # [BLOCK_M, BLOCK_KP]
        a_lo = tl.load(a_even, mask=mask_a, other=0.0).to(DOT_DTYPE)
        a_hi = tl.load(a_even + stride_ak, mask=mask_a, other=0.0).to(DOT_DTYPE)
        w_off = k3 * stride_wk
        s_off = groups[:, None] * stride_sk  # [G, 1]
        packed = tl.load(w_rows[None, None, :] + w_off, mask=mask_w, other=0).to(tl.int32)
        exps = tl.load(s_rows[None, :] + s_off, mask=mask_s, other=0).to(tl.int32)  # [G, BN]
        acc = _nibble_dots(acc, a_lo, a_hi, packed, exps, BLOCK_KP, BLOCK_N, DOT_DTYPE, PREC)
        if GLU:
            packed = tl.load(up_w_rows[None, None, :] + w_off, mask=mask_w, other=0).to(tl.int32)
            exps = tl.load(up_s_rows[None, :] + s_off, mask=mask_s, other=0).to(tl.int32)
            acc_up = _nibble_dots(acc_up, a_lo, a_hi, packed, exps, BLOCK_KP, BLOCK_N, DOT_DTYPE,
                                  PREC)  # fmt: skip
    if GLU:
        if CLAMP:
            acc = tl.minimum(acc, limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(pair_weight_ptr + pair, mask=mask_m, other=0.0)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
