"""Sampling from logits: tiny pure functions, one request at a time so each can use its own
seeded generator."""

from __future__ import annotations

import torch

from services.worker.request.request import SamplingParams, TokenLogprob


def truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """[..., V] temperature-scaled logits -> [..., V] with every token outside the kept set at
    -inf, in vLLM's order: min-p (keep p >= min_p * max p), then top-k, then the top-p
    nucleus (each over what the previous kept)."""
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        floor = min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits (already shaped: ``Request.shape_logits``) of a sampled (not greedy)
    request -> [..., V] fp32 probabilities it samples from: temperature, then ``truncate``,
    then softmax. Plain sampling and speculative verification both use it, so they sample
    one law."""
    x = truncate(logits.float() / params.temperature, params.top_k, params.top_p, params.min_p)
    return torch.softmax(x, dim=-1)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """logits: [V] fp32, already shaped (``Request.shape_logits``) -> a token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """Log-probability of ``token`` under the distribution of ``logits`` before temperature and
    truncation (after the request's shaping), and the top ``top_n``."""
    lp = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        v, i = torch.topk(lp, top_n)
        top = tuple(zip(i.tolist(), v.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), top)
