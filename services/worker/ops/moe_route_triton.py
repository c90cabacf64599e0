"""The DeepSeek-V3 router after its GEMM as one Triton kernel (``moe_route_kernel.py``): the
fused form of ``Router.forward`` (``services/worker/model/mla_moe.py``), whose torch code is the
reference. ``router_logits`` is the GEMM before it.

Contract of ``route_triton``: logits [N, E] fp32 -> (weights [N, top_k] fp32, experts
[N, top_k] int64). Scores s = sigmoid(logits); the choice ranks s + bias within the
``topk_group`` groups (E / n_group consecutive experts each) whose two best choice scores sum
highest; weights are the chosen experts' s, divided by their sum plus 1e-20 when ``norm``,
times ``scale``. The chosen SET equals the torch form's wherever no two candidates tie; the
order emitted is descending choice score (s + bias), and on equal scores the lower expert id
(or group id, for the groups) is taken first. With ``given`` [N, top_k] the experts are given:
they are emitted in their order and only their weights are computed. The weights differ from
the torch form's by the evaluation of sigmoid and of the k-term sum (a few fp32 ulps relative).

Static grid (one program per token), no host synchronisation: capturable in a CUDA graph."""

from __future__ import annotations

import torch
import triton
from torch.nn import functional as F

from services.worker.ops.moe_route_kernel import moe_route_kernel


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [N, d] @ weight [E, d]^T`` -> [N, E] fp32. On a GPU with both bf16 (or fp16): one GEMM
    of the stored operands with fp32 output (a bf16 product is exact in fp32, so these are the
    widened operands' products), neither operand copied. Elsewhere both widened, as the torch
    form does."""
    if x.is_cuda and x.dtype == weight.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


def route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm: bool,
    scale: float,
    given: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. ``bias`` [E] (any float dtype, widened to fp32)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [N, E] fp32, got {logits.dtype} {tuple(logits.shape)}")
    n, e = logits.shape
    if tuple(bias.shape) != (e,):
        raise ValueError(f"bias {tuple(bias.shape)} is not [{e}]")
    if e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{n_group} groups of {e} experts, top {topk_group} groups")
    group_size = e // n_group
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"top_k {top_k} of {topk_group} groups of {group_size} experts")
    if topk_group < n_group and group_size < 2:
        raise ValueError("group scores take each group's two best experts: groups of >= 2")
    if given is not None and (given.dim() != 2 or tuple(given.shape) != (n, top_k)):
        raise ValueError(f"given {tuple(given.shape)} is not [{n}, {top_k}]")
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, experts
    g = given if given is not None else experts  # unused without GIVEN
    block_s = triton.next_power_of_2(group_size)
    moe_route_kernel[(n,)](
        logits, logits.stride(0), logits.stride(1),
        bias.contiguous(),
        g, g.stride(0), g.stride(1),
        weights, weights.stride(0), weights.stride(1),
        experts, experts.stride(0), experts.stride(1),
        group_size, float(scale),
        N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        BLOCK_G=triton.next_power_of_2(n_group), BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(top_k),
        GIVEN=given is not None, NORM=norm,
        # one warp holds a token's 256 scores in registers: its arg-maxes need no shared memory
        num_warps=1 if triton.next_power_of_2(n_group) * block_s <= 512 else 4,
    )  # fmt: skip
    return weights, experts
