"""Appending the tokens a pass chose to a request: its grammar advanced by each, logprobs
scored, and the stop conditions checked after each, up to the first that ends it."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from services.worker.request.grammar_state import GrammarState
from services.worker.request.request import FinishReason, Request, RequestError, TokenLogprob
from services.worker.request.sampling import sample_token, token_logprob


@dataclass(frozen=True)
class Emitted:
    """What one pass gave a request: the tokens appended, their text, their logprobs (when
    asked for), and how the request ended (None: it goes on)."""

    tokens: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish: FinishReason | None
    stop_reason: str | int | None


def append_tokens(
    req: Request,
    tokens: list[int],
    logits: torch.Tensor,
    eos_token_ids: Collection[int],
    max_model_len: int,
    taken: bool = False,
) -> Emitted:
    """Appends ``tokens`` (logits [len(tokens), V] they were chosen from) to ``req`` one by one,
    stopping at the first stop condition; a request's grammar, advanced by each, ends it once
    complete (``taken``: its grammar has already taken the first token,
    ``decoded_tokens``). A token its grammar rejects appends nothing and ends it
    with an internal error (its mask forbade the token: a sampling bug, not the client's
    fault)."""
    p = req.params
    if req.first_token_time is None:
        req.first_token_time = time.monotonic()
    emitted: list[int] = []
    lps: list[TokenLogprob] = []
    text = ""
    for i, token in enumerate(tokens):
        if req.grammar is not None and not (taken and i == 0) and not req.grammar.accept(token):
            req.error = RequestError("internal", f"token {token} breaks the grammar")
            return Emitted(tuple(emitted), text, tuple(lps), FinishReason.ABORT, None)
        if p.logprobs is not None:
            lps.append(token_logprob(logits[i], token, p.logprobs))
        req.output_ids.append(token)
        emitted.append(token)
        finish, stop_reason, delta = req.check_stop(token, eos_token_ids, max_model_len)
        if finish is None and req.grammar is not None and req.grammar.terminated:
            finish, delta = FinishReason.STOP, delta + req.text.finish()
        text += delta
        if finish is not None:
            return Emitted(tuple(emitted), text, tuple(lps), finish, stop_reason)
    return Emitted(tuple(emitted), text, tuple(lps), None, None)


def decoded_tokens(
    reqs: list[Request],
    logits: torch.Tensor,
    greedy: list[int],
    generator: Callable[[Request], torch.Generator | None],
) -> tuple[list[int], list[bool]]:
    """Each request's token of a pass that samples one per request (row j of ``logits`` is
    ``reqs[j]``'s; ``greedy``: the rows' argmax, read back), and whether its grammar has taken
    it: every constrained request's grammar advanced in one call
    (``GrammarState.accept_each``), before ``append_tokens`` appends the tokens."""
    tokens = [
        greedy[j] if r.params.greedy else sample_token(logits[j], r.params, generator(r))
        for j, r in enumerate(reqs)
    ]
    return tokens, GrammarState.accept_each([r.grammar for r in reqs], tokens)
