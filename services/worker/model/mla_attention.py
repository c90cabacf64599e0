"""Multi-head latent attention as DeepSeek-V3.2 and GLM-5 define it, in absorbed form.

Per token the layer stores one row ``[kv_a_layernorm(latent) ; RoPE(k_rope)]``
(kv_lora_rank + qk_rope_head_dim elements: 576 in the released models). Attention reads only
stored rows: the query's no-RoPE part is absorbed through ``kv_b_proj``'s key half (W_UK) into
the latent space, and the attended latents leave through its value half (W_UV), so every head
scores ``q_lat . latent + q_rope . k_rope`` — the same logits as the expanded keys of the
reference, without expanding them."""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.family.hf_config import MLAConfig
from services.worker.model.layers import RMSNorm
from services.worker.model.rotary import Rotary, apply_rope
from services.worker.model.weight_format import BF16, WeightFormat, linear
from services.worker.ops.fusion import fused
from services.worker.ops.norm_rope import mla_row_triton
from services.worker.ops.rope import rope_triton
from services.worker.parallel.shards import Shards

# q_a_layernorm and kv_a_layernorm use the RMSNorm default, not rms_norm_eps (as transformers).
_LORA_NORM_EPS = 1e-6


class MLA(nn.Module):
    owner = True  # every layer of these families writes its own source

    def __init__(
        self, cfg: MLAConfig, fmt: WeightFormat = BF16, shards: Shards | None = None
    ) -> None:
        """``fmt``: FP8 holds q_a, q_b, kv_a and o in FP8; kv_b (absorbed) stays dense.
        ``shards``: this rank holds ``heads`` of the heads (q_b, kv_b and o_proj cut by head)
        and o_proj's output is summed over the attention group; the stored row (q_a, kv_a and
        their norms) is every rank's."""
        super().__init__()
        shards = shards or Shards.single(cfg)
        self.cfg = cfg
        self.heads = shards.layout.heads().size
        self.group = shards.attention
        h, d = self.heads, cfg.hidden_size
        self.q_a_proj = linear(d, cfg.q_lora_rank, fmt)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LORA_NORM_EPS)
        self.q_b_proj = linear(cfg.q_lora_rank, h * cfg.qk_head_dim, fmt)
        self.kv_a_proj_with_mqa = linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, fmt)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = linear(h * cfg.v_head_dim, d, fmt)
        self.scale = cfg.softmax_scale

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, qk_nope, kv_lora] and W_UV [H, v, kv_lora], views of kv_b_proj."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def token_rows(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """[N, hidden] -> [N, kv_lora + rope] stored rows (rope in transformers' layout); the
        norm and the RoPE one kernel where fused."""
        kv = self.kv_a_proj_with_mqa(x)
        if fused(kv, "mla_row"):
            cos, sin = rotary.tables(self.cfg.qk_rope_head_dim)
            norm = self.kv_a_layernorm
            return mla_row_triton(kv, norm.weight, norm.eps, cos, sin, interleaved=True)
        latent, k_rope = kv.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return torch.cat(
            [self.kv_a_layernorm(latent), apply_rope(k_rope, rotary, interleaved=True)], -1
        )

    def queries(self, x: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, hidden] -> (absorbed queries [N, heads, kv_lora + rope], the q latent
        ``q_a_layernorm(q_a_proj(x))`` [N, q_lora_rank], which the indexer reads). Where fused,
        the W_UK GEMM and the RoPE kernel write straight into the queries' columns."""
        c = self.cfg
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(x.shape[0], self.heads, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w_uk, _ = self._kv_b()
        if fused(q, "mla_query"):  # the GEMM and the RoPE write their columns of one output: no cat
            out = q.new_empty(x.shape[0], self.heads, c.kv_lora_rank + c.qk_rope_head_dim)
            lat = out[..., : c.kv_lora_rank]
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=lat.transpose(0, 1))
            cos, sin = rotary.tables(c.qk_rope_head_dim)
            rope_triton(q_rope, cos, sin, True, out=out[..., c.kv_lora_rank :])
            return out, q_resid
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, kv_lora]
        return torch.cat([q_lat, apply_rope(q_rope, rotary, interleaved=True)], dim=-1), q_resid

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Attended latents [N, heads, kv_lora] -> [N, hidden] (every head's, summed over the
        attention group)."""
        _, w_uv = self._kv_b()
        v = torch.bmm(o.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.group.all_reduce(self.o_proj(v.reshape(o.shape[0], -1)))
