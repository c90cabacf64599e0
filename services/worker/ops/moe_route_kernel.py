"""The MoE router's scoring and top-k for one token per program (``moe_route_triton.py``
launches it and states the contract).

The token's E scores are held flat, expert ``g * group_size + j`` at position ``g * BLOCK_S +
j`` (group g, BLOCK_S >= group_size), so position order is expert order and a reshape to
``[BLOCK_G, BLOCK_S]`` gives the groups. Every choice is an arg-max that breaks ties towards
the lower position, hence the lower expert id. A Triton kernel takes every pointer, stride and
size flat: this file is exempt from the argument-count rule (``pyproject.toml``) and holds only
the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_route_kernel(
    logits_ptr, stride_ln, stride_le,
    bias_ptr,
    given_ptr, stride_gn, stride_gk,
    weights_ptr, stride_wn, stride_wk,
    experts_ptr, stride_xn, stride_xk,
    group_size, scale,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    GIVEN: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_ln
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < TOP_K
    if GIVEN:
        chosen = tl.load(given_ptr + row * stride_gn + offs_k * stride_gk, mask=mask_k, other=0)
        chosen = chosen.to(tl.int64)
    else:
        offs = tl.arange(0, BLOCK_G * BLOCK_S)
        group = offs // BLOCK_S
        expert = group * group_size + offs % BLOCK_S
        mask = (group < N_GROUP) & (offs % BLOCK_S < group_size)
        logit = tl.load(logits_row + expert * stride_le, mask=mask, other=0.0)
        bias = tl.load(bias_ptr + expert, mask=mask, other=0.0).to(tl.float32)
        choice = tl.where(mask, tl.sigmoid(logit) + bias, float("-inf"))  # [BLOCK_G * BLOCK_S]
        if TOPK_GROUP < N_GROUP:
            # a group's score: its two best choice scores summed (the best one taken out once)
            grouped = tl.reshape(choice, (BLOCK_G, BLOCK_S))
            offs_s = tl.arange(0, BLOCK_S)
            best = tl.max(grouped, 1)  # [BLOCK_G]
            first = tl.argmax(grouped, 1, tie_break_left=True)
            rest = tl.where(offs_s[None, :] == first[:, None], float("-inf"), grouped)
            group_score = best + tl.max(rest, 1)
            offs_g = tl.arange(0, BLOCK_G)
            group_score = tl.where(offs_g < N_GROUP, group_score, float("-inf"))
            keep = offs < 0  # all False, [BLOCK_G * BLOCK_S]
            for _ in tl.static_range(TOPK_GROUP):
                top = tl.argmax(group_score, 0, tie_break_left=True)
                keep = keep | (group == top)
                group_score = tl.where(offs_g == top, float("-inf"), group_score)
            choice = tl.where(keep, choice, float("-inf"))
        chosen = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            pos = tl.argmax(choice, 0, tie_break_left=True)
            pick = (pos // BLOCK_S) * group_size + pos % BLOCK_S
            chosen = tl.where(offs_k == j, pick.to(tl.int64), chosen)
            choice = tl.where(offs == pos, float("-inf"), choice)
    # the chosen experts' unbiased scores, read again (the same sigmoid of the same logit)
    s = tl.sigmoid(tl.load(logits_row + chosen * stride_le, mask=mask_k, other=0.0))
    s = tl.where(mask_k, s, 0.0)
    if NORM:
        total = tl.sum(s, 0) + 1e-20
        s = tl.math.div_rn(s, tl.full([BLOCK_K], 0.0, tl.float32) + total)
    w = s * scale
    tl.store(weights_ptr + row * stride_wn + offs_k * stride_wk, w, mask=mask_k)
    tl.store(experts_ptr + row * stride_xn + offs_k * stride_xk, chosen, mask=mask_k)
