"""A plain-torch reference for DeepSeek-V4.1's shared sources on a transformers 5.17.0 V4 model
(transformers has no V4.1), written from the facts of ``notes/real-models.md`` §3.9 and
DeepSeek's ``inference/model.py`` as third-party ports quote it:

- a KV source (``kv_source_layers``) computes its compressed rows and index keys; every later
  compressed layer attends the rows of the most recent KV source at or below it, beside its
  own sliding window;
- an index source (``index_source_layers``) runs an indexer: with its own query projection,
  scorer and RoPE over its KV source's index keys; every other compressed layer attends the
  top-k of the most recent index source at or below it;
- with a candidate source (``Candidates``: ``candidate_source_layer``, an index source), per
  query token its index scores over the compressed positions the token sees (the rest -inf)
  make blocks of ``block_size`` positions, each scoring its best position (the last padded
  with -inf); the block of the token's newest position is pinned in (+inf) and the
  ``topk_blocks`` best blocks kept, an all -inf one dropped; every later index source scores
  only inside them (-inf outside, before its top-k); the source's own top-k is unfiltered.
  (DeepSeek's ``select_candidate_blocks`` and ``Indexer.forward``, as ports quote them; ties
  between blocks to the lower block, where DeepSeek's ``torch.topk`` leaves them unordered.)

The transformers model runs whole sequences (no cache) as it is; only each CSA layer's
compressor is replaced by a stand-in that publishes (a KV source: the original compressor,
whose rows, block mask and index keys it records) or reads (a consumer) the shared source,
and, with a candidate source, the index sources' scorers from it on are hooked: the source's
to record its blocks, the later ones' to mask outside them.
Everything else — window, sinks, de-rotation, output projection, mHC, MoE — is transformers'
own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from tests import hf_tiny


@dataclass
class Published:
    """One forward's publications, by layer: a KV source's rows [B, 1, T, d] and index keys
    [B, T, d_index], an index source's block mask [B, 1, S, T] (0 attended, -inf not), the
    candidate source's candidate positions [B, S, T] bool."""

    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None


@dataclass(frozen=True)
class Candidates:
    """V4.1's ``candidate_source_layer``, ``candidate_block_size``, ``candidate_topk_blocks``."""

    source: int
    block_size: int
    topk_blocks: int


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """scores [B, S, T], -inf where a query cannot see, visible [B, S, 1] (how many positions
    each sees) -> [B, S, T] bool, the positions of each query's candidate blocks."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block_size), value=float("-inf"))
    blocks = blocks.unflatten(-1, (-1, block_size)).amax(dim=-1)  # [B, S, blocks]
    last = (visible - 1) // block_size  # -1 (none) when it sees nothing
    ids = torch.arange(blocks.shape[-1])
    blocks = blocks.masked_fill(ids == last, float("inf"))
    order = blocks.sort(dim=-1, descending=True, stable=True).indices[..., :topk_blocks]
    keep = torch.zeros_like(blocks, dtype=torch.bool)
    keep.scatter_(-1, order, blocks.gather(-1, order) > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


def candidate_hook(layer: int, rate: int, rule: Candidates, out: Published):
    """A forward hook for index source ``layer``'s scorer (the candidate source's or a later
    one's) in one uncached forward from position 0."""

    def hook(_module, _args, scores):  # scores [B, S, T]
        s, t = scores.shape[1:]
        visible = ((torch.arange(s) + 1) // rate).view(1, s, 1)
        if layer == rule.source:
            seen = scores.masked_fill(torch.arange(t) >= visible, float("-inf"))
            out.candidates = select_candidate_blocks(
                seen, visible, rule.topk_blocks, rule.block_size
            )
            return None
        return scores.masked_fill(~out.candidates, float("-inf"))

    return hook


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
def shared_sources(
    model: nn.Module, kv_sources: list[int], index_sources: list[int],
    candidates: Candidates | None = None,
) -> Iterator:  # fmt: skip
    """``model`` (transformers' V4, CSA and sliding layers only) run with V4.1's sources (and
    ``candidates``) while inside: each CSA layer's compressor replaced by its stand-in, the
    index sources' scorers from the candidate source on hooked; restored on exit."""
    out = Published()
    originals, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.compressor is None:
            continue
        assert attn.layer_type == "compressed_sparse_attention", "CSA layers only"
        originals[i] = attn.compressor
        kv, index = latest(kv_sources, i), latest(index_sources, i)
        if candidates is not None and index == i >= candidates.source:
            ix = attn.compressor.indexer
            hook = candidate_hook(i, ix.compress_rate, candidates, out)
            hooks.append(ix.scorer.register_forward_hook(hook))
        attn.compressor = (
            SourceCompressor(attn.compressor, i, out)
            if kv == i
            else ConsumerCompressor(attn.compressor, i, kv, index, out)
        )
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for i, compressor in originals.items():
            model.model.layers[i].self_attn.compressor = compressor


def logits(
    model: nn.Module, kv_sources: list[int], index_sources: list[int], ids: torch.Tensor,
    candidates: Candidates | None = None,
) -> torch.Tensor:  # fmt: skip
    """ids [T] -> the reference's logits [T, vocab] (one uncached forward)."""
    with shared_sources(model, kv_sources, index_sources, candidates):
        return hf_tiny.reference_logits(model, ids)


def greedy_under(
    model: nn.Module, kv_sources: list[int], index_sources: list[int], prompt: list[int],
    out: list[int], candidates: Candidates | None = None,
) -> list[int]:  # fmt: skip
    """``hf_tiny.greedy_under_reference`` under the reference: equal to ``out`` iff ``out`` is
    its greedy continuation of ``prompt``."""
    ids = torch.tensor(prompt + out[:-1])
    got = logits(model, kv_sources, index_sources, ids, candidates)
    return got[len(prompt) - 1 :].argmax(-1).tolist()
