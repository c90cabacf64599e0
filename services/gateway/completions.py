"""``/v1/completions``: tokenize each prompt of the batch, fan out ``n`` worker requests per
prompt (choice index = prompt index * n + i, as OpenAI numbers them), and answer with one
``text_completion`` or a stream of them; with ``echo`` each choice begins with its prompt
(``echo``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.gateway.context import GatewayContext
from services.gateway.echo import PromptEcho, echo_text
from services.gateway.errors import bad_request
from services.gateway.fanout import ChoiceStream, merge
from services.gateway.generation import GenerationInput
from services.gateway.preprocess import (
    completion_prompt_ids,
    completion_sampling,
    resolve_max_tokens,
)
from services.gateway.protocol import CompletionRequest
from services.gateway.responses import (
    TOKEN_IDS,
    CompletionChoice,
    CompletionResponse,
    Usage,
    cached_tokens,
    completion_logprobs,
    new_id,
    now,
)
from services.gateway.streaming import cancel_on_disconnect, sse_response


async def create_completion(
    req: CompletionRequest, request: Request, ctx: GatewayContext
) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(req.model)
    limits = ctx.limits()
    prompts = req.prompts()
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompts) * req.n > limits.max_n:
        raise bad_request(
            f"a batch of {len(prompts)} prompts with n={req.n} asks for more than "
            f"{limits.max_n} choices",
            "prompt",
        )
    response_id = new_id("cmpl")
    inputs: list[GenerationInput] = []
    echoes: list[str] = []  # by choice: the prompt it echoes
    prompt_ids: list[tuple[int, ...]] = []  # by choice: its prompt's ids
    prompt_tokens = 0
    for p in prompts:
        ids = completion_prompt_ids(ctx.tokenizer, p, limits.vocab_size)
        prompt_tokens += len(ids)
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, limits)
        sampling = completion_sampling(req, max_tokens, limits)
        if req.echo:
            echoes += [echo_text(ctx.tokenizer, p, ids)] * req.n
        prompt_ids += [tuple(ids)] * req.n
        for i in range(req.n):
            inputs.append(
                GenerationInput(
                    f"{response_id}-{len(inputs)}", tuple(ids), sampling.for_choice(i), model
                )
            )
    prompt = PromptEcho(tuple(echoes) if req.echo else None, req.logprobs, req.prompt_logprobs)
    if req.stream:
        streams = await cancel_on_disconnect(request, ctx.start(inputs, model, arrival))
        chunks = completion_chunks(
            response_id, model, streams, prompt_tokens, prompt, req.n,
            include_usage=req.include_usage,
            prompt_ids=prompt_ids if req.return_token_ids else None,
        )  # fmt: skip
        return sse_response(chunks)
    # One wait for the first tokens and the rest alike (one disconnect watch, not two).
    results = await cancel_on_disconnect(request, ctx.complete(inputs, model, arrival))
    choices = []
    for r in results:
        text, logprobs, scored = prompt.begin(r.index, r.text, r.prompt_logprobs, r.logprobs)
        choices.append(
            CompletionChoice(
                index=r.index,
                text=text,
                logprobs=logprobs,
                finish_reason=r.finish_reason or "abort",
                stop_reason=r.stop_reason,
                prompt_logprobs=scored,
                prompt_token_ids=list(prompt_ids[r.index]),
                token_ids=r.token_ids,
            )
        )
    body = CompletionResponse(
        id=response_id,
        created=now(),
        model=model,
        choices=choices,
        usage=Usage.of(
            prompt_tokens,
            sum(r.completion_tokens for r in results),
            cached_tokens=cached_tokens([r.cached_prompt_tokens for r in results], req.n),
        ),
    )
    return JSONResponse(body.model_dump(exclude=None if req.return_token_ids else TOKEN_IDS))


async def completion_chunks(
    response_id: str,
    model: str,
    streams: Sequence[ChoiceStream],
    prompt_tokens: int,
    prompt: PromptEcho,
    n: int,
    *,
    include_usage: bool,
    prompt_ids: Sequence[tuple[int, ...]] | None = None,
) -> AsyncIterator[str]:
    """Text deltas per choice; the one that ends a choice carries its ``finish_reason``. A
    choice's first chunk begins with its prompt when ``prompt`` echoes it (its text, and its
    tokens' logprobs) and carries vLLM's ``prompt_logprobs`` when asked. With
    ``include_usage`` a last chunk with no choices carries the totals (each prompt ran as ``n``
    choices). With ``prompt_ids`` (by choice: ``return_token_ids``) every token comes in a
    chunk with its id, readable text or not, and a choice's first chunk carries its prompt's
    ids."""
    created = now()
    exclude: dict = {} if include_usage else {"usage": True}
    if prompt_ids is None:
        exclude |= TOKEN_IDS
    completion_tokens = [0] * len(streams)
    cached = [0] * len(streams)
    text_len = [0] * len(streams)  # for the logprobs' text_offset
    opening = [prompt.opens] * len(streams)  # the choice's next chunk carries its prompt
    first = [True] * len(streams)  # the choice's next chunk is its first
    async for i, delta in merge(streams):
        completion_tokens[i] = max(completion_tokens[i], delta.completion_tokens)
        cached[i] = max(cached[i], delta.cached_prompt_tokens)
        text, logprobs, scored = delta.text, None, None
        if opening[i]:
            opening[i] = False
            text, logprobs, scored = prompt.begin(
                i, delta.text, delta.prompt_logprobs, delta.logprobs
            )
        elif (
            not delta.text
            and delta.finish_reason is None
            and not delta.logprobs
            and (prompt_ids is None or not delta.token_ids)
        ):
            continue  # a token that is not yet readable text
        elif prompt.top is not None:
            logprobs = completion_logprobs(delta.logprobs, prompt.top, text_len[i])
        text_len[i] += len(text)
        chunk = CompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    prompt_logprobs=scored,
                    prompt_token_ids=list(prompt_ids[i]) if prompt_ids and first[i] else None,
                    token_ids=list(delta.token_ids),
                )
            ],
        )
        first[i] = False
        yield chunk.model_dump_json(exclude=exclude or None)
    if include_usage:
        final = CompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=[],
            usage=Usage.of(
                prompt_tokens, sum(completion_tokens), cached_tokens=cached_tokens(cached, n)
            ),
        )
        yield final.model_dump_json()
