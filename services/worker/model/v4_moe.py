"""DeepSeek-V4's mixture of experts: every layer routes each token to ``top_k`` of
``n_routed`` experts and adds one shared expert.

Scores are ``sqrt(softplus(x @ gate.weight^T))``. A ``moe`` layer picks the top-k of
``scores + bias`` (the bias steers the choice only); a ``hash`` layer takes the experts its
frozen ``tid2eid[token]`` table names. Either way the chosen scores, normalised to sum 1 and
times ``routed_scaling``, weight the experts' outputs. Every expert (routed and shared) is a
SwiGLU whose gate is clamped to <= ``swiglu_limit`` and whose up projection to
[-limit, limit].

In the serving dtype the routed experts run as a loop over the experts that any token chose,
or, once ``fuse``d (the engine's model: ``v4_serving.V4Model``), as one grouped GEMM over the
(token, choice) pairs (``grouped_experts``): static shapes, no host synchronisation. Fused,
each expert's ``w1`` / ``w3`` / ``w2`` are views into two stacked tensors, so the checkpoint's
names and the memory stay as they are. In FP8 (``WeightFormat.fp8``) the shared expert's
projections are ``FP8Linear`` and the routed experts one ``FP8Experts`` (or ``FP4Experts``,
``WeightFormat.fp4_experts``), the fused MoE with the clamped SwiGLU in its epilogue: their
weights stacked as ``experts.gate_up_proj`` / ``experts.down_proj``, filled from the
checkpoint's per-expert tensors by ``weights/v4_quantized``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dhisparse.family.v4_config import V4Config
from services.worker.model.fp4_experts import FP4Experts
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.grouped_experts import Activation, routed_experts
from services.worker.model.weight_format import BF16, WeightFormat, linear


def clamped_swiglu(limit: float) -> Activation:
    """V4's expert activation: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    return act


class Expert(nn.Module):
    """``w1`` (gate) and ``w3`` (up) [inter, hidden], ``w2`` (down) [hidden, inter]."""

    def __init__(self, hidden: int, inter: int, limit: float, fmt: WeightFormat = BF16) -> None:
        super().__init__()
        self.w1 = linear(hidden, inter, fmt)
        self.w2 = linear(inter, hidden, fmt)
        self.w3 = linear(hidden, inter, fmt)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.limit)(self.w1(x), self.w3(x)))


class Gate(nn.Module):
    """``weight`` [n_routed, hidden]; ``bias`` [n_routed] (moe) or ``tid2eid`` [vocab, top_k]
    (hash)."""

    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scaling, self.hashed = cfg.top_k, cfg.routed_scaling, hashed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed, cfg.hidden_size))
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.top_k, dtype=torch.long)
            )
        else:
            self.bias = nn.Parameter(torch.empty(cfg.n_routed))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden], ids: [N] -> (experts [N, top_k] long, weights [N, top_k])."""
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.hashed:
            experts = self.tid2eid[ids].long()
        else:
            experts = torch.topk(scores + self.bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


def quantized_experts(cfg: V4Config, fmt: WeightFormat) -> FP8Experts | FP4Experts:
    """The routed experts of one layer held as ``fmt`` says (``fmt.fp8``)."""
    n, d, i, limit = cfg.n_routed, cfg.hidden_size, cfg.moe_intermediate, cfg.swiglu_limit
    if fmt.fp4_experts:
        return FP4Experts(n, d, i, limit=limit)
    return FP8Experts(n, d, i, fmt.mode, limit=limit)


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, fmt: WeightFormat = BF16) -> None:
        super().__init__()
        inter, limit = cfg.moe_intermediate, cfg.swiglu_limit
        self.gate = Gate(cfg, cfg.mlp[layer] == "hash")
        self.experts: nn.Module = (
            quantized_experts(cfg, fmt)
            if fmt.fp8
            else nn.ModuleList(Expert(cfg.hidden_size, inter, limit) for _ in range(cfg.n_routed))
        )
        self.shared_experts = Expert(cfg.hidden_size, inter, limit, fmt)
        self.act = clamped_swiglu(limit)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        """Whether the routed experts are one quantized module (no ``fuse`` needed)."""
        return not isinstance(self.experts, nn.ModuleList)

    def fuse(self) -> None:
        """Holds the routed experts in ``gate_up`` [E, 2I, hidden] (each expert's ``w1`` rows,
        then ``w3``'s) and ``down`` [E, hidden, I] (its ``w2``), each expert's weights views
        into them, and runs them as one grouped GEMM from now on. Call it once the weights are
        on their device in their dtype: a later move gives the experts storage of their own,
        and the forward refuses the stale stack. Quantized experts are stacked already: a
        no-op."""
        if self.quantized:
            return
        w1 = self.experts[0].w1.weight
        n, (inter, hidden) = len(self.experts), w1.shape
        with torch.no_grad():
            gate_up = w1.new_empty(n, 2 * inter, hidden)
            down = w1.new_empty(n, hidden, inter)
            for e, expert in enumerate(self.experts):
                gate_up[e, :inter].copy_(expert.w1.weight)
                gate_up[e, inter:].copy_(expert.w3.weight)
                down[e].copy_(expert.w2.weight)
                expert.w1.weight.data = gate_up[e, :inter]
                expert.w3.weight.data = gate_up[e, inter:]
                expert.w2.weight.data = down[e]
        self._stacked = gate_up, down

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden], ids: [N] the tokens' ids (hash routing) -> [N, hidden]."""
        experts, weights = self.gate(x, ids)
        if self.quantized:
            return self.experts(x, experts, weights) + self.shared_experts(x)
        if self._stacked is not None:
            gate_up, down = self._stacked
            if self.experts[0].w1.weight.data_ptr() != gate_up.data_ptr():
                raise RuntimeError("the fused experts were moved: fuse() them again")
            routed = routed_experts(x, experts, weights, gate_up, down, self.act)
            return routed + self.shared_experts(x)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out + self.shared_experts(x)
