"""The lightning indexer of an index-producer layer: ``I = sum_h w_h * relu(q_h . k_s)``.

Keys are projected from the stored rows of the producer's source (for a compressed source,
from the compressed row), so a key exists exactly when its row is complete."""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.family.config import ModelConfig
from services.worker.model.rotary import Rotary


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_index_heads
        self.d_index = cfg.d_index
        self.w_q = nn.Linear(cfg.d_model, cfg.n_index_heads * cfg.d_index, bias=False)
        self.w_w = nn.Linear(cfg.d_model, cfg.n_index_heads, bias=False)
        self.w_k = nn.Linear(cfg.d_kv, cfg.d_index, bias=False)

    def keys(self, x: torch.Tensor, rows: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """New stored rows [n, d_kv] -> their keys [n, d_index] (x and rotary are not read)."""
        del x, rotary
        return self.w_k(rows)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, d_model] -> q [N, H_i, d_index], w [N, H_i]. (q_latent is x in this family.)"""
        del q_latent, rotary
        q = self.w_q(x).view(x.shape[0], self.n_heads, self.d_index)
        return q, self.w_w(x)
