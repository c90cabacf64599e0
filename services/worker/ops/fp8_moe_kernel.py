"""The grouped FP8 block-scaled GEMM over experts: one program per [BLOCK_M, BLOCK_N] tile of
one block of expert-sorted rows (``moe_align.py``), a loop over K in blocks of 128 aligned to
the weight's scale grid (``fp8_moe.py`` launches it and holds the torch references).

A block's rows are pairs ``p`` of ``sorted_ids`` (padding rows hold ``n_pairs`` and are masked);
row ``p`` reads activation row ``p // a_row_div`` (the token, for the first GEMM; the pair, for
the second) and writes output row ``p``. The block's expert ``e`` picks ``W[e]`` and its scale
grid; a block with expert -1 is past the used ones and its program returns at once.

Activation modes as in ``fp8_linear_kernel.py`` (``A8``: 1x128 groups quantized in the kernel,
FP8 x FP8; otherwise the e4m3 tile widened to ``DOT_DTYPE``), with fp32 accumulation and each
K block's partial sum scaled by its block scale(s).

``GLU``: the weight holds gate rows ``[0, N)`` and up rows ``[up_row, up_row + N)``, whose scale
rows start at 0 and at ``up_srow``; the program accumulates both tiles and stores
``silu(gate) * up`` (fp32, then the output's dtype); with ``CLAMP`` (compile-time, so the kernel
without it is unchanged) the gate is first clamped to <= ``limit`` and up to [-limit, limit],
DeepSeek-V4's SwiGLU. ``WEIGHTED``: the output row is multiplied by ``pair_weight[p]`` (fp32)
before the store.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import round_to_e4m3

FP8_MAX = tl.constexpr(448.0)
AMAX_MIN = tl.constexpr(1e-4)


@triton.jit
def _block_dot(a, a_scale, w, w_scale, A8: tl.constexpr, DOT_DTYPE: tl.constexpr,
               PREC: tl.constexpr):  # fmt: skip
    """One K block's scaled partial product [BLOCK_M, BLOCK_N] in fp32."""
    if A8:
        part = tl.dot(a, w, out_dtype=tl.float32) * (a_scale[:, None] * w_scale[None, :])
    else:
        # Through fp32: exact, and the interpreter's direct e4m3 -> bf16 cast is wrong.
        w = w.to(tl.float32).to(DOT_DTYPE)
        part = tl.dot(a, w, input_precision=PREC, out_dtype=tl.float32) * w_scale[None, :]
    return part


@triton.jit
def fp8_moe_kernel(
    a_ptr, stride_am, stride_ak,
    w_ptr, stride_we, stride_wn, stride_wk,
    s_ptr, stride_se, stride_sn, stride_sk,
    sorted_ids_ptr, block_expert_ptr, pair_weight_ptr,
    c_ptr, stride_cm, stride_cn,
    n_pairs, N, K, a_row_div, up_row, up_srow, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A8: tl.constexpr, GLU: tl.constexpr, CLAMP: tl.constexpr, WEIGHTED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    mask_m = pair < n_pairs
    a_rows = a_ptr + (pair // a_row_div).to(tl.int64) * stride_am  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    # BLOCK_K is the scale block: K block kb has the weight scales of column kb.
    w_cols = w_e + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]
    s_rows = s_e + (offs_n // BLOCK_K) * stride_sn  # [BLOCK_N]
    up_cols = w_e + (up_row + offs_n).to(tl.int64) * stride_wn
    up_s_rows = s_e + (up_srow + offs_n // BLOCK_K) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(
            a_rows[:, None] + k[None, :] * stride_ak,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if A8:
            af = a.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(af), axis=1), AMAX_MIN)  # [BLOCK_M]
            a_scale = tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX, tl.float32))
            aq = tl.math.div_rn(af, a_scale[:, None])
            a = round_to_e4m3(tl.clamp(aq, -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
        else:
            a_scale = tl.zeros([BLOCK_M], tl.float32)  # unused
            a = a.to(DOT_DTYPE)
        mask_w = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_cols[None, :] + k[:, None] * stride_wk, mask=mask_w, other=0.0)
        w_scale = tl.load(s_rows + kb * stride_sk, mask=mask_n, other=0.0)  # [BLOCK_N]
        acc += _block_dot(a, a_scale, w, w_scale, A8, DOT_DTYPE, PREC)
        if GLU:
            u = tl.load(up_cols[None, :] + k[:, None] * stride_wk, mask=mask_w, other=0.0)
            u_scale = tl.load(up_s_rows + kb * stride_sk, mask=mask_n, other=0.0)
            acc_up += _block_dot(a, a_scale, u, u_scale, A8, DOT_DTYPE, PREC)
    if GLU:
        if CLAMP:
            acc = tl.minimum(acc, limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(pair_weight_ptr + pair, mask=mask_m, other=0.0)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
