"""Verification of a draft block (Leviathan et al., 2023): accept a prefix of the proposals and
emit one more token, a correction at the first rejection or a bonus when all are accepted.

A round of request r verifies K_r target queries: the anchor x_0 and proposals x_1..x_{K_r-1}.
``target_logits[j]`` is the target's next-token distribution after x_0..x_j, so it scores
proposal x_{j+1}; its last row gives the bonus. Tiny pure functions, one request at a time so
each can use its own seeded generator; ``verify_batch`` strings them over a verify pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.worker.request.request import SamplingParams
from services.worker.request.sampling import sampling_probs


class Verdict(NamedTuple):
    num_accepted: int  # A: proposals accepted, 0 <= A <= K-1
    next_token: int  # b: the correction (A < K-1) or bonus (A = K-1), the next anchor


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[K, V] shaped logits -> [K, V] fp32 probabilities the engine would sample from
    (``sampling_probs``, as ``sample_token``: temperature, min-p, top-k, top-p, softmax)."""
    return sampling_probs(logits, params)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """target_logits: [K, V]; draft_tokens: [K-1] -> the longest prefix where each proposal is
    the target's argmax, then the argmax at the first mismatch (or after the last proposal)."""
    best = torch.argmax(target_logits, dim=-1).tolist()  # [K]
    drafts = draft_tokens.tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return Verdict(a, best[a])


def verify_sampling(
    probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """probs: [K, V] target distributions (``target_probs``); draft_tokens: [K-1];
    draft_probs: [K-1, V] the proposal distributions q each x_i was drawn from, or None for a
    deterministic drafter (q one-hot on x_i)."""
    k = probs.shape[0]
    drafts = draft_tokens.tolist()
    u = torch.rand(k - 1, generator=generator, device=probs.device, dtype=torch.float64)
    u = u.tolist()
    for i, x in enumerate(drafts):
        p = probs[i]
        q = _one_hot(x, p) if draft_probs is None else draft_probs[i].to(p.dtype)
        px, qx = float(p[x]), float(q[x])
        # Accept x with probability min(1, p(x)/q(x)). Otherwise resample from the residual
        # norm(max(0, p - q)): the mass p has beyond q. Accepted-or-resampled is then exactly
        # p (Leviathan et al., Thm. 1), whatever q was.
        if qx > 0.0 and u[i] * qx <= px:
            continue
        residual = (p - q).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had no mass
            residual = p
        return Verdict(i, int(torch.multinomial(residual, 1, generator=generator)))
    return Verdict(k - 1, int(torch.multinomial(probs[k - 1], 1, generator=generator)))


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """One request's round. target_logits: [K, V] fp32, row j shaped as the token after the
    anchor and proposals x_1..x_j (``Request.shape_logits``, by the caller); draft_tokens: [K-1] int64; draft_probs: [K-1, V] or None.

    Greedy params compare argmaxes (q is not needed); otherwise speculative sampling, whose
    emitted tokens are distributed exactly as sampling from the target one token at a time."""
    if draft_tokens.numel() != target_logits.shape[0] - 1:
        raise ValueError(
            f"{draft_tokens.numel()} proposals for {target_logits.shape[0]} target queries"
        )
    if params.greedy:
        return verify_greedy(target_logits, draft_tokens)
    return verify_sampling(
        target_probs(target_logits, params), draft_tokens, draft_probs, generator
    )


def verify_batch(
    target_logits: torch.Tensor,
    widths: Sequence[int],
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    drafts: list[list[int]] | None = None,
) -> list[Verdict]:
    """A verify pass over R requests of widths K_r (anchor included).

    target_logits: [sum K_r, V] in batch order (request r's rows are contiguous, as a
    ``ForwardBatch`` with lens = widths lays them out); draft_tokens: [R, K_max-1] (-1 beyond
    K_r-1); draft_probs: [R, K_max-1, V] or None; drafts: ``draft_tokens`` on the host, when
    the caller has read them already. Greedy requests share one argmax and one device->host
    copy; sampled ones run ``verify_sampling`` with their own generator."""
    if not len(widths) == len(params) == len(generators) == draft_tokens.shape[0]:
        raise ValueError("one width, params and generator per request")
    if sum(widths) != target_logits.shape[0]:
        raise ValueError(f"widths sum to {sum(widths)}, logits have {target_logits.shape[0]} rows")
    best = torch.argmax(target_logits, dim=-1).tolist()  # [sum K_r]
    if drafts is None:
        drafts = draft_tokens.tolist()
    out: list[Verdict] = []
    start = 0
    for r, (k, p, g) in enumerate(zip(widths, params, generators, strict=True)):
        if p.greedy:
            a = 0
            while a < k - 1 and drafts[r][a] == best[start + a]:
                a += 1
            out.append(Verdict(a, best[start + a]))
        else:
            q = None if draft_probs is None else draft_probs[r, : k - 1]
            probs = target_probs(target_logits[start : start + k], p)
            out.append(verify_sampling(probs, draft_tokens[r, : k - 1], q, g))
        start += k
    return out


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
