"""``/v1/chat/completions``: render the chat in the model's format and tokenize it, fan out
``n`` worker requests, and answer with one ``chat.completion`` or a stream of
``chat.completion.chunk``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.gateway.context import GatewayContext
from services.gateway.fanout import ChoiceStream, merge
from services.gateway.generation import GenerationInput
from services.gateway.preprocess import chat_prompt_ids, chat_sampling, resolve_max_tokens
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
    chat_logprobs,
    new_id,
    now,
)
from services.gateway.streaming import cancel_on_disconnect, sse_response

log = logging.getLogger(__name__)


async def create_chat_completion(
    req: ChatCompletionRequest, request: Request, ctx: GatewayContext
) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(req.model)
    limits = ctx.limits()
    prompt_ids = chat_prompt_ids(ctx.formatter, req)
    max_tokens = resolve_max_tokens(len(prompt_ids), req.requested_max_tokens(), limits)
    sampling = chat_sampling(req, max_tokens, limits)
    response_id = new_id("chatcmpl")
    inputs = [
        GenerationInput(f"{response_id}-{i}", tuple(prompt_ids), sampling.for_choice(i), model)
        for i in range(req.n)
    ]
    top = sampling.top_logprobs if sampling.want_logprobs else None
    if req.stream:
        streams = await cancel_on_disconnect(request, ctx.start(inputs, model, arrival))
        chunks = chat_chunks(
            response_id, model, streams, len(prompt_ids), top, include_usage=req.include_usage
        )
        return sse_response(chunks)
    # One wait for the first tokens and the rest alike (one disconnect watch, not two).
    results = await cancel_on_disconnect(request, ctx.complete(inputs, model, arrival))
    body = ChatCompletionResponse(
        id=response_id,
        created=now(),
        model=model,
        choices=[
            ChatChoice(
                index=r.index,
                message=ChatResponseMessage(content=r.text),
                logprobs=chat_logprobs(r.logprobs, top) if top is not None else None,
                finish_reason=r.finish_reason or "abort",
                stop_reason=r.stop_reason,
            )
            for r in results
        ],
        usage=Usage.of(len(prompt_ids), sum(r.completion_tokens for r in results)),
    )
    return JSONResponse(body.model_dump())


async def chat_chunks(
    response_id: str,
    model: str,
    streams: Sequence[ChoiceStream],
    prompt_tokens: int,
    top_logprobs: int | None,
    *,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The stream's chunks as JSON: each choice's role first, then its content deltas; the
    delta that ends a choice carries its ``finish_reason`` (null before). With
    ``include_usage`` every chunk has ``usage: null`` and a last chunk with no choices carries
    the totals."""
    created = now()
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice) -> str:
        c = ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice])
        return c.model_dump_json(exclude=exclude)

    for i in range(len(streams)):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    completion_tokens = [0] * len(streams)
    async for i, delta in merge(streams):
        completion_tokens[i] = max(completion_tokens[i], delta.completion_tokens)
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            continue  # a token that is not yet readable text (an incomplete UTF-8 sequence)
        yield chunk(
            ChatStreamChoice(
                index=i,
                delta=DeltaMessage(content=delta.text),
                logprobs=(
                    chat_logprobs(delta.logprobs, top_logprobs)
                    if top_logprobs is not None
                    else None
                ),
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
        )
    if include_usage:
        final = ChatCompletionChunk(
            id=response_id,
            created=created,
            model=model,
            choices=[],
            usage=Usage.of(prompt_tokens, sum(completion_tokens)),
        )
        yield final.model_dump_json()
