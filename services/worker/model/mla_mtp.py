"""The multi-token-prediction layer DeepSeek-V3.2 and GLM-5 ship (``num_nextn_predict_layers``
1, ``model.layers.{N}.*``), as vLLM's ``DeepSeekMultiTokenPredictorLayer`` and SGLang's
``DeepseekModelNextN`` run it (docs/mtp.md): for a token x whose preceding hidden state is h,

    u = eh_proj(cat[enorm(embed(x)), hnorm(h)])  ->  the decoder layer  ->  shared_head.norm

then ``shared_head.head`` gives the logits. The decoder layer is an ``MLALayer`` (the target's
MLA, DSA indexer and MoE classes) over a KV source of its own; the embedding is the target's.
``MTP_NAMES`` maps the layer's own checkpoint tensors onto this module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import MLAConfig
from services.worker.kv.batch import ForwardBatch
from services.worker.model.layers import RMSNorm
from services.worker.model.mla_layer import MLALayer
from services.worker.model.weight_format import BF16, WeightFormat
from services.worker.parallel.shards import Shards

# The MTP layer's own tensors (checkpoint name after ``model.layers.{N}.`` -> ours after
# ``mtp.``); the rest of the layer has the decoder layer's names.
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "shared_head.norm.weight",
    "shared_head.head.weight": "shared_head.head.weight",
}
# The layer's copy of the embedding: both engines use the target's, and so do we.
MTP_EMBED = "embed_tokens.weight"


class SharedHead(nn.Module):
    def __init__(self, cfg: MLAConfig, vocab_rows: int) -> None:
        """``vocab_rows``: this rank's rows of the head (the whole vocabulary on one rank)."""
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, vocab_rows, bias=False)


class MTPLayer(MLALayer):
    """The decoder layer (``attn_norm``, ``attn``, ``indexer``, ``mlp_norm``, ``mlp``) with
    the NextN input fusion and its own head."""

    def __init__(
        self,
        cfg: MLAConfig,
        topo: ModelConfig,
        layer: int,
        fmt: WeightFormat = BF16,
        shards: Shards | None = None,
    ) -> None:
        shards = shards or Shards.single(cfg)
        super().__init__(cfg, topo, layer, mlp=cfg.mtp_mlp, fmt=fmt, shards=shards)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(cfg, shards.layout.vocab().size)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds [N, d] of the tokens, hidden [N, d] the hidden states before them -> the
        decoder layer's input [N, d]: ``eh_proj(cat[enorm(embeds), hnorm(hidden)])``."""
        x = torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1)
        return self.eh_proj(x)


class MTPStep(NamedTuple):
    """One draft step of R requests."""

    hidden: torch.Tensor  # [R, d] after shared_head.norm: the next step's hidden state
    logits: torch.Tensor  # [R, V] fp32; with a hot head [R, N], over its ids (``HotHead``)
    selection: torch.Tensor  # [R, k] the MTP rows it attended (-1 pads)
    tokens: torch.Tensor  # [R] int64 the greedy proposals: the argmax's vocabulary ids


# (tokens [R], batch, hidden [R, d] or None: the carry's, selection [R, k] or None) -> MTPStep
MTPStepFn = Callable[
    [torch.Tensor, ForwardBatch, torch.Tensor | None, torch.Tensor | None], MTPStep
]


def greedy_block(
    step: MTPStepFn, anchors: torch.Tensor, batches: Sequence[ForwardBatch], share_index: bool
) -> torch.Tensor:
    """[R, S] the greedy proposals of S = len(batches) draft steps of R requests that each draft
    every step: step i runs ``step`` over ``batches[i]`` (the requests' tokens at their anchor's
    position + i) on the anchors, then on step i-1's proposals, with step i-1's hidden state
    (step 0: the carry's); with ``share_index`` steps after the first attend the rows the first
    selected. Device work only: one CUDA graph can hold every step."""
    current, hidden, first = anchors, None, None
    drafted = []
    for batch in batches:
        out = step(current, batch, hidden, first if share_index else None)
        current = out.tokens
        drafted.append(current)
        hidden = out.hidden
        if first is None:
            first = out.selection
    return torch.stack(drafted, dim=1)
