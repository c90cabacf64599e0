"""Response bodies and stream chunks in the OpenAI shape (with vLLM's ``stop_reason`` extra),
and the conversion of worker logprobs into the two OpenAI logprob formats."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer
from typing_extensions import TypedDict

from services.gateway.generation import TokenLogprob


def new_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` ids, unique per HTTP request."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(BaseModel):
    # prompt tokens the worker imported from a cached prefix instead of computing them
    cached_tokens: int = 0


def cached_tokens(per_choice: Sequence[int], n: int) -> int:
    """The cached prompt tokens of a response whose prompts each ran as ``n`` choices (choice
    ``p * n + i`` is prompt ``p``'s ``i``-th, each reporting its own): per prompt, the tokens
    every one of its choices found cached, summed over the prompts (``prompt_tokens`` counts
    each prompt once)."""
    return sum(min(per_choice[i : i + n]) for i in range(0, len(per_choice), max(1, n)))


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # chat replies of a reasoning format: how many completion tokens the reasoning took
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        reasoning_tokens: int | None = None,
        *,
        cached_tokens: int = 0,
    ) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=(
                None
                if reasoning_tokens is None
                else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            ),
        )

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("completion_tokens_details") is None:
            out.pop("completion_tokens_details", None)
        return out


# --- chat -------------------------------------------------------------------------------------
class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    """A tool call's function: whole in a message; in a stream delta, the name comes once and
    ``arguments`` in fragments whose concatenation is the JSON text."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    """One stream delta of a tool call: ``id``, ``type`` and the name on its first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # SGLang's and DeepSeek's name
    reasoning: str | None = None  # vLLM's name, the same text
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # content stays (null beside tool calls, as OpenAI sends it); the rest only when set
        out = handler(self)
        return {k: v for k, v in out.items() if v is not None or k == "content"}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaDict(TypedDict, total=False):
    """A serialized ``DeltaMessage`` (what its JSON Schema describes)."""

    role: Literal["assistant"]
    content: str
    reasoning_content: str
    reasoning: str
    tool_calls: list[dict[str, Any]]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> DeltaDict:
        # OpenAI sends only what changed: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


def chat_logprobs(logprobs: Iterable[TokenLogprob], top: int) -> ChatLogprobs:
    """OpenAI chat format: per token its logprob, UTF-8 bytes and ``top`` alternatives."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.token.encode("utf-8")),
                top_logprobs=[
                    ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                    for t in lp.top[:top]
                ],
            )
            for lp in logprobs
        ]
    )


# --- completions ------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs``. ``rank``: 1 for the most likely token; null for
    a prompt token outside the alternatives the worker sent (its rank is not computed)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    # vLLM's extra (``prompt_logprobs``): null first, then per prompt token id -> its entry
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    # vLLM's extras (``return_token_ids``): in a response only when asked for
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


# what a completion's body leaves out unless ``return_token_ids`` asks for it
TOKEN_IDS = {"choices": {"__all__": {"prompt_token_ids", "token_ids"}}}


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def completion_logprobs(
    logprobs: Iterable[TokenLogprob], top: int, text_offset: int = 0
) -> CompletionLogprobs:
    """OpenAI legacy format. ``text_offset`` is where the first token starts in the choice's
    text (for stream chunks after the first). As in vLLM, ``top_logprobs`` holds the sampled
    token too."""
    out = CompletionLogprobs()
    offset = text_offset
    for lp in logprobs:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.text_offset.append(offset)
        offset += len(lp.token)
        alternatives = {t.token: t.logprob for t in lp.top[:top]}
        alternatives.setdefault(lp.token, lp.logprob)
        out.top_logprobs.append(alternatives if top > 0 else None)
    return out


# --- models -----------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dhisparse"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- health -----------------------------------------------------------------------------------
class HealthResponse(BaseModel):
    """``/health``: ``ok`` (200) while a worker is healthy, else ``unavailable`` (503)."""

    status: Literal["ok", "unavailable"]
    workers: dict[str, Literal["healthy", "unhealthy"]]
