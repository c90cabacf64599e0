"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) as one sequence's forward: prefill and decode
chunks of any length, carrying the sequence's state between calls.

The module tree and its parameter names are DeepSeek's own checkpoint names (``embed``,
``layers.L.attn.wq_a``, ``layers.L.ffn.experts.E.w1``, ``hc_head_fn``, ``head``), so a checkpoint
in those names loads as it is (``weights/v4_names`` maps transformers' names onto them).

A layer: the hyper-connections collapse the streams, attention runs on ``attn_norm`` of that,
its output goes back onto the streams; the same around ``ffn_norm`` and the MoE. The model
embeds each token into ``hc_mult`` equal streams and ends with the hyper head, ``norm`` and
``head``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dhisparse.family.v4_config import V4Config
from services.worker.model.candidate_blocks import PassCandidates
from services.worker.model.v4_attention import Attention, AttentionState, SharedPass
from services.worker.model.v4_hyper import hyper_head, hyper_merge, hyper_mix
from services.worker.model.v4_moe import MoE
from services.worker.model.v4_norm import RMSNorm
from services.worker.model.weight_format import BF16, WeightFormat


@dataclass
class V4State:
    """One sequence's state: its length so far and each layer's attention state."""

    length: int = 0
    layers: list[AttentionState] = field(default_factory=list)


def _hc_params(module: nn.Module, site: str, cfg: V4Config) -> None:
    h, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + h) * h
    module.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, h * d)))
    module.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(mix)))
    module.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3)))


class Block(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, fmt: WeightFormat = BF16) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer, fmt)
        self.ffn = MoE(cfg, layer, fmt)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        _hc_params(self, "attn", cfg)
        _hc_params(self, "ffn", cfg)

    def _mix(
        self, site: str, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        fn, base, scale = (getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
        return hyper_mix(streams, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def attention_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What the block's attention reads of streams [N, hc_mult, hidden]: ``attn_norm`` of
        the collapsed streams [N, hidden]."""
        return self.attn_norm(self._mix("attn", streams)[2])

    def forward(
        self, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
        state: AttentionState, shared: SharedPass,
    ) -> torch.Tensor:  # fmt: skip
        """streams: [N, hc_mult, hidden] -> the same after attention and the MoE."""
        return self.run(streams, ids, lambda x: self.attn(x, positions, state, shared))

    def run(
        self, streams: torch.Tensor, ids: torch.Tensor,
        attention: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        """The block around ``attention`` (``attn_norm`` of the collapsed streams [N, hidden]
        -> its output [N, hidden]): streams [N, hc_mult, hidden] -> the same after attention
        and the MoE, ``ids`` [N] the tokens (hash routing)."""
        post, comb, x = self._mix("attn", streams)
        streams = hyper_merge(streams, attention(self.attn_norm(x)), post, comb)
        post, comb, x = self._mix("ffn", streams)
        return hyper_merge(streams, self.ffn(self.ffn_norm(x), ids), post, comb)


class V4Decoder(nn.Module):
    def __init__(
        self, cfg: V4Config, mtp: nn.Module | None = None, fmt: WeightFormat = BF16
    ) -> None:
        """``mtp``: the MTP layer (``v4_mtp.MTPBlock``), held as ``mtp.0`` (its checkpoint
        names); None: the target alone. ``fmt``: how the projections and experts are held
        (FP8: those the released checkpoints store in FP8 or FP4; ``v4_attention``)."""
        super().__init__()
        self.cfg, self.fmt = cfg, fmt
        h, d = cfg.hc_mult, cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, i, fmt) for i in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(h, h * d))
        self.hc_head_base = nn.Parameter(torch.empty(h))
        self.hc_head_scale = nn.Parameter(torch.empty(1))
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = None if mtp is None else nn.ModuleList([mtp])

    def new_state(self) -> V4State:
        return V4State(layers=[AttentionState() for _ in self.layers])

    def streams(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [N] -> [N, hc_mult, hidden], each token's embedding on every stream."""
        return self.embed(ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def final(self, streams: torch.Tensor) -> torch.Tensor:
        """The last block's streams [N, hc_mult, hidden] -> the normed hidden states
        [N, hidden] that ``head`` maps to logits."""
        c = self.cfg
        x = hyper_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps,
            c.rms_norm_eps,
        )  # fmt: skip
        return self.norm(x)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """ids: [N] the sequence's next N tokens -> logits [N, vocab] (fp32); ``state``
        advances by N tokens."""
        positions = torch.arange(state.length, state.length + ids.shape[0], device=ids.device)
        rule = self.cfg.candidates
        shared = SharedPass(candidates=None if rule is None else PassCandidates(rule))
        streams = self.streams(ids)
        for block, layer_state in zip(self.layers, state.layers, strict=True):
            streams = block(streams, ids, positions, layer_state, shared)
        state.length += ids.shape[0]
        return self.head(self.final(streams)).float()
