"""DeepSeek-V4's multi-token-prediction layer (``mtp.0.*``), as DeepSeek's ``MTPBlock`` runs it
(docs/mtp.md, "DeepSeek-V4"): for a token x whose preceding position's hyper-connection
streams are H [hc_mult, hidden] (the target's last block's, before its hyper head),

    S = e_proj(enorm(embed(x))) + h_proj(hnorm(H))   (the embedding's term on every stream)
    S' = Block(S)                                    (a whole V4 block: mHC, attention, MoE)
    logits = head(norm(hyper_head(S')))              (the layer's own hyper head and norm)

The block is layer N of the model (N = ``num_hidden_layers``): its attention is sliding-window
only where the config's trailing ``compress_ratios`` entry is 0 (the releases), its MoE learned
(N is past the hash layers). The embedding and ``head`` are the target's. Its parameters carry
DeepSeek's names under ``mtp.0.``."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dhisparse.family.v4_config import V4Config
from services.worker.model.v4_decoder import Block
from services.worker.model.v4_hyper import hyper_head
from services.worker.model.v4_norm import RMSNorm
from services.worker.model.weight_format import BF16, WeightFormat, linear


def mtp_layer_config(cfg: V4Config) -> V4Config:
    """``cfg`` with the MTP layer appended as layer N: sliding-window attention (the only MTP
    attention served: ``v4_topology`` refuses another ratio) and learned routing."""
    return dataclasses.replace(
        cfg, attention=(*cfg.attention, "sliding"), compress=(*cfg.compress, 0),
        mlp=(*cfg.mlp, "moe"), sharing=cfg.sharing.with_sliding_layer(),
    )  # fmt: skip


class MTPBlock(Block):
    """The block (``attn``, ``ffn``, their norms and hyper-connections) with the MTP input
    fusion (``e_proj``, ``h_proj``, ``enorm``, ``hnorm``) and its own ``norm`` and hyper head
    (``hc_head_fn`` / ``_base`` / ``_scale``)."""

    def __init__(self, cfg: V4Config, fmt: WeightFormat = BF16) -> None:
        super().__init__(mtp_layer_config(cfg), cfg.num_layers, fmt)
        h, d = cfg.hc_mult, cfg.hidden_size
        self.e_proj = linear(d, d, fmt)
        self.h_proj = linear(d, d, fmt)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(h, h * d))
        self.hc_head_base = nn.Parameter(torch.empty(h))
        self.hc_head_scale = nn.Parameter(torch.empty(1))

    def fuse(self, embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """embeds [N, hidden] of the tokens, streams [N, hc_mult, hidden] of the positions
        before them -> the block's input streams [N, hc_mult, hidden]."""
        e = self.e_proj(self.enorm(embeds))
        return self.h_proj(self.hnorm(streams.to(embeds.dtype))) + e.unsqueeze(1)

    def final(self, streams: torch.Tensor) -> torch.Tensor:
        """The block's output streams [N, hc_mult, hidden] -> [N, hidden] for the target's
        ``head``: the layer's own hyper head, then its ``norm``."""
        c = self.cfg
        x = hyper_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps,
            c.rms_norm_eps,
        )  # fmt: skip
        return self.norm(x)
