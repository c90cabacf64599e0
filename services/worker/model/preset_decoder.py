"""The home-made DSA family: the decoder of the preset models (``dhisparse.family.presets``),
test fixtures for topologies no released family has yet (shared Reuse/Reindex sources,
compression, local windows)."""

from __future__ import annotations

from torch import nn

from dhisparse.family.config import ModelConfig
from services.worker.model.decoder import SparseDecoder
from services.worker.model.layers import RMSNorm, SwiGLU
from services.worker.model.preset_attention import MLAAttention
from services.worker.model.preset_indexer import LightningIndexer


class DSALayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.spec = cfg.layers[layer]
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLAAttention(cfg, layer)
        self.indexer = LightningIndexer(cfg) if self.spec.index == "producer" else None
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)


class DSAModel(SparseDecoder):
    """The home-made DSA family (test fixtures for topologies no released family has yet:
    shared Reuse/Reindex sources, compression, local windows)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self._init_topology(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DSALayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
