"""``/v1/chat/completions``: render the chat in the model's format and tokenize it, fan out
``n`` worker requests, and answer with one ``chat.completion`` or a stream of
``chat.completion.chunk``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dhisparse.tokenizer import Tokenizer
from services.gateway.chat_reply import (
    ReplyFormat,
    finish_reason,
    message,
    reasoning_tokens,
)
from services.gateway.constraints import grammar_for, reasoning_open
from services.gateway.context import GatewayContext
from services.gateway.fanout import ChoiceStream, merge
from services.gateway.generation import GenerationInput
from services.gateway.preprocess import chat_prompt, chat_sampling, resolve_max_tokens
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
    cached_tokens,
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
    prompt = chat_prompt(ctx.formatter, req)
    prompt_ids = prompt.token_ids
    max_tokens = resolve_max_tokens(len(prompt_ids), req.requested_max_tokens(), limits)
    grammar = grammar_for(req, prompt.text, ctx.reply_style)
    sampling = chat_sampling(req, max_tokens, limits, grammar)
    fmt = ReplyFormat(
        style=ctx.reply_style,
        reasoning_open=reasoning_open(prompt.text, ctx.reply_style),
        tools=req.template_tools() if req.effective_tool_choice() != "none" else None,
    )
    if fmt.reads_markers:  # they may be special tokens: the text must keep them
        sampling = replace(sampling, skip_special_tokens=False)
    response_id = new_id("chatcmpl")
    inputs = [
        GenerationInput(f"{response_id}-{i}", tuple(prompt_ids), sampling.for_choice(i), model)
        for i in range(req.n)
    ]
    top = sampling.top_logprobs if sampling.want_logprobs else None
    if req.stream:
        streams = await cancel_on_disconnect(request, ctx.start(inputs, model, arrival))
        chunks = chat_chunks(
            response_id, model, streams, len(prompt_ids), top, fmt, ctx.tokenizer,
            include_usage=req.include_usage,
        )  # fmt: skip
        return sse_response(chunks)
    # One wait for the first tokens and the rest alike (one disconnect watch, not two).
    results = await cancel_on_disconnect(request, ctx.complete(inputs, model, arrival))
    replies = [fmt.whole(r.text) for r in results]
    body = ChatCompletionResponse(
        id=response_id,
        created=now(),
        model=model,
        choices=[
            ChatChoice(
                index=r.index,
                message=message(reply),
                logprobs=chat_logprobs(r.logprobs, top) if top is not None else None,
                finish_reason=finish_reason(r.finish_reason, bool(reply.tool_calls)),
                stop_reason=r.stop_reason,
            )
            for r, reply in zip(results, replies, strict=True)
        ],
        usage=Usage.of(
            len(prompt_ids),
            sum(r.completion_tokens for r in results),
            _reasoning_tokens(
                fmt,
                ctx.tokenizer,
                [
                    (r.token_ids, reply.reasoning_end)
                    for r, reply in zip(results, replies, strict=True)
                ],
            ),
            cached_tokens=cached_tokens([r.cached_prompt_tokens for r in results], req.n),
        ),
    )
    return JSONResponse(body.model_dump())


def _reasoning_tokens(
    fmt: ReplyFormat, tokenizer: Tokenizer, choices: Sequence[tuple[Sequence[int], int]]
) -> int | None:
    """The choices' reasoning tokens together, from each one's token ids and the character
    offset where its reasoning ended; None for a format that does not reason."""
    if fmt.style is None:
        return None
    return sum(reasoning_tokens(tokenizer, ids, end) for ids, end in choices)


async def chat_chunks(
    response_id: str,
    model: str,
    streams: Sequence[ChoiceStream],
    prompt_tokens: int,
    top_logprobs: int | None,
    fmt: ReplyFormat,
    tokenizer: Tokenizer,
    *,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The stream's chunks as JSON: each choice's role first, then its deltas (reasoning,
    content, tool calls as ``ReplyStream`` splits them); the chunk that ends a choice carries
    its ``finish_reason`` (null before). With ``include_usage`` every chunk has ``usage: null``
    and a last chunk with no choices carries the totals."""
    created = now()
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice) -> str:
        c = ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice])
        return c.model_dump_json(exclude=exclude)

    for i in range(len(streams)):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    completion_tokens = [0] * len(streams)
    cached = [0] * len(streams)
    replies = [fmt.stream() for _ in streams]
    token_ids: list[list[int]] = [[] for _ in streams]
    async for i, delta in merge(streams):
        completion_tokens[i] = max(completion_tokens[i], delta.completion_tokens)
        cached[i] = max(cached[i], delta.cached_prompt_tokens)
        token_ids[i].extend(delta.token_ids)
        last = delta.finish_reason is not None
        deltas = replies[i].feed(delta.text, last=last)
        logprobs = (
            chat_logprobs(delta.logprobs, top_logprobs)
            if top_logprobs is not None and delta.logprobs
            else None
        )
        if not deltas and (last or logprobs is not None):
            deltas = [DeltaMessage(content="")]
        for j, d in enumerate(deltas):
            final = last and j == len(deltas) - 1
            yield chunk(
                ChatStreamChoice(
                    index=i,
                    delta=d,
                    logprobs=logprobs if j == 0 else None,
                    finish_reason=(
                        finish_reason(delta.finish_reason, replies[i].called) if final else None
                    ),
                    stop_reason=delta.stop_reason if final else None,
                )
            )
    if include_usage:
        ends = [(ids, r.reasoning_end) for ids, r in zip(token_ids, replies, strict=True)]
        final = ChatCompletionChunk(
            id=response_id,
            created=created,
            model=model,
            choices=[],
            usage=Usage.of(
                prompt_tokens,
                sum(completion_tokens),
                _reasoning_tokens(fmt, tokenizer, ends),
                cached_tokens=cached_tokens(cached, len(streams)),
            ),
        )
        yield final.model_dump_json()
