"""DeepSeek-V4's lightning indexer (CSA layers): which compressed rows each query attends.

Its keys are a compressor of its own (overlapping, ``index_head_dim`` channels), or, on a
DeepSeek-V4.1 Reindex layer (``own_keys`` False), its KV source's index keys. A query's
score of row s is ``sum_h w_h * ReLU(q_h . K_s) * index_head_dim^-0.5`` with
``w = weights_proj(x) * index_n_heads^-0.5`` and ``q = wq_b(q latent)`` rotated at the query's
position; the query keeps the ``index_topk`` best of its visible rows (score descending, the
lower row first on ties)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dhisparse.family.rope_spec import RopeSpec
from dhisparse.family.v4_config import V4Config
from services.worker.model.candidate_blocks import ScoreStep
from services.worker.model.v4_compressor import Compressor, visible_rows
from services.worker.model.v4_rope import PassRope, rope_tail
from services.worker.model.weight_format import BF16, WeightFormat, linear


class Indexer(nn.Module):
    """``wq_b`` [heads * dim, q_lora_rank] (FP8 with ``fmt.fp8``), ``weights_proj`` [heads,
    hidden], and with ``own_keys`` the key ``compressor``."""

    def __init__(
        self, cfg: V4Config, rate: int, rope: RopeSpec, own_keys: bool = True,
        fmt: WeightFormat = BF16,
    ) -> None:  # fmt: skip
        """``cfg``'s indexer (``index_n_heads`` heads of ``index_head_dim``, its top
        ``index_topk``) over rows compressed ``rate`` to one, rotated by ``rope``."""
        super().__init__()
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        self.heads, self.dim, self.topk, self.rate = heads, dim, cfg.index_topk, rate
        self.rope, self.rope_dim = rope, cfg.rope_dim
        self.wq_b = linear(cfg.q_lora_rank, heads * dim, fmt)
        self.weights_proj = nn.Linear(cfg.hidden_size, heads, bias=False)
        self.compressor = (
            Compressor(cfg.hidden_size, dim, rate, True, rope, cfg.rope_dim, cfg.rms_norm_eps)
            if own_keys
            else None
        )

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | PassRope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, heads, dim] rotated, weights [N, heads] = weights_proj(x) * heads^-0.5), both
        fp32."""
        q = self.wq_b(q_latent).view(-1, self.heads, self.dim)
        q = rope_tail(q, positions, self.rope, self.rope_dim).float()
        return q, self.weights_proj(x).float() * self.heads**-0.5

    def select(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
        keys: torch.Tensor, step: ScoreStep | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x: [N, hidden], q_latent: [N, q_lora_rank] at positions [N] over index ``keys``
        [rows, dim] -> [N, rows] bool, the rows each query attends (its top-k of the visible
        rows). ``step``: applied to the scores before the top-k (DeepSeek-V4.1's candidate
        source publishes its blocks, a consumer scores inside them)."""
        keys = keys.float()
        q, weights = self.queries(x, q_latent, positions)
        scores = F.relu(torch.einsum("nhd,sd->nhs", q, keys)) * self.dim**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [N, rows]
        visible = visible_rows(positions, keys.shape[0], self.rate)
        scores = scores.masked_fill(~visible, float("-inf"))
        if step is not None:
            n, rows = scores.shape
            scores = step(scores, visible.sum(dim=-1), slice(0, n), n, rows)
        k = min(self.topk, keys.shape[0])
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, order, True)
        return chosen & visible
