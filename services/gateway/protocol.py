"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, as vLLM and SGLang accept
them: OpenAI's fields plus the common extras (``top_k``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``).

Unknown fields are kept in ``model_extra`` (the app logs and ignores them). Range checks live
here so that a bad value is a 400 before anything is tokenized; checks that need the server's
configuration (``n`` against ``max_n``, the context length) live in ``preprocess``. Features the
engine lacks (penalties, logit bias, JSON mode, tools, echo) are refused with a 400 when a
request asks for them, rather than silently ignored.

The generated JSON Schema states every rule checked here: field constraints where pydantic
checks them, ``schema_edit.stating`` on a field whose rule a validator checks with a message of
its own, and ``if``/``then`` clauses (``_RULES``) for the rules that tie two fields together.
Rules JSON Schema cannot state (one field compared with another) are in the field's
description; ``openapi`` adds the limits known at run time.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.schema_edit import JsonSchema, stating

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
_MIN_TOKENS = (
    "At least this many tokens before a stop; must not exceed max_tokens "
    "(max_completion_tokens for chat) when that is given."
)
_NEUTRAL_ONLY = "Not supported by this server: accepted only at its neutral value."


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
    # Accepted only at their neutral values: the engine does not implement them.
    frequency_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        description=_NEUTRAL_ONLY,
        json_schema_extra=stating(number={"minimum": 0, "maximum": 0}),
    )
    presence_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        description=_NEUTRAL_ONLY,
        json_schema_extra=stating(number={"minimum": 0, "maximum": 0}),
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        description=_NEUTRAL_ONLY,
        json_schema_extra=stating(number={"minimum": 1, "maximum": 1}),
    )
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description=_NEUTRAL_ONLY,
        json_schema_extra=stating(number={"maximum": 0}),
    )
    logit_bias: dict[str, float] | None = Field(
        None, description=_NEUTRAL_ONLY, json_schema_extra=stating(object={"maxProperties": 0})
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


class TextContentPart(BaseModel):
    """The one kind of content part the model reads."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


# A union tagged by ``type``, of one member while the model reads text only.
ContentPart = Annotated[TextContentPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(description="One the model's chat template renders.")
    content: str | list[ContentPart] | None = Field(
        None, description="A string, or text parts (joined with newlines)."
    )
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Ahead of the union's own errors, which would list every member's complaint.
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(
                    f"content part type {part.get('type')!r} is not supported; this model "
                    "accepts text only"
                )
            if isinstance(part, dict) and part.get("text") is None:
                raise ValueError("a text part needs 'text'")
        return content


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(
        json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS]}
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
    tools: list[dict[str, Any]] | None = Field(
        None, description=_NEUTRAL_ONLY, json_schema_extra=stating(array={"maxItems": 0})
    )
    tool_choice: Any = Field(
        None, description=_NEUTRAL_ONLY, json_schema_extra={"enum": ["none", None]}
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description="Text only.",
        json_schema_extra=stating(object={"properties": {"type": {"const": "text"}}}),
    )

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
