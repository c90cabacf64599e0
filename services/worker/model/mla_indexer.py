"""The lightning indexer as DeepSeek-V3.2 and GLM-5 compute it.

Key (one per token, written once into the producer's index-key cache):
``RoPE(LayerNorm_with_bias(wk . x))`` from the layer's hidden state, RoPE on the *first*
``qk_rope_head_dim`` dims (rotate-half for V3.2, interleaved for GLM). Query from the q latent:
``wq_b(q_resid)``, RoPE'd the same way. Weights ``weights_proj(x)`` in fp32, scaled by
``H^-1/2 . d^-1/2``, so that ``I = sum_h w_h relu(q_h . k)`` equals transformers'
``sum_h weights_proj(x)_h H^-1/2 relu(q_h . k d^-1/2)`` (the scale is positive)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dhisparse.family.hf_config import MLAConfig
from services.worker.model.rotary import Rotary, apply_rope
from services.worker.model.weight_format import BF16, WeightFormat, linear
from services.worker.ops.fusion import fused
from services.worker.ops.norm_rope import index_key_triton
from services.worker.ops.rope import rope_triton

_K_NORM_EPS = 1e-6


class DSAIndexer(nn.Module):
    def __init__(self, cfg: MLAConfig, fmt: WeightFormat = BF16) -> None:
        """``fmt``: FP8 holds wq_b and wk in FP8; weights_proj stays fp32."""
        super().__init__()
        self.n_heads, self.d_index = cfg.index_n_heads, cfg.index_head_dim
        self.d_rope = cfg.qk_rope_head_dim
        self.interleaved = cfg.indexer_rope_interleaved
        self.wq_b = linear(cfg.q_lora_rank, self.n_heads * self.d_index, fmt)
        self.wk = linear(cfg.hidden_size, self.d_index, fmt)
        self.k_norm = nn.LayerNorm(self.d_index, eps=_K_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.weight_scale = self.n_heads**-0.5 * self.d_index**-0.5

    def _rope(self, t: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """RoPE of the first ``d_rope`` elements of t's last dimension, the rest kept; one
        kernel where fused."""
        r = self.d_rope
        if fused(t, "index_rope"):
            cos, sin = rotary.tables(r)
            return rope_triton(t, cos, sin, self.interleaved)
        rot = apply_rope(t[..., :r], rotary, interleaved=self.interleaved)
        return torch.cat([rot, t[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, rows: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Index keys [N, d_index] of the pass's tokens (``rows``, the stored rows, are not
        read: these keys come from the hidden state)."""
        del rows
        k = self.wk(x)
        if fused(k, "index_key"):  # the LayerNorm and the RoPE in one kernel
            cos, sin = rotary.tables(self.d_rope)
            norm = self.k_norm
            return index_key_triton(k, norm.weight, norm.bias, norm.eps, cos, sin, self.interleaved)
        return self._rope(self.k_norm(k), rotary)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [N, H, d_index], w [N, H] fp32."""
        q = self.wq_b(q_latent).view(x.shape[0], self.n_heads, self.d_index)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale
        return self._rope(q, rotary), w
