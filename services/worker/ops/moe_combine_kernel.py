"""The MoE combine (``moe_combine_triton.py`` states the contract): one program per (token,
``BLOCK_D`` columns) loads the token's K pair rows, zero for a pair whose expert id is
``n_experts`` (held elsewhere), and sums them in ``sum_choices``' pairwise halves: K = 2**L
rows viewed as ``[2, K / 2, BLOCK_D]`` and summed over the leading two (row i plus row
i + K / 2: one fp32 add each, exact in any order), L times. Then the cast to the output's dtype
(``BF16``: rounded to bf16 first).
A Triton kernel file holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import bf16_bits, bf16_value


@triton.jit
def moe_combine_kernel(
    y_ptr, stride_yp, stride_yd,
    idx_ptr, stride_it, stride_ik,
    out_ptr, stride_ot, stride_od,
    n_experts, D,
    K: tl.constexpr, LOG2_K: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, K)
    ids = tl.load(idx_ptr + token * stride_it + offs_k * stride_ik)  # [K]
    rows = token * K + offs_k  # the token's pairs
    mask = (ids < n_experts)[:, None] & (offs_d < D)[None, :]
    y = tl.load(y_ptr + rows[:, None] * stride_yp + offs_d[None, :] * stride_yd, mask=mask,
                other=0.0)  # fmt: skip
    for level in tl.static_range(LOG2_K):
        y = tl.sum(tl.reshape(y, (2, K >> (level + 1), BLOCK_D)), 0)
    total = tl.reshape(y, (BLOCK_D,))
    if BF16:
        # round to nearest even in integers, so the cast below is exact: the interpreter's
        # fp32 -> bf16 cast truncates, the GPU's rounds; NaN kept as it is
        total = tl.where(total != total, total, bf16_value(bf16_bits(total)))
    out = total.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_ot + offs_d * stride_od, out, mask=offs_d < D)
