"""DFlash2 (Inco AI, 2026): parallel drafting with a conditional candidate-lattice selector.

The parallel pass keeps the top-C candidates of every slot (the lattice). A transition from
token a (the previous slot's choice; the anchor for slot 1) to candidate b of slot t scores
``S(a, b) = U_t(b) + ⟨A(a) ⊙ H(h_t), B(b)⟩``: U_t is the parallel pass's logit, A, B are
low-rank token embeddings and H maps slot t's hidden state into the same rank. A greedy walk
from the anchor takes the best candidate at each slot (T = 0); at T > 0 it samples slot t from
``softmax(S(x_{t-1}, ·)/T)`` over the candidates. That distribution, zero outside the
candidates, is the proposal q verification sees, so acceptance stays lossless. Fixed block.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.model.decoder import SparseDecoder
from services.worker.speculative.drafters.base import Drafter, accept_length, token_loss
from services.worker.speculative.drafters.config import DrafterConfig
from services.worker.speculative.proposal import draw, tempered


class DFlash2Drafter(Drafter):
    kind = "dflash2"

    def __init__(self, cfg: DrafterConfig, target: SparseDecoder) -> None:
        super().__init__(cfg, target)
        r = cfg.selector_rank
        self.sel_a = nn.Embedding(cfg.vocab_size, r)
        self.sel_b = nn.Embedding(cfg.vocab_size, r)
        self.sel_h = nn.Linear(cfg.d_model, r, bias=False)
        nn.init.zeros_(self.sel_h.weight)  # starts as the parallel pass's own ranking
        nn.init.normal_(self.sel_a.weight, std=r**-0.5)
        nn.init.normal_(self.sel_b.weight, std=r**-0.5)

    def lattice(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden: [R, K-1, d] -> candidates [R, K-1, C], their unary scores U [R, K-1, C],
        H(h) [R, K-1, r]."""
        u, cand = self.base_logits(hidden).topk(self.cfg.num_candidates, dim=-1)
        return cand, u, self.sel_h(hidden)

    def scores(
        self, prev: torch.Tensor, cand: torch.Tensor, u: torch.Tensor, hh: torch.Tensor
    ) -> torch.Tensor:
        """S(prev, ·) over the candidates: prev [...]; cand, u [..., C]; hh [..., r] ->
        [..., C] fp32."""
        a = self.sel_a(prev) * hh  # [..., r]
        return u + (self.sel_b(cand) * a.unsqueeze(-2)).sum(-1).float()

    def select(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        cand, u, hh = self.lattice(hidden)
        r, k1, _ = cand.shape
        prev = anchors
        tokens, qs = [], []
        for t in range(k1):
            qc = tempered(self.scores(prev, cand[:, t], u[:, t], hh[:, t]), temperatures)
            if noise is None:
                j = qc.argmax(-1)
            else:  # Exp(1) draws at distinct vocabulary ids are independent
                j = draw(qc, noise[:, t].gather(-1, cand[:, t]))
            prev = cand[:, t].gather(-1, j.unsqueeze(-1)).squeeze(-1)
            tokens.append(prev)
            q = torch.zeros(r, self.cfg.vocab_size, device=qc.device)
            qs.append(q.scatter_(-1, cand[:, t], qc))
        return torch.stack(tokens, 1), torch.stack(qs, 1), None

    def loss(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        labels: torch.Tensor,
        target_logits: torch.Tensor,
        weights: torch.Tensor,
        distill: float = 0.0,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Decayed CE of the parallel pass plus the selector's CE over the lattice, teacher
        forced (the previous slot's target token), where the label is among the candidates."""
        h = hidden[:, 1:]
        pt = target_logits.float().softmax(-1)
        ce = token_loss(self.base_logits(h), labels, pt, weights, distill)
        cand, u, hh = self.lattice(h)
        prev = torch.cat([anchors.unsqueeze(1), labels[:, :-1].clamp(min=0)], dim=1)
        s = self.scores(prev, cand, u, hh)  # [B, K-1, C]
        hit = cand == labels.unsqueeze(-1)
        target = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, -100))
        # soft target on the lattice: the target's probabilities of the candidates, renormalised
        pc = pt.gather(-1, cand)
        pc = pc / pc.sum(-1, keepdim=True).clamp(min=1e-30)
        sel = token_loss(s, target, pc, weights, distill)
        picked = cand.gather(-1, s.argmax(-1, keepdim=True)).squeeze(-1)
        metrics = {
            "token_loss": float(ce.detach()),
            "selector_ce": float(sel.detach()),
            "recall": float(hit.any(-1).float().mean()),
            "accept_len": accept_length(picked, labels),
        }
        return ce + sel, metrics
