"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, as vLLM and SGLang accept
them: OpenAI's fields plus the common extras (``top_k``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``).

Unknown fields are kept in ``model_extra`` (the app logs and ignores them). Range checks live
here so that a bad value is a 400 before anything is tokenized; checks that need the server's
configuration (``n`` against ``max_n``, the context length) live in ``sampling``/``prompts``.
Features the engine lacks (penalties, logit bias, JSON mode, tools, echo) are refused with a 400
when a request asks for them, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's own servers do
    # Accepted only at their neutral values: the engine does not implement them.
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _check_common(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if any(s == "" for s in self.stop_strings()):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise ValueError("stop_token_ids must be non-negative")
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to "
                f"max_tokens ({max_tokens})"
            )
        unsupported = {
            "frequency_penalty": self.frequency_penalty not in (None, 0),
            "presence_penalty": self.presence_penalty not in (None, 0),
            "repetition_penalty": self.repetition_penalty not in (None, 1),
            "min_p": self.min_p not in (None, 0),
            "logit_bias": bool(self.logit_bias),
        }
        for name, asked in unsupported.items():
            if asked:
                raise ValueError(f"{name} is not supported by this server")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are accepted by the renderer."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        # max_tokens is OpenAI's deprecated alias; the newer field wins (as in vLLM).
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using top_logprobs, logprobs must be set to true")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported by this server")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported by this server")
        return self


class CompletionRequest(_GenerationRequest):
    # A string, a list of token ids, or a batch of either; each prompt yields n choices.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
