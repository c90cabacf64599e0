"""The FP8 block-scaled matmul kernel ``y = x @ dequant(W)^T (+ bias)``: one program per
[BLOCK_M, BLOCK_N] tile of y and split of K, a loop over that split's K blocks of 128 aligned
to the weight's scale grid (see ``fp8_linear.py``, which launches it, sums the splits and holds
the torch references). With one split the program writes y itself (bias included); with more
it writes its fp32 partial sum at ``y[split]`` and adds no bias.

Two activation modes, chosen at compile time by ``A8``:
- W8A16 (``A8=False``): the e4m3 weight tile is widened to ``DOT_DTYPE`` (x's dtype on a GPU,
  exact: e4m3 fits bf16 and fp16), multiplied with x with fp32 accumulation, and the block's
  partial sum scaled by the weight's block scale. The interpreter's bf16/fp16 ``tl.dot`` is
  wrong, so there ``DOT_DTYPE`` is fp32: the same numbers, since a product of two bf16 (or
  fp16, or e4m3) values is exact in fp32.
- W8A8 (``A8=True``): each [BLOCK_M, 128] tile of x is quantized per row (one 1x128 group:
  scale = amax / 448, amax at least 1e-4, as DeepSeek's ``act_quant``), FP8 x FP8 products are
  accumulated in fp32, and the partial sum is scaled by x_scale * w_scale. Every program
  quantizes the x tiles it reads (the same values each time); no x_fp8 is written.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import round_to_e4m3

FP8_MAX = tl.constexpr(448.0)
AMAX_MIN = tl.constexpr(1e-4)


@triton.jit
def fp8_linear_kernel(
    x_ptr, stride_xm, stride_xk,
    w_ptr, stride_wn, stride_wk,
    w_scale_ptr, stride_wsn, stride_wsk,
    bias_ptr,
    y_ptr, stride_ys, stride_ym, stride_yn,
    M, N, K, KB_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A8: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # split-K: this program's K blocks, its partial sum at y[pid_s]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # BLOCK_K is the scale block: K block kb has the weight scales of column kb.
    w_scale_row = w_scale_ptr + (offs_n // BLOCK_K) * stride_wsn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    kb_end = tl.minimum((pid_s + 1) * KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    for kb in range(pid_s * KB_PER_SPLIT, kb_end):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] e4m3, W^T's tile
        w_scale = tl.load(w_scale_row + kb * stride_wsk, mask=mask_n, other=0.0)  # [BLOCK_N]
        if A8:
            xf = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xf), axis=1), AMAX_MIN)  # [BLOCK_M]
            x_scale = tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX, tl.float32))
            xq = tl.math.div_rn(xf, x_scale[:, None])
            xq = round_to_e4m3(tl.clamp(xq, -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
            part = tl.dot(xq, w, out_dtype=tl.float32)
            acc += part * (x_scale[:, None] * w_scale[None, :])
        else:
            # Through fp32: exact, and the interpreter's direct e4m3 -> bf16 cast is wrong.
            w = w.to(tl.float32).to(DOT_DTYPE)
            part = tl.dot(x.to(DOT_DTYPE), w, input_precision=PREC, out_dtype=tl.float32)
            acc += part * w_scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(
        y_ptr + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
