"""DSpark (Cheng et al., 2026): the DFlash backbone plus two light heads applied slot by slot
after the parallel pass.

- Markov head: a low-rank bigram logit bias ``W2·W1[x_{k-1}]`` added to slot k's logits, so
  each proposal depends on the one before it (x_0 is the anchor). The proposal distribution q
  of slot k is then conditional on x_1..x_{k-1}, which is exactly what verification needs.
- Confidence head: ``sigmoid(Linear([h_k ; W1[x_{k-1}]]))``, the chance slot k is accepted
  given the prefix before it; cumulative products are prefix survivals that the confidence
  scheduler (``services.worker.speculative.confidence``) turns into per-request widths K_r.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from services.worker.model.decoder import SparseDecoder
from services.worker.speculative.confidence import ConfidenceScheduler
from services.worker.speculative.drafters.base import Drafter, accept_length, token_loss
from services.worker.speculative.drafters.config import DrafterConfig
from services.worker.speculative.proposal import draw, tempered


class DSparkDrafter(Drafter):
    kind = "dspark"

    def __init__(self, cfg: DrafterConfig, target: SparseDecoder) -> None:
        super().__init__(cfg, target)
        self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)  # W1
        self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)  # W2
        nn.init.zeros_(self.markov_out.weight)  # starts as plain DFlash
        self.confidence = nn.Linear(cfg.d_model + cfg.markov_rank, 1)
        # Picks K_r from the confidences when set (not part of the weights).
        self.scheduler: ConfidenceScheduler | None = None

    def _slot(
        self, base: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot: base logits [R, V], hidden [R, d], previous tokens [R] -> logits [R, V],
        confidence logit [R]."""
        e = self.markov_in(prev)  # [R, rank]
        conf = self.confidence(torch.cat([hidden, e.to(hidden.dtype)], dim=-1)).squeeze(-1)
        return base + self.markov_out(e).float(), conf

    def select(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        base = self.base_logits(hidden)  # [R, K-1, V]
        prev = anchors
        tokens, qs, confs = [], [], []
        for k in range(base.shape[1]):
            logits, conf = self._slot(base[:, k], hidden[:, k], prev)
            q = tempered(logits, temperatures)  # [R, V]
            prev = q.argmax(-1) if noise is None else draw(q, noise[:, k])
            tokens.append(prev)
            qs.append(q)
            confs.append(torch.sigmoid(conf.float()))
        return torch.stack(tokens, 1), torch.stack(qs, 1), torch.stack(confs, 1)

    def choose_widths(self, widths: list[int], confidence: torch.Tensor | None) -> list[int]:
        if self.scheduler is None or confidence is None:
            return widths
        return self.scheduler.widths(confidence, widths)

    def loss(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        labels: torch.Tensor,
        target_logits: torch.Tensor,
        weights: torch.Tensor,
        distill: float = 0.0,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Teacher-forced: slot k's Markov input is the target's token x_{k-1} (the anchor for
        k = 1). The confidence head learns the acceptance probability of sampling q against
        the target, 1 - ½‖q - p‖₁ (DSpark's target), by BCE."""
        h = hidden[:, 1:]
        base = self.base_logits(h)  # [B, K-1, V]
        prev = torch.cat([anchors.unsqueeze(1), labels[:, :-1].clamp(min=0)], dim=1)
        logits, conf = self._slot(base, h, prev)
        pt = target_logits.float().softmax(-1)
        ce = token_loss(logits, labels, pt, weights, distill)
        with torch.no_grad():
            tv = 0.5 * (logits.softmax(-1) - pt).abs().sum(-1)
            accept = 1.0 - tv  # [B, K-1]
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        bce = (bce * weights).sum(-1).mean() / weights.sum()
        metrics = {
            "token_loss": float(ce.detach()),
            "bce": float(bce.detach()),
            "accept_len": accept_length(logits.argmax(-1), labels),
        }
        return ce + bce, metrics
