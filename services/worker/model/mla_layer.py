"""One decoder layer of DeepSeek-V3.2 / GLM-5, as the checkpoint names its parts:
input_layernorm, MLA (the 576-element stored row), the DSA indexer on index producers,
post_attention_layernorm, then a dense MLP or the MoE."""

from __future__ import annotations

from torch import nn

from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import MLAConfig
from services.worker.model.layers import RMSNorm
from services.worker.model.mla_attention import MLA
from services.worker.model.mla_indexer import DSAIndexer
from services.worker.model.mla_moe import MLP, MoE
from services.worker.model.weight_format import BF16, WeightFormat
from services.worker.parallel.shards import Shards


class MLALayer(nn.Module):
    def __init__(
        self,
        cfg: MLAConfig,
        topo: ModelConfig,
        layer: int,
        mlp: str | None = None,
        fmt: WeightFormat = BF16,
        shards: Shards | None = None,
    ) -> None:
        """``mlp``: "dense" or "sparse" (MoE); default: the config's for ``layer``. ``fmt``:
        how the projections and experts are held (``weight_format``). ``shards``: this rank's
        heads, MLP columns and experts (the indexer is every rank's)."""
        super().__init__()
        shards = shards or Shards.single(cfg)
        self.spec = topo.layers[layer]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLA(cfg, fmt, shards)
        self.indexer = DSAIndexer(cfg, fmt) if self.spec.index == "producer" else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        kind = mlp or cfg.mlp_types[layer]
        dense = shards.layout.dense(cfg.intermediate_size).size
        self.mlp: nn.Module = (
            MoE(cfg.moe, cfg.hidden_size, fmt, shards, key=layer)
            if kind == "sparse"
            else MLP(cfg.hidden_size, dense, fmt, shards.attention)
        )
