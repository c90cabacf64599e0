"""DeepSeek-V4's attention: one shared K=V head (MQA) of ``head_dim`` channels over the
sliding window's rows and the layer's compressed rows, with a learned per-head sink.

- q = wq_b(q_norm(wq_a(x))), RMS-normalised per head (unweighted), rotated on its tail;
  kv = norm(wkv(x)), rotated on its tail: the key and the value of the token.
- A query at t attends the window rows of positions (t - sliding_window, t] and, on CSA / HCA
  layers, compressed rows: HCA every visible row, CSA the indexer's choice.
- The softmax over those scores (scale head_dim^-0.5) has one more logit, the head's sink,
  that takes weight and gives no value.
- The output's tail is rotated back at the query's position; then the grouped output
  projection: ``wo_a`` maps each of ``o_groups`` head groups to ``o_lora_rank`` channels
  (block-diagonal, ``grouped_linear``), ``wo_b`` mixes them to ``hidden``.

In FP8 (``WeightFormat.fp8``) the projections the released checkpoints store in FP8 are held so:
``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b`` and the indexer's ``wq_b``; the compressors and
the indexer's ``weights_proj`` stay in the serving dtype, as they ship.

Sliding-only layers rotate with the main RoPE; CSA / HCA layers, their compressor and indexer
with the compress RoPE.

With DeepSeek-V4.1's shared sources (``V4Config.sharing``) a layer that is not a KV source
has no compressor: it attends its KV source's compressed rows beside its own window; a Reindex
layer's indexer scores its KV source's index keys, and a Reuse layer has no indexer: it
attends its index source's selection. With V4.1's candidate blocks (``V4Config.candidates``)
the candidate source's indexer publishes each query's blocks and every later indexer scores
only inside them. A forward pass hands these from layer to layer in a ``SharedPass``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dhisparse.family.v4_config import V4Config
from services.worker.model.candidate_blocks import PassCandidates
from services.worker.model.grouped_linear import GroupedLinear
from services.worker.model.v4_compressor import Compressor, CompressorState, visible_rows
from services.worker.model.v4_indexer import Indexer
from services.worker.model.v4_norm import RMSNorm, rms_normalise
from services.worker.model.v4_rope import PassRope, rope_tail
from services.worker.model.weight_format import BF16, WeightFormat, linear


@dataclass
class SharedPass:
    """What one forward pass's layers publish for later ones, by the publishing layer: a KV
    source's compressed rows so far [rows, head_dim] and index keys [rows, index_head_dim],
    an index source's selection [N, rows] bool; the candidate source's blocks (V4.1)."""

    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: PassCandidates | None = None


@dataclass
class AttentionState:
    """One sequence's state in one layer: the last ``sliding_window - 1`` K=V rows and their
    positions, and the compressor's and indexer's states."""

    window: torch.Tensor | None = None  # [w, head_dim]
    window_pos: torch.Tensor | None = None  # [w]
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


class Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, fmt: WeightFormat = BF16) -> None:
        super().__init__()
        self.kind, rate = cfg.attention[layer], cfg.compress[layer]
        self.heads, self.head_dim, self.rope_dim = cfg.num_heads, cfg.head_dim, cfg.rope_dim
        self.window, self.groups, self.eps = cfg.sliding_window, cfg.o_groups, cfg.rms_norm_eps
        self.rope = cfg.main_rope if self.kind == "sliding" else cfg.compress_rope
        self.scale = cfg.softmax_scale
        d, h = cfg.hidden_size, self.heads * self.head_dim
        self.wq_a = linear(d, cfg.q_lora_rank, fmt)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, h, fmt)
        self.wkv = linear(d, self.head_dim, fmt)
        self.norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(self.groups, h // self.groups, cfg.o_lora_rank, fmt)
        self.wo_b = linear(self.groups * cfg.o_lora_rank, d, fmt)
        self.attn_sink = nn.Parameter(torch.empty(self.heads))
        self.rate = rate
        self.layer = layer
        self.kv_source = cfg.sharing.kv_source[layer]  # -1: sliding-only
        self.index_source = cfg.sharing.index_source[layer]  # -1: sliding-only or HCA
        owns_rows = self.kind != "sliding" and self.kv_source == layer
        self.compressor = None
        if owns_rows:
            overlap = self.kind == "csa"
            self.compressor = Compressor(
                d, self.head_dim, rate, overlap, self.rope, self.rope_dim, self.eps
            )
        self.indexer = None
        if self.kind == "csa" and self.index_source == layer:
            self.indexer = Indexer(cfg, rate, self.rope, owns_rows, fmt)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | PassRope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] at positions [N] (or a pass's, ``PassRope``) -> (q latent [N, q_lora_rank], q [N, heads,
        head_dim], the tokens' K=V rows [N, head_dim]), q and rows rotated."""
        n = x.shape[0]
        q_latent = self.q_norm(self.wq_a(x))
        q = rms_normalise(self.wq_b(q_latent).view(n, self.heads, self.head_dim), self.eps)
        q = rope_tail(q, positions, self.rope, self.rope_dim)
        return q_latent, q, self.kv_rows(x, positions)

    def kv_rows(self, x: torch.Tensor, positions: torch.Tensor | PassRope) -> torch.Tensor:
        """x: [N, hidden] at positions [N] -> the tokens' K=V rows [N, head_dim], rotated."""
        return rope_tail(self.norm(self.wkv(x)), positions, self.rope, self.rope_dim)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q: [N, heads, head_dim] over K=V ``keys`` [K, head_dim] (shared by the queries) or
        [N, K, head_dim] (each query's), ``allowed`` [N, K] -> [N, heads, head_dim]: the softmax
        with the heads' sinks as one more logit each."""
        n = q.shape[0]
        shared = keys.dim() == 2
        scores = torch.einsum("nhd,kd->nhk" if shared else "nhd,nkd->nhk", q, keys) * self.scale
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        sink = self.attn_sink.view(1, -1, 1).expand(n, -1, 1).to(scores.dtype)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.einsum("nhk,kd->nhd" if shared else "nhk,nkd->nhd", probs, keys)

    def output(self, out: torch.Tensor, positions: torch.Tensor | PassRope) -> torch.Tensor:
        """The attention's output [N, heads, head_dim] at the queries' positions -> [N, hidden]:
        de-rotated, then the grouped output projection."""
        n = out.shape[0]
        out = rope_tail(out, positions, self.rope, self.rope_dim, inverse=True)
        grouped = out.reshape(n, self.groups, -1)  # [N, groups, heads * head_dim / groups]
        return self.wo_b(self.wo_a(grouped))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, state: AttentionState,
        shared: SharedPass,
    ) -> torch.Tensor:  # fmt: skip
        """x: [N, hidden], the sequence's next N tokens at positions [N] -> [N, hidden]; a
        source publishes into ``shared`` what its consumers read."""
        q_latent, q, kv = self.project(x, positions)
        keys, key_pos = kv, positions
        if state.window is not None:
            keys, key_pos = torch.cat([state.window, kv]), torch.cat([state.window_pos, positions])
        keep = max(self.window - 1, 0)
        state.window, state.window_pos = (
            keys[keys.shape[0] - keep :],
            key_pos[keys.shape[0] - keep :],
        )
        age = positions.unsqueeze(-1) - key_pos.unsqueeze(0)  # [N, keys]
        allowed = (age >= 0) & (age < self.window)

        if self.kind != "sliding":
            if self.compressor is not None:
                shared.rows[self.layer] = self.compressor.extend(x, state.compressor)
                if self.indexer is not None:
                    idx = self.indexer.compressor
                    shared.keys[self.layer] = idx.extend(x, state.indexer)
            rows = shared.rows[self.kv_source]
            if self.kind == "csa":
                if self.indexer is not None:
                    blocks = shared.candidates
                    step = None if blocks is None else blocks.step(self.layer)
                    keys_of = shared.keys[self.kv_source]
                    shared.chosen[self.layer] = self.indexer.select(
                        x, q_latent, positions, keys_of, step
                    )
                chosen = shared.chosen[self.index_source]
            else:
                chosen = visible_rows(positions, rows.shape[0], self.rate)
            keys = torch.cat([keys, rows])
            allowed = torch.cat([allowed, chosen], dim=-1)
        return self.output(self.attend(q, keys, allowed), positions)
