"""Initialising a model for training from scratch, and the optimizer's parameter groups.

``io.init_weights`` is for untrained test models: large fan-in weights so attention mixes
strongly. Training starts instead from a GPT-style init that keeps the residual stream's scale
steady through depth: N(0, 1/fan_in) projections, residual output projections scaled by
1/sqrt(2·layers), unit-variance embeddings, a zero output head (first predictions uniform), and
an indexer whose initial scores are O(1) (its score has no 1/sqrt(d) scale of its own).
``init_mla_for_training`` applies the same recipe to DeepSeek-V3.2 / GLM-5's modules."""

from __future__ import annotations

import math

import torch
from torch import nn

from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.preset_decoder import DSAModel

_RESIDUAL_OUT = ("attn.w_o.weight", "mlp.down.weight")
# MLADecoder: the projections that write the residual stream.
_MLA_RESIDUAL_OUT = ("attn.o_proj.weight", "down_proj.weight", "experts.down_proj")


def init_for_training(model: DSAModel, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_layers = model.cfg.n_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
            continue
        if name.startswith("lm_head") or name.endswith("compress_gate"):
            nn.init.zeros_(p)
            continue
        if name.startswith("embed"):
            std = 1.0
        else:
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(_RESIDUAL_OUT):
                std /= math.sqrt(2 * n_layers)
            elif name.endswith("indexer.w_q.weight"):
                std /= math.sqrt(model.cfg.d_index)  # q . k ~ N(0, 1)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def init_mla_for_training(model: MLADecoder, seed: int) -> None:
    """The same recipe for an ``MLADecoder``: every weight N(0, 1/fan_in) (the last dimension,
    for the fused experts too), the residual outputs also scaled by 1/sqrt(2·layers); norms
    (and the indexer's k_norm weight) one, their biases and the routers' correction biases
    zero. The embedding is N(0, 1) with an untied head starting at zero; a tied one is
    N(0, 1/d), so that the first logits are O(1) either way. A shared tensor (the MTP head
    that is the target's) is initialised once."""
    g = torch.Generator().manual_seed(seed)
    layers = model.family.num_layers + (model.mtp is not None)
    tied = model.lm_head is None
    for name, p in model.named_parameters():  # shared tensors appear once
        if "norm" in name:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            continue
        if name.startswith("lm_head"):
            nn.init.zeros_(p)
            continue
        if name.startswith("embed"):
            std = p.shape[1] ** -0.5 if tied else 1.0
        else:
            std = 1.0 / math.sqrt(p.shape[-1])
            if name.endswith(_MLA_RESIDUAL_OUT):
                std /= math.sqrt(2 * layers)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            nn.init.zeros_(b)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (projections, embedding, head) only, not on norms or gates."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
