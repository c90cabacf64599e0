"""A plain-torch reference for DeepSeek-V4.1's shared sources on a transformers 5.17.0 V4 model
(transformers has no V4.1), written from the facts of ``notes/real-models.md`` §3.9 and
DeepSeek's ``inference/model.py`` as third-party ports quote it:

- a KV source (``kv_source_layers``) computes its compressed rows and index keys; every later
  compressed layer attends the rows of the most recent KV source at or below it, beside its
  own sliding window;
- an index source (``index_source_layers``) runs an indexer: with its own query projection,
  scorer and RoPE over its KV source's index keys; every other compressed layer attends the
  top-k of the most recent index source at or below it.

The transformers model runs whole sequences (no cache) as it is; only each CSA layer's
compressor is replaced by a stand-in that publishes (a KV source: the original compressor,
whose rows, block mask and index keys it records) or reads (a consumer) the shared source.
Everything else — window, sinks, de-rotation, output projection, mHC, MoE — is transformers'
own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from tests import hf_tiny


@dataclass
class Published:
    """One forward's publications, by layer: a KV source's rows [B, 1, T, d] and index keys
    [B, T, d_index], an index source's block mask [B, 1, S, T] (0 attended, -inf not)."""

    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)


def latest(sources: list[int], layer: int) -> int:
    """The most recent source at or below ``layer``."""
    return max(s for s in sources if s <= layer)


class SourceCompressor(nn.Module):
    """A KV source's own CSA compressor (and indexer), recording what it publishes."""

    def __init__(self, original: nn.Module, layer: int, out: Published) -> None:
        super().__init__()
        self.original, self.layer, self.out = original, layer, out

    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        def keep_keys(_module, args):
            self.out.keys[self.layer] = args[1]  # the scorer's compressed index keys

        hook = self.original.indexer.scorer.register_forward_pre_hook(keep_keys)
        try:
            rows, bias = self.original(hidden_states, q_residual, position_ids, None, layer_idx)
        finally:
            hook.remove()
        self.out.rows[self.layer], self.out.bias[self.layer] = rows, bias
        return rows, bias


class ConsumerCompressor(nn.Module):
    """A consumer of KV source ``kv``: its rows, and either its index source ``index``'s block
    mask (Reuse) or, when it is its own index source (Reindex), the top-k of its indexer's
    queries over the KV source's index keys."""

    def __init__(
        self, original: nn.Module, layer: int, kv: int, index: int, out: Published
    ) -> None:
        super().__init__()
        self.indexer = original.indexer  # its query projection, scorer and rotary
        self.layer, self.kv, self.index, self.out = layer, kv, index, out

    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        rows = self.out.rows[self.kv]
        if self.index != self.layer:
            return rows, self.out.bias[self.index]
        keys = self.out.keys[self.kv]  # [B, T, d_index]
        ix = self.indexer
        batch, seq_len, _ = hidden_states.shape
        cos, sin = ix.rotary_emb(hidden_states, position_ids=position_ids, layer_type="compress")
        q = ix.q_b_proj(q_residual).view(batch, seq_len, -1, ix.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
        scores = ix.scorer(q, keys, hidden_states)  # [B, S, T]
        n = keys.shape[1]
        threshold = ((position_ids + 1) // ix.compress_rate).unsqueeze(-1)  # [B, S, 1]
        future = torch.arange(n).view(1, 1, -1) >= threshold
        top = scores.masked_fill(future, float("-inf")).topk(min(ix.index_topk, n), dim=-1)
        picks = torch.where(top.indices >= threshold, n, top.indices)  # n: not attended
        bias = rows.new_full((batch, 1, seq_len, n + 1), float("-inf"))
        bias.scatter_(-1, picks.unsqueeze(1), 0.0)
        self.out.bias[self.layer] = bias[..., :n]
        return rows, self.out.bias[self.layer]


@contextmanager
def shared_sources(model: nn.Module, kv_sources: list[int], index_sources: list[int]) -> Iterator:
    """``model`` (transformers' V4, CSA and sliding layers only) run with V4.1's sources while
    inside: each CSA layer's compressor replaced by its stand-in, restored on exit."""
    out = Published()
    originals = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.compressor is None:
            continue
        assert attn.layer_type == "compressed_sparse_attention", "CSA layers only"
        originals[i] = attn.compressor
        kv, index = latest(kv_sources, i), latest(index_sources, i)
        attn.compressor = (
            SourceCompressor(attn.compressor, i, out)
            if kv == i
            else ConsumerCompressor(attn.compressor, i, kv, index, out)
        )
    try:
        yield
    finally:
        for i, compressor in originals.items():
            model.model.layers[i].self_attn.compressor = compressor


def logits(
    model: nn.Module, kv_sources: list[int], index_sources: list[int], ids: torch.Tensor
) -> torch.Tensor:
    """ids [T] -> the reference's logits [T, vocab] (one uncached forward)."""
    with shared_sources(model, kv_sources, index_sources):
        return hf_tiny.reference_logits(model, ids)


def greedy_under(
    model: nn.Module, kv_sources: list[int], index_sources: list[int], prompt: list[int],
    out: list[int],
) -> list[int]:  # fmt: skip
    """``hf_tiny.greedy_under_reference`` under the reference: equal to ``out`` iff ``out`` is
    its greedy continuation of ``prompt``."""
    got = logits(model, kv_sources, index_sources, torch.tensor(prompt + out[:-1]))
    return got[len(prompt) - 1 :].argmax(-1).tolist()
