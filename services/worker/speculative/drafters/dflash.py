"""DFlash (Chen et al., 2026): one parallel pass over [anchor, MASK × (K_max-1)] gives the
logits of every masked slot; each slot's proposal comes from its own distribution."""

from __future__ import annotations

import torch

from services.worker.speculative.drafters.base import Drafter, accept_length, token_loss
from services.worker.speculative.proposal import draw, tempered


class DFlashDrafter(Drafter):
    kind = "dflash"

    def select(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q = tempered(self.base_logits(hidden), temperatures)  # [R, K-1, V]
        tokens = q.argmax(-1) if noise is None else draw(q, noise)
        return tokens, q, None

    def loss(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        labels: torch.Tensor,
        target_logits: torch.Tensor,
        weights: torch.Tensor,
        distill: float = 0.0,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.base_logits(hidden[:, 1:])  # [B, K-1, V]
        loss = token_loss(logits, labels, target_logits.float().softmax(-1), weights, distill)
        return loss, {
            "loss": float(loss.detach()),
            "accept_len": accept_length(logits.argmax(-1), labels),
        }
