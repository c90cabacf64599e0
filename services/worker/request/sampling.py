"""Sampling from logits: tiny pure functions, one request at a time so each can use its own
seeded generator."""

from __future__ import annotations

import torch

from services.worker.request.request import SamplingParams, TokenLogprob


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[V] -> [V] with tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """logits: [V] fp32 (already masked for min_tokens) -> a token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = apply_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """Log-probability of ``token`` under the model's raw distribution, and the top ``top_n``."""
    lp = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        v, i = torch.topk(lp, top_n)
        top = tuple(zip(i.tolist(), v.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), top)
