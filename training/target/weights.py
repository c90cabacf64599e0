"""Initialising a model for training from scratch, and the optimizer's parameter groups.

``io.init_weights`` is for untrained test models: large fan-in weights so attention mixes
strongly. Training starts instead from a GPT-style init that keeps the residual stream's scale
steady through depth: N(0, 1/fan_in) projections, residual output projections scaled by
1/sqrt(2·layers), unit-variance embeddings, a zero output head (first predictions uniform), and
an indexer whose initial scores are O(1) (its score has no 1/sqrt(d) scale of its own)."""

from __future__ import annotations

import math

import torch
from torch import nn

from services.worker.model.model import DSAModel

_RESIDUAL_OUT = ("attn.w_o.weight", "mlp.down.weight")


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


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (projections, embedding, head) only, not on norms or gates."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
