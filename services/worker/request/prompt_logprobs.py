"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and its
top-n alternatives, scored from the hidden states a prefill pass computes anyway.

The logits at position ``p`` of a request score the token at ``p + 1``; a prompt of ``n`` tokens
has ``n - 1`` such scores (positions ``0 .. n - 2``), and its first token none. A request
records them in order across its prefill chunks (``Request.prompt_scored``) and sends them
once, on its first output (``take``). Positions already recorded are never scored again (a
preempted request recomputes its prefill), and a request that did not compute its prompt from
the first token (a durable session resumed part-way) has a gap it cannot fill: it sends none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.request.request import Request, TokenLogprob

# Rows of [rows, V] fp32 logits scored at once: a long chunk's logits are never whole in memory.
SLICE_ROWS = 1024


def scored_positions(req: Request, start: int, end: int) -> range:
    """The positions of a pass over ``req``'s tokens ``[start, end)`` whose logits score a prompt
    token not yet recorded; empty when the request asks for none or the pass begins past its
    recorded prefix (the positions between were computed elsewhere), or has sent them."""
    if req.params.prompt_logprobs is None or req.prompt_logprobs_sent:
        return range(0)
    first = len(req.prompt_scored)
    if start > first:
        return range(0)
    return range(first, min(end, len(req.prompt_ids) - 1))


Scoring = list[tuple[Request, range]]  # each request of a pass with its positions to score


def plan(
    reqs: list[Request], starts: list[int], ends: list[int], offsets: tuple[int, ...]
) -> tuple[Scoring, list[int]]:
    """For a prefill pass over each request's tokens ``[starts[i], ends[i])``, request ``i``'s
    from row ``offsets[i]`` of the pass on: (the requests with positions to score, and those
    positions; the rows of the pass that hold them, in the same order)."""
    scoring: Scoring = []
    rows: list[int] = []
    for r, a, e, at in zip(reqs, starts, ends, offsets, strict=True):
        positions = scored_positions(r, a, e)
        if positions:
            scoring.append((r, positions))
            rows.extend(range(at + positions.start - a, at + positions.stop - a))
    return scoring, rows


def score_pass(
    scoring: Scoring, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Records the scores of ``plan``'s positions, whose hidden states are ``hidden``'s rows
    [R, d_model] in order."""
    at = 0
    for r, positions in scoring:
        n = len(positions)
        targets = r.prompt_ids[positions.start + 1 : positions.stop + 1]
        top_n = r.params.prompt_logprobs
        assert top_n is not None
        record(r, positions, score(hidden[at : at + n], targets, top_n, logits_of))
        at += n


def score(
    hidden: torch.Tensor,
    targets: list[int],
    top_n: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    slice_rows: int = SLICE_ROWS,
) -> list[TokenLogprob]:
    """``hidden`` [R, d_model] at R positions, ``targets`` the R tokens that follow them:
    each target's log-probability under the raw distribution (``log_softmax`` of
    ``logits_of(hidden)`` [R, V] fp32, at most ``slice_rows`` rows at a time) and the top
    ``top_n`` alternatives, as ``sampling.token_logprob`` gives them for a sampled token."""
    out: list[TokenLogprob] = []
    device_targets = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for s in range(0, len(targets), slice_rows):
        lp = torch.log_softmax(logits_of(hidden[s : s + slice_rows]), dim=-1)  # [r, V] fp32
        chosen = lp.gather(1, device_targets[s : s + slice_rows, None])[:, 0].tolist()
        if top_n > 0:
            values, ids = torch.topk(lp, top_n, dim=-1)
            tops = [
                tuple(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        else:
            tops = [()] * len(chosen)
        del lp
        out.extend(
            TokenLogprob(t, v, top)
            for t, v, top in zip(targets[s : s + slice_rows], chosen, tops, strict=True)
        )
    return out


def record(req: Request, positions: range, scored: list[TokenLogprob]) -> None:
    """Appends the scores of ``positions`` (``scored_positions``'s, in order) to the request's."""
    assert positions.start == len(req.prompt_scored) and len(positions) == len(scored)
    req.prompt_scored.extend(scored)


def take(req: Request) -> tuple[TokenLogprob, ...]:
    """The request's prompt logprobs, the first time its whole prompt is scored, else ``()``:
    one entry per prompt token, the first a placeholder (logprob 0, no alternatives: nothing
    precedes it), as worker.proto's ``GenerateResponse.prompt_logprobs`` carries them."""
    n = len(req.prompt_ids)
    if (
        req.params.prompt_logprobs is None
        or req.prompt_logprobs_sent
        or req.resumed_tokens > 0
        or len(req.prompt_scored) != n - 1
    ):
        return ()
    out = (TokenLogprob(req.prompt_ids[0], 0.0), *req.prompt_scored)
    req.prompt_logprobs_sent, req.prompt_scored = True, []
    return out
