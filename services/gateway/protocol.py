"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, as vLLM and SGLang accept
them: OpenAI's fields plus the common extras (``top_k``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``).

Unknown fields are kept in ``model_extra`` (the app logs and ignores them). Range checks live
here so that a bad value is a 400 before anything is tokenized; checks that need the server's
configuration (``n`` against ``max_n``, the context length, token ids in the vocabulary) live in
``preprocess``; whether the model can follow ``tools`` or a ``response_format`` is
``constraints``' question. The messages are ``protocol_messages``' and the tools and formats
``protocol_tools``'. Features the server lacks (``suffix``, ``best_of`` other than ``n``) are
refused with a 400 when a request asks for them, rather than silently ignored.

The generated JSON Schema states every rule checked here: field constraints where pydantic
checks them, ``schema_edit.stating`` on a field whose rule a validator checks with a message of
its own, and ``if``/``then`` clauses (``_RULES``) for the rules that tie two fields together.
Rules JSON Schema cannot state (one field compared with another) are in the field's
description; ``openapi`` adds the limits known at run time.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.gateway.protocol_messages import ChatMessage, ToolCall, answered_calls_precede
from services.gateway.protocol_tools import (
    REASONING_EFFORTS,
    NamedToolChoice,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
)
from services.gateway.schema_edit import JsonSchema, stating

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ToolCall"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Temperatures travel to the workers as float32: a larger one would arrive as infinity.
FLOAT32_MAX = 3.4028234663852886e38
# Below this a temperature samples greedily (vLLM's _SAMPLING_EPS); dividing logits by a smaller
# one overflows float32.
GREEDY_BELOW = 1e-5

# JSON Schema clauses of the cross-field rules of ``_check_common`` and ``_check_chat``.
_STREAM_OPTIONS_NEED_STREAM: JsonSchema = {
    "if": {"properties": {"stream": {"const": False}}},
    "then": {"properties": {"stream_options": {"type": "null"}}},
}
_TOP_LOGPROBS_NEED_LOGPROBS: JsonSchema = {
    "if": {
        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
        "required": ["top_logprobs"],
    },
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}
_CHOICE_NEEDS_TOOLS: JsonSchema = {
    "if": {
        "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
        "required": ["tool_choice"],
    },
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
}
_MIN_TOKENS = (
    "At least this many tokens before a stop; must not exceed max_tokens "
    "(max_completion_tokens for chat) when that is given."
)
_NEUTRAL_ONLY = "Not supported by this server: accepted only at its neutral value."
# logit_bias: keys are token ids written as decimal strings, biases OpenAI's range.
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
LogitBias = Annotated[float, Field(ge=-100, le=100)]


def _stop_schema(schema: JsonSchema) -> None:
    stating(string={"minLength": 1}, array={"items": {"type": "string", "minLength": 1}})(schema)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="The served model's name; omitted: that one.")
    max_tokens: int | None = Field(
        None, ge=1, description="The prompt's tokens plus these must fit the model's context."
    )
    temperature: float | None = Field(
        None, ge=0, le=FLOAT32_MAX, description=f"0 (or below {GREEDY_BELOW}): greedy."
    )
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off.")
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = Field(None, json_schema_extra=_stop_schema)
    stop_token_ids: list[int] | None = Field(
        None, json_schema_extra=stating(array={"items": {"type": "integer", "minimum": 0}})
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description=_MIN_TOKENS)
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    user: str | None = None  # accepted and ignored, as OpenAI's own servers do
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="0: off.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="0: off.")
    repetition_penalty: float | None = Field(
        None, gt=0, le=FLOAT32_MAX, description="1: off; above 1 discourages repeats."
    )
    min_p: float | None = Field(None, ge=0, le=1, description="0: off.")
    logit_bias: dict[TokenIdKey, LogitBias] | None = Field(
        None,
        description="Token id (as a string, in the vocabulary) -> bias added to its logit.",
        json_schema_extra=stating(object={"additionalProperties": False}),
    )

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON's \ud800-\udfff escapes decode to lone surrogates, which no tokenizer, protobuf
        # string or JSON response can carry: refused here rather than failing later as a 500.
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError(
                "the body holds a lone surrogate (a \\ud800-\\udfff escape without its pair), "
                "which is not text"
            ) from None
        except (TypeError, ValueError):
            pass  # not plain JSON (built in Python): the fields' own checks apply
        return data

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
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS, _CHOICE_NEEDS_TOOLS]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        description="Replaces max_tokens; the prompt's tokens plus these must fit the context.",
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="1 or more: logprobs: true.")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Arguments of the model's chat template (vLLM's field)."
    )
    tools: list[ToolDefinition] | None = Field(
        None, description="Function tools; their names are unique."
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description=(
            'Omitted: "auto" with tools, else "none". A named function must be one of tools; '
            '"required" and a named function need tools.'
        ),
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call a turn.")
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = Field(  # type: ignore[valid-type]
        None, description="A chat template variable (chat_template_kwargs may override it)."
    )

    def requested_max_tokens(self) -> int | None:
        # max_tokens is OpenAI's deprecated alias; the newer field wins (as in vLLM).
        return self.max_completion_tokens or self.max_tokens

    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice`` with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat format reads them; None without any."""
        return [t.as_template_tool() for t in self.tools] if self.tools else None

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        answered_calls_precede(messages)
        return messages

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [t.function.name for t in tools or ()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(repeated)}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return choice  # tools failed their own checks
        names = [t.function.name for t in info.data["tools"] or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, not a tool")
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return choice

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using top_logprobs, logprobs must be set to true")
        return self


def _prompt_schema(schema: JsonSchema) -> None:
    """Token ids are non-negative and no list is empty (``completions`` and ``preprocess``
    refuse them)."""
    for part in schema["anyOf"]:
        if part["type"] == "array":
            part["minItems"] = 1
            items = part["items"]
            if items["type"] == "integer":
                items["minimum"] = 0
            elif items["type"] == "array":
                items["minItems"] = 1
                items["items"]["minimum"] = 0


class CompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM]})

    # A string, a list of token ids, or a batch of either; each prompt yields n choices.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A batch of prompts times n must not exceed the server's largest n.",
        json_schema_extra=_prompt_schema,
    )
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="The prompt's tokens plus these must fit the model's context; 0 (the prompt "
        "alone) only with echo.",
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(
        False, description="Each choice's text (and logprobs) begins with its prompt's."
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM's extra: each prompt token's logprob and this many alternatives, "
        "as choices[i].prompt_logprobs.",
    )
    return_token_ids: bool = Field(
        False,
        description="vLLM's extra: each choice carries its prompt's ids (prompt_token_ids) and "
        "its tokens' (token_ids); streamed, a choice's first chunk the prompt's and every chunk "
        "its new tokens', a token that is not yet readable text included.",
    )
    suffix: str | None = Field(
        None, description=_NEUTRAL_ONLY, json_schema_extra=stating(string={"maxLength": 0})
    )
    best_of: int | None = Field(None, ge=1, description="Only equal to n.")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens may be 0 only with echo")
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
