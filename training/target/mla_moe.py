"""The MLP half of an ``MLADecoder`` layer in training: dense MLPs as they are, and the MoE
with differentiable routed experts, plus DeepSeek-V3's auxiliary-loss-free load balancing.

The router is the model's own ``Router.forward`` (fp32 sigmoid scores, the choice biased by
``e_score_correction_bias`` within the best groups, weights from the unbiased scores,
normalised and scaled), run with autocast off so that its scores stay fp32 under bf16 autocast,
as serving computes them. The routed experts read the fused ``gate_up_proj [E, 2I, D]`` and
``down_proj [E, D, I]`` parameters expert by expert over the (token, choice) pairs sorted by
expert: one host read of the per-expert counts per layer, and an expert no pair chose gets a
zero gradient. The weights carry the router's gradient; the choice has none.

Balancing (``update_expert_bias``): after a step, each MoE layer's bias moves by ``rate``
toward balance, ``bias_e += rate * sign(mean load - load_e)``; the bias enters only the choice,
never the weights (``Router.forward``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.mla_moe import Experts, MoE


class ExpertShare(NamedTuple):
    """The least and most loaded experts' shares of a layer's (token, choice) pairs."""

    min: float
    max: float


def mlp_train_forward(mlp: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, D] -> (the MLP's output [N, D], for an MoE the pairs routed to each expert [E]
    fp32, detached; None for a dense MLP)."""
    if not isinstance(mlp, MoE):
        return mlp(x), None
    if not isinstance(mlp.experts, Experts) or not mlp.held.whole:
        raise ValueError("MoE training needs every routed expert on this rank, not in FP8")
    with torch.autocast(x.device.type, enabled=False):
        w, idx = mlp.gate(x)  # [N, k] fp32, [N, k] int64
    routed, load = routed_experts(mlp.experts, x, idx, w)
    return routed + mlp.shared_experts(x), load


def routed_experts(
    experts: Experts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], idx / w [N, k] -> (sum_j w[:, j] * expert_{idx[:, j]}(x) [N, D], the pairs
    each expert got [E] fp32). Each expert's matmuls run over its own rows only."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=experts.n)
    if n == 0:
        return torch.zeros_like(x), counts.float()
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    sizes = counts.tolist()  # the host sync: the split sizes
    token = order // k
    gate_up, down = experts.gate_up_proj.unbind(0), experts.down_proj.unbind(0)
    outs = []
    for e, rows in enumerate(x[token].split(sizes)):
        if sizes[e]:
            gate, up = (rows @ gate_up[e].t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ down[e].t())
    y = torch.cat(outs).float() * w.reshape(-1)[order].unsqueeze(-1)  # [N*k, D] fp32
    out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device).index_add(0, token, y)
    return out.to(x.dtype), counts.float()


def moe_layers(model: MLADecoder) -> dict[int, MoE]:
    """Layer index -> its MoE, the MTP layer's (at ``model.mtp_layer``) included."""
    out = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)}
    if model.mtp is not None and isinstance(model.mtp.mlp, MoE):
        out[model.mtp_layer] = model.mtp.mlp
    return out


@torch.no_grad()
def update_expert_bias(
    model: MLADecoder, loads: dict[int, torch.Tensor], rate: float
) -> dict[int, ExpertShare]:
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): for each layer of ``loads`` (layer
    -> pairs routed to each expert [E], e.g. ``MLATrainOutput.expert_load`` summed over the
    step's micro-batches), ``bias_e += rate * sign(mean load - load_e)``: an overloaded expert
    is chosen less, an idle one more. Returns each layer's expert shares before the update."""
    moes = moe_layers(model)
    out = {}
    for layer, load in loads.items():
        bias = moes[layer].gate.e_score_correction_bias
        load = load.to(bias.device, torch.float32)
        share = load / load.sum().clamp(min=1.0)
        out[layer] = ExpertShare(float(share.min()), float(share.max()))
        bias += rate * torch.sign(load.mean() - load).to(bias.dtype)
    return out
