"""DeepSeek-V4's hyper-connection weights from their mixing logits in one program per token
(``hyper_mix_triton.py`` states the contract): ``pre`` and ``post`` (sigmoids) and ``comb``
(a softmax over each row, then Sinkhorn's alternating row and column normalisations), in fp32
registers, with IEEE division as torch's. A Triton kernel file holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    """torch.sigmoid's ``1 / (1 + exp(-x))`` with IEEE division."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))


@triton.jit
def hyper_mix_kernel(
    logits_ptr, stride_ln, base_ptr, scale_ptr,
    pre_ptr, post_ptr, comb_ptr,
    H, iters, hc_eps,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    valid = offs < H
    logits = logits_ptr + row * stride_ln
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)

    pre = _sigmoid(
        tl.load(logits + offs, mask=valid) * s_pre + tl.load(base_ptr + offs, mask=valid)
    )
    tl.store(pre_ptr + row * H + offs, pre + hc_eps, mask=valid)
    post_x = tl.load(logits + H + offs, mask=valid) * s_post + tl.load(
        base_ptr + H + offs, mask=valid
    )
    tl.store(post_ptr + row * H + offs, 2.0 * _sigmoid(post_x), mask=valid)

    # comb [i, j] at 2H + i * H + j; softmax over j, then Sinkhorn (columns first)
    cell = offs[:, None] * H + offs[None, :]
    both = valid[:, None] & valid[None, :]
    x = tl.load(logits + 2 * H + cell, mask=both, other=0.0) * s_comb
    x = x + tl.load(base_ptr + 2 * H + cell, mask=both, other=0.0)
    x = tl.where(both, x, float("-inf"))
    row_max = tl.where(valid, tl.max(x, axis=1), 0.0)  # padded rows: no -inf - -inf
    e = tl.exp(x - row_max[:, None])  # 0 in padded cells
    row_sum = tl.where(valid, tl.sum(e, axis=1), 1.0)
    comb = tl.math.div_rn(e, tl.broadcast_to(row_sum[:, None], e.shape))
    comb = tl.where(both, comb + hc_eps, 0.0)
    comb = tl.math.div_rn(comb, tl.broadcast_to(tl.sum(comb, axis=0)[None, :] + hc_eps, e.shape))
    for _ in range(iters - 1):
        comb = tl.math.div_rn(
            comb, tl.broadcast_to(tl.sum(comb, axis=1)[:, None] + hc_eps, e.shape)
        )
        comb = tl.math.div_rn(
            comb, tl.broadcast_to(tl.sum(comb, axis=0)[None, :] + hc_eps, e.shape)
        )
    comb = tl.where(both, comb, 0.0)
    tl.store(comb_ptr + row * H * H + cell, comb, mask=both)
