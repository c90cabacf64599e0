"""Rank 0's copies of the requests the other ranks of a data-parallel-attention group serve.

The gateway talks to rank 0 alone, so rank 0 keeps a *mirror* of each request another rank
serves: its prompt, sampling parameters, output tokens and text stream, filled in from that
rank's outputs (``Engine``, after every step). A mirror begins when rank 0 places a new request
on another rank, or at start-up for a durable session another rank resumed from the node's host
store (``Resumed``, gathered to rank 0 once every rank has adopted its own): the mirror then
starts with the outputs the session had, so a re-attaching client is caught up from it exactly
as from a session rank 0 resumed itself."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.tokenizer import Tokenizer
from services.worker.request.request import Request, SamplingParams, Status


@dataclass(frozen=True)
class Resumed:
    """A durable session a rank resumed at start-up, as rank 0 needs it to mirror it (the
    ranks share one node: their monotonic clocks agree)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() of its arrival
    first_token_time: float | None
    resumed_tokens: int

    @classmethod
    def of(cls, req: Request) -> Resumed:
        return cls(
            req.request_id, list(req.prompt_ids), list(req.output_ids), req.params, req.arrival,
            req.first_token_time, req.resumed_tokens,
        )  # fmt: skip


def mirror(
    tokenizer: Tokenizer,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    output_ids: list[int] | None = None,
) -> Request:
    """A running request's mirror, its text stream past ``output_ids`` (the tokens the owner
    has emitted so far)."""
    text = params.text_stream(tokenizer, prompt_ids)
    for token in output_ids or ():
        text.push(token)
    req = Request(request_id, list(prompt_ids), params, text, status=Status.RUNNING)
    req.output_ids = list(output_ids or ())
    return req


def mirror_resumed(tokenizer: Tokenizer, session: Resumed) -> Request:
    """The mirror of a session another rank resumed."""
    req = mirror(tokenizer, session.request_id, session.prompt_ids, session.params,
                 session.output_ids)  # fmt: skip
    req.arrival = session.arrival
    req.first_token_time = session.first_token_time
    req.resumed_tokens = session.resumed_tokens
    return req
