"""A draft transformer layer with DFlash-style KV injection.

Every layer attends from the block's queries over two sets of keys: the context (the fused
target features of committed positions, projected by this layer's K/V weights and cached in
the draft ring) and the block itself, non-causally: ``K/V = proj([context ; block])``,
``Q = proj(block)``. Context K/V depend only on the fused features, so they are computed once
per committed position (``context_kv``) and read back from the ring every round."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from services.worker.model.layers import RMSNorm, SwiGLU
from services.worker.model.rotary import apply_rope
from services.worker.speculative.drafters.config import DrafterConfig


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.n_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.d_model, hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, hd, bias=False)
        self.o_proj = nn.Linear(hd, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.cfg.n_heads, self.cfg.head_dim)

    def _keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, H*D] normed, rotated keys."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x))), positions, self.cfg.rope_theta)
        return k.flatten(-2)

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx: [N, d] fused target features at ``positions`` [N] -> k, v: [N, H*D]."""
        return self._keys(ctx, positions), self.v_proj(ctx)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_valid: torch.Tensor,
    ) -> torch.Tensor:
        """x: [R, K, d] block hidden states at positions [R, K]; ctx_k, ctx_v: [R, S, H*D];
        ctx_valid: [R, S] bool -> [R, K, d]."""
        r, k, _ = x.shape
        h = self.attn_norm(x)
        pos = positions.reshape(-1)
        q = apply_rope(
            self.q_norm(self._heads(self.q_proj(h))).reshape(r * k, self.cfg.n_heads, -1),
            pos,
            self.cfg.rope_theta,
        ).view(r, k, self.cfg.n_heads, -1)
        kb = self._keys(h.reshape(r * k, -1), pos).view(r, k, -1)
        vb = self.v_proj(h)
        keys = self._heads(torch.cat([ctx_k.to(kb.dtype), kb], dim=1)).transpose(1, 2)
        values = self._heads(torch.cat([ctx_v.to(vb.dtype), vb], dim=1)).transpose(1, 2)
        # Valid context rows and the whole block (non-causal inside): [R, 1, 1, S+K].
        block = torch.ones(r, k, dtype=torch.bool, device=x.device)
        mask = torch.cat([ctx_valid, block], dim=1)[:, None, None, :]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        x = x + self.o_proj(o.transpose(1, 2).reshape(r, k, -1))
        return x + self.mlp(self.mlp_norm(x))
