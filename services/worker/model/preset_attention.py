"""MLA-style attention in absorbed form: each token leaves one latent row per KV source
(``[latent ; rope]``, d_kv elements) and queries attend over selected rows like MQA."""

from __future__ import annotations

import math

import torch
from torch import nn

from dhisparse.family.config import ModelConfig
from services.worker.model.layers import RMSNorm
from services.worker.model.rotary import Rotary, apply_rope


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.owner = cfg.is_owner(layer)
        src = cfg.sources[cfg.layers[layer].source]
        h = cfg.n_heads
        if self.owner:
            self.w_dkv = nn.Linear(cfg.d_model, cfg.d_latent, bias=False)
            self.kv_norm = RMSNorm(cfg.d_latent, cfg.norm_eps)
            self.w_kr = nn.Linear(cfg.d_model, cfg.d_rope, bias=False)
            if src.compress > 1:
                # Compression gate: a row of m tokens is their softmax(row . gate)-weighted sum.
                self.compress_gate = nn.Parameter(torch.zeros(cfg.d_kv))
        self.w_q_lat = nn.Linear(cfg.d_model, h * cfg.d_latent, bias=False)
        self.w_q_rope = nn.Linear(cfg.d_model, h * cfg.d_rope, bias=False)
        self.w_o = nn.Linear(h * cfg.d_latent, cfg.d_model, bias=False)
        self.scale = 1.0 / math.sqrt(cfg.d_kv)

    def token_rows(self, x: torch.Tensor, positions: torch.Tensor | Rotary) -> torch.Tensor:
        """[N, d_model] -> [N, d_kv] uncompressed rows (owner layers only)."""
        c = self.kv_norm(self.w_dkv(x))
        kr = apply_rope(self.w_kr(x), positions, self.cfg.rope_theta)
        return torch.cat([c, kr], dim=-1)

    def compress(self, group_rows: torch.Tensor) -> torch.Tensor:
        """[G, m, d_kv] rows of complete groups -> [G, d_kv] compressed rows."""
        rf = group_rows.float()
        alpha = torch.softmax(rf @ self.compress_gate.float(), dim=1)
        return (alpha.unsqueeze(-1) * rf).sum(dim=1).to(group_rows.dtype)

    def queries(
        self, x: torch.Tensor, positions: torch.Tensor | Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, d_model] -> ([N, H, d_kv] queries, x: what this family's indexer reads)."""
        n, h = x.shape[0], self.cfg.n_heads
        q_lat = self.w_q_lat(x).view(n, h, self.cfg.d_latent)
        q_rope = apply_rope(
            self.w_q_rope(x).view(n, h, self.cfg.d_rope), positions, self.cfg.rope_theta
        )
        return torch.cat([q_lat, q_rope], dim=-1), x

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """[N, H, d_latent] -> [N, d_model]."""
        return self.w_o(o.reshape(o.shape[0], -1))
