"""What a drafter hands to verification, and the sampling it uses to make it.

Lossless verification needs, for every proposed token, the distribution q it was drawn from.
A greedy request (temperature 0) is proposed deterministically: its q is one-hot on the token.
Sampling uses per-request Exp(1) noise (``argmax(q / E)`` is a draw from q), so a request's
proposals depend only on its own generator, and a whole block samples in one vectorised op."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.transfers import to_device


@dataclass(frozen=True)
class Proposal:
    """Proposals of one drafting round for R requests."""

    tokens: torch.Tensor  # [R, K_max-1] int64: x_1..x_{K_r-1}, -1 beyond
    probs: torch.Tensor | None  # [R, K_max-1, V] fp32 q rows (zero beyond); None: all greedy
    widths: list[int]  # K_r: target queries to verify, anchor included
    confidence: torch.Tensor | None = None  # [R, K_max-1] DSpark: P(slot accepted | prefix)

    def drafts(self, r: int) -> torch.Tensor:
        """[K_r-1] request r's proposals."""
        return self.tokens[r, : self.widths[r] - 1]


def _masked(
    tokens: torch.Tensor, probs: torch.Tensor | None, widths: Sequence[int]
) -> dict[str, torch.Tensor | None]:
    """Proposals beyond K_r-1 set to -1 and their q rows to zero."""
    slot = torch.arange(tokens.shape[1], device=tokens.device)
    keep = slot.unsqueeze(0) < (to_device(list(widths), tokens.device) - 1).unsqueeze(1)
    tokens = tokens.masked_fill(~keep, -1)
    if probs is not None:
        probs = probs.masked_fill(~keep.unsqueeze(-1), 0.0)
    return {"tokens": tokens, "probs": probs}


def finish(
    tokens: torch.Tensor,
    probs: torch.Tensor | None,
    widths: Sequence[int],
    confidence: torch.Tensor | None = None,
) -> Proposal:
    """Builds a Proposal of ``widths``: masks what lies beyond each request's width."""
    return Proposal(widths=list(widths), confidence=confidence, **_masked(tokens, probs, widths))


def verify_ids(
    tokens: torch.Tensor, anchors: Sequence[int], widths: Sequence[int], passed: Sequence[int]
) -> torch.Tensor:
    """[sum passed] the verify pass's new tokens, built on the device: request r's anchor, its
    first ``widths[r] - 1`` proposals (``tokens`` [R, K_max-1]), then its anchor again up to
    ``passed[r]`` queries. No read-back: the pass is launched before the proposals reach the
    host."""
    device = tokens.device
    r, kp = len(anchors), max(passed)
    first = to_device(list(anchors), device).unsqueeze(1)
    if min(widths) == kp:  # every request verifies K_max queries: anchor, then its proposals
        return torch.cat([first, tokens[:, : kp - 1]], dim=1).reshape(-1)
    block = first.expand(r, kp).clone()
    n = min(kp - 1, tokens.shape[1])
    if n > 0:
        col = torch.arange(1, n + 1, device=device).unsqueeze(0)
        drafted = col < to_device(list(widths), device).unsqueeze(1)
        block[:, 1 : n + 1] = torch.where(drafted, tokens[:, :n], block[:, 1 : n + 1])
    if all(p == kp for p in passed):
        return block.reshape(-1)
    rows = [i * kp + j for i, p in enumerate(passed) for j in range(p)]
    return block.reshape(-1)[to_device(rows, device)]


def exp_noise(
    shape: tuple[int, ...],
    temperatures: Sequence[float],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """[R, *shape] Exp(1) draws, request r's from ``generators[r]`` (ones for greedy requests,
    which consume no randomness)."""
    rows = []
    for t, g in zip(temperatures, generators, strict=True):
        if t > 0.0:
            u = torch.rand(shape, generator=g, device=device, dtype=torch.float32)
            # u in [0, 1): E in [0, inf); the clamp keeps q/E finite (and 0 where q = 0)
            rows.append((-torch.log1p(-u)).clamp(min=torch.finfo(torch.float32).tiny))
        else:
            rows.append(torch.ones(shape, device=device))
    return torch.stack(rows)


def tempered(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [R, ..., V]; temperatures: [R] -> q [R, ..., V] fp32: softmax(logits / T), or
    one-hot on the argmax where T = 0."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    t = temperatures.to(logits.device, torch.float32).view(shape)
    soft = torch.softmax(logits.float() / t.clamp(min=1e-6), dim=-1)
    hard = torch.zeros_like(soft).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(t > 0, soft, hard)


def draw(q: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[..., V] distributions and Exp(1) noise -> [...] tokens: argmax(q / E) ~ q (never a
    token with q = 0 unless the whole row is 0)."""
    return torch.argmax(q / noise, dim=-1)


def per_request(
    r: int,
    kmax: int,
    widths: Sequence[int] | None,
    temperatures: float | Sequence[float],
    generators: Sequence[torch.Generator | None] | None,
) -> tuple[list[int], list[float], list[torch.Generator | None]]:
    """A ``propose`` call's arguments for its r requests: the block caps (``widths`` clamped
    to [1, kmax], default kmax), the temperatures (one for all, or one each) and the
    generators (default none)."""
    caps = [kmax] * r if widths is None else [max(1, min(int(w), kmax)) for w in widths]
    if isinstance(temperatures, float | int):
        temps = [float(temperatures)] * r
    else:
        temps = [float(t) for t in temperatures]
    gens = list(generators) if generators is not None else [None] * r
    return caps, temps, gens
