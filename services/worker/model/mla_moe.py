"""DeepSeek-V3 mixture of experts (DeepSeek-V3.2 and GLM-5): a sigmoid router with a
choice-only correction bias and group-limited top-k, routed experts run as one grouped GEMM
over the tokens sorted by expert, and always-on shared experts.

The forward has static shapes and no host synchronisation: every (token, choice) pair is one
row of the grouped GEMM, whatever the routing, and the per-expert offsets stay on the device."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dhisparse.family.hf_config import MoESpec
from services.worker.model.grouped_experts import routed_experts
from services.worker.model.weight_format import BF16, WeightFormat, linear
from services.worker.ops.fusion import fused
from services.worker.ops.moe_route_triton import route_triton, router_logits
from services.worker.ops.silu_mul_triton import silu_mul_triton
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.parallel.shards import Shards


class MLP(nn.Module):
    """SwiGLU with the checkpoint's names (dense layers and the shared experts). ``d_ff``: this
    rank's columns of the intermediate dimension; ``group`` sums the ranks' partial outputs
    (the shared experts leave that to their MoE, which sums once for both)."""

    def __init__(
        self, d_model: int, d_ff: int, fmt: WeightFormat = BF16, group: Comm = LOCAL
    ) -> None:
        super().__init__()
        self.gate_proj = linear(d_model, d_ff, fmt)
        self.up_proj = linear(d_model, d_ff, fmt)
        self.down_proj = linear(d_ff, d_model, fmt)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        # fused: one kernel for silu and the product (ops/silu_mul_triton.py)
        h = silu_mul_triton(gate, up) if fused(gate, "silu_mul") else F.silu(gate) * up
        return self.group.all_reduce(self.down_proj(h))


class Router(nn.Module):
    def __init__(self, spec: MoESpec, d_model: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.n_routed, d_model))
        self.register_buffer("e_score_correction_bias", torch.zeros(spec.n_routed))

    def forward(
        self, x: torch.Tensor, given: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, d_model] -> (weights [N, top_k] fp32, experts [N, top_k] int64).

        Scores s = sigmoid(logits) in fp32; the choice uses s + bias, within the ``topk_group``
        groups whose two best choice scores sum highest; the weights are the chosen experts'
        unbiased s, normalised to sum 1 (when ``norm_topk_prob``), times the routed scale.
        ``given`` [N, top_k] int64: the experts to weigh instead of choosing them (a reference's
        choice, injected); their weights come from these scores the same way.

        Fused (``fused(x)``): the GEMM with fp32 output from the stored operands, then one
        kernel (``ops/moe_route_triton.py``): the same expert set, emitted best first (lower
        id first on equal scores); otherwise the torch form below."""
        sp = self.spec
        if fused(x, "moe_route"):
            return route_triton(
                router_logits(x, self.weight), self.e_score_correction_bias, sp.top_k,
                sp.n_group, sp.topk_group, sp.norm_topk_prob, sp.routed_scaling, given,
            )  # fmt: skip
        s = F.linear(x.float(), self.weight.float()).sigmoid()
        if given is None:
            choice = s + self.e_score_correction_bias.float()
            grouped = choice.view(-1, sp.n_group, sp.n_routed // sp.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
            groups = group_scores.topk(sp.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, sp.n_routed)
            choice = choice.masked_fill(~keep, float("-inf"))
            given = choice.topk(sp.top_k, dim=-1, sorted=False).indices
        idx = given
        w = s.gather(1, idx)
        if sp.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * sp.routed_scaling, idx


class Experts(nn.Module):
    """The routed experts, fused as transformers holds them: gate_up [E, 2I, D], down [E, D, I]
    (this rank's E experts and I columns of each)."""

    def __init__(self, n_experts: int, d_model: int, intermediate: int) -> None:
        super().__init__()
        self.n = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, intermediate))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx / w [N, k] -> sum_j w[:, j] * expert_{idx[:, j]}(x), [N, D]. An id of
        ``n`` (one past the experts held: another rank's expert) contributes nothing."""
        return routed_experts(x, idx, w, self.gate_up_proj, self.down_proj)


class MoE(nn.Module):
    """``fmt``: FP8 holds the routed experts (``FP8Experts``, the fused FP8 MoE) and the shared
    experts in FP8; the router stays in the serving dtype (its bias in fp32).

    ``shards``: this rank holds ``experts()`` of the routed experts (expert parallel) with
    ``expert_intermediate()`` of each one's columns (tensor parallel), and its columns of the
    shared experts; the router is every rank's. Under tensor-parallel attention every rank
    sees the same tokens, so each routes all of them, runs the (token, choice) pairs its
    experts hold, and one sum over the group completes routed and shared experts together.
    Under data-parallel attention each rank has its own tokens: they meet the experts through
    the group's exchange (``parallel.exchange``, this layer's ``key`` naming it there), and the
    shared experts, whole on every rank, run locally."""

    def __init__(
        self, spec: MoESpec, d_model: int, fmt: WeightFormat, shards: Shards, key: int
    ) -> None:
        super().__init__()
        lay = shards.layout
        self.held = lay.experts()
        inter = lay.expert_intermediate().size
        self.group = shards.experts
        self.key = key
        self.gate = Router(spec, d_model)
        if fmt.fp8:
            from services.worker.model.fp8_experts import FP8Experts

            self.experts: nn.Module = FP8Experts(self.held.size, d_model, inter, mode=fmt.mode)
        else:
            self.experts = Experts(self.held.size, d_model, inter)
        self.shared_experts = MLP(d_model, lay.dense(spec.intermediate * spec.n_shared).size, fmt)
        # not a submodule: the exchange is the rank's, shared by its layers
        self._exchange = shards.exchange
        if shards.exchange is not None:
            shards.exchange.register(key, self)

    def forward(self, x: torch.Tensor, given_experts: torch.Tensor | None = None) -> torch.Tensor:
        """[N, d_model] -> [N, d_model]; ``given_experts`` [N, top_k] int64 replaces the
        router's choice (``Router.forward``)."""
        w, idx = self.gate(x, given_experts)
        if self._exchange is not None:
            return self._exchange.run(self.key, x, idx, w) + self.shared_experts(x)
        held = self.held
        if not held.whole:  # another rank's experts: id one past ours
            local = idx - held.start
            mine = (local >= 0) & (local < held.size)
            idx = torch.where(mine, local, held.size)
            w = torch.where(mine, w, 0)
        return self.group.all_reduce(self.experts(x, idx, w) + self.shared_experts(x))
