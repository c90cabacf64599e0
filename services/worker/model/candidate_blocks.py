"""DeepSeek-V4.1's candidate blocks in a forward pass (the rule and its sources:
``dhisparse.family.v41_candidates``): the candidate source's indexer publishes, per query
token, the blocks of compressed positions its scores rank best; every later indexer of the
same pass scores only inside them.

``select_blocks`` and ``within_blocks`` are the rule, plain torch, with static shapes and no
host read (a captured decode pass holds them); ``PassCandidates`` carries one pass's blocks
from the source to its consumers, created with the pass, so nothing outlives it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F

from dhisparse.family.v41_candidates import CandidateBlocks


def select_blocks(
    scores: torch.Tensor, num_visible: torch.Tensor, block_size: int, topk_blocks: int,
    count: int,
) -> torch.Tensor:  # fmt: skip
    """scores [T, S] fp32 of T query tokens over compressed positions, num_visible [T] (each
    sees positions 0 .. num_visible - 1) -> [T, count] int64: each token's candidate blocks
    (block b: positions b * block_size .. b * block_size + block_size - 1), best first, -1
    pads. A block scores the max of its visible positions; the block of the newest visible
    position is pinned in; the ``topk_blocks`` best are kept, ties to the lower block, a
    block with no visible position never. ``count``: at least min(topk_blocks, blocks of S)."""
    t, s = scores.shape
    blocks = -(-s // block_size)
    cols = torch.arange(s, device=scores.device)
    seen = scores.masked_fill(cols.unsqueeze(0) >= num_visible.unsqueeze(1), float("-inf"))
    best = F.pad(seen, (0, blocks * block_size - s), value=float("-inf"))
    best = best.view(t, blocks, block_size).amax(dim=-1)  # [T, blocks]
    newest = torch.div(num_visible - 1, block_size, rounding_mode="floor")  # -1: sees none
    ids = torch.arange(blocks, device=scores.device)
    best = best.masked_fill(ids.unsqueeze(0) == newest.unsqueeze(1), float("inf"))
    # a stable descending sort keeps equal scores in ascending block order
    order = torch.sort(best, dim=1, descending=True, stable=True).indices[:, :topk_blocks]
    kept = order.masked_fill(best.gather(1, order) == float("-inf"), -1)
    if kept.shape[1] >= count:
        return kept[:, :count]
    return torch.cat([kept, kept.new_full((t, count - kept.shape[1]), -1)], dim=1)


def within_blocks(scores: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """scores [T, S] -> the same with every position outside the token's ``blocks`` [T, B]
    (-1: none) at -inf."""
    t, s = scores.shape
    n = -(-s // block_size)
    keep = torch.zeros(t, n + 1, dtype=torch.bool, device=scores.device)  # column n: none
    keep.scatter_(1, torch.where(blocks < 0, n, blocks.clamp(max=n)), True)
    of = torch.arange(s, device=scores.device) // block_size
    return scores.masked_fill(~keep[:, of], float("-inf"))


class ScoreStep(Protocol):
    def __call__(
        self, scores: torch.Tensor, num_visible: torch.Tensor, tokens: slice, num_tokens: int,
        width: int,
    ) -> torch.Tensor:  # fmt: skip
        """An indexer's scores [t, S] of the pass's query tokens ``tokens`` (of
        ``num_tokens``), each seeing ``num_visible`` [t] positions of at most ``width`` ->
        the scores its top-k ranks."""
        ...


@dataclass
class PassCandidates:
    """One forward pass's candidate blocks: ``blocks`` [N, B] int64 per query token of the
    pass once the candidate source's indexer has run (``select_blocks``), else None."""

    rule: CandidateBlocks
    blocks: torch.Tensor | None = None

    def step(self, layer: int) -> ScoreStep | None:
        """What layer ``layer``'s indexer does to its scores before its top-k: the source
        publishes the blocks (its own top-k unchanged), a consumer masks outside them; None
        for any other layer."""
        role = self.rule.role(layer)
        if role == "source":
            return self._publish
        return self._restrict if role == "consumer" else None

    def _publish(
        self, scores: torch.Tensor, num_visible: torch.Tensor, tokens: slice, num_tokens: int,
        width: int,
    ) -> torch.Tensor:  # fmt: skip
        bs, k = self.rule.block_size, self.rule.topk_blocks
        count = min(k, -(-width // bs))
        if self.blocks is None:  # the pass's first scores: one source per pass
            self.blocks = scores.new_full((num_tokens, count), -1, dtype=torch.int64)
        self.blocks[tokens] = select_blocks(scores, num_visible, bs, k, count)
        return scores

    def _restrict(
        self, scores: torch.Tensor, num_visible: torch.Tensor, tokens: slice, num_tokens: int,
        width: int,
    ) -> torch.Tensor:  # fmt: skip
        assert self.blocks is not None, "a candidate consumer ran before its source"
        return within_blocks(scores, self.blocks[tokens], self.rule.block_size)
