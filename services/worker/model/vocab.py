"""The vocabulary split over an attention group (tensor parallel): each rank holds the rows
``[start, stop)`` of the embedding and of the head. A lookup gives zero for tokens outside the
rank's rows and the group's sum gives every token its row; the head's logits over the rank's
rows are gathered in rank order into the whole vocabulary's."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dhisparse.family.parallel_layout import Span
from services.worker.model.layers import head_logits
from services.worker.parallel.comm import LOCAL, Comm


class VocabEmbedding(nn.Embedding):
    """``rows`` of the vocabulary's embedding (the whole of it on one rank)."""

    def __init__(self, rows: Span, dim: int, group: Comm = LOCAL) -> None:
        super().__init__(rows.size, dim)
        self.rows = rows
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows.whole:
            return super().forward(ids)
        local = ids - self.rows.start
        mine = (local >= 0) & (local < self.rows.size)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.group.all_reduce(torch.where(mine.unsqueeze(-1), out, 0))


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, group: Comm = LOCAL) -> torch.Tensor:
    """``hidden [..., d]`` and this rank's head rows ``weight [V / N, d]`` -> the whole
    vocabulary's logits ``[..., V]`` fp32 on every rank of ``group``."""
    return group.all_gather(head_logits(hidden, weight), dim=-1)
