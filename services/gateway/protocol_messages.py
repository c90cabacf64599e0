"""The messages of a chat request: OpenAI's roles and text content, an assistant turn's
``tool_calls`` and reasoning (``reasoning_content``, or vLLM's ``reasoning``), and ``tool``
results naming the call they answer (``tool_call_id``).

A message is checked alone here; ``answered_calls_precede`` checks the history as a whole (a
tool result must answer a call made before it). The generated JSON Schema states the rules
checked by validators (``_MESSAGE_RULES``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.schema_edit import JsonSchema

# JSON Schema clauses of ``ChatMessage._check_role_fields``.
_MESSAGE_RULES: list[JsonSchema] = [
    {
        "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
        "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
    },
    {
        "if": {"properties": {"role": {"not": {"const": "assistant"}}}, "required": ["role"]},
        "then": {"properties": {"tool_calls": {"type": "null"}}},
    },
]


class TextContentPart(BaseModel):
    """The one kind of content part the model reads."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


# A union tagged by ``type``, of one member while the model reads text only.
ContentPart = Annotated[TextContentPart, Field(discriminator="type")]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str = Field(
        "", description='A JSON object as text (OpenAI\'s form); "" stands for {}.'
    )

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        if not arguments:
            return arguments
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError(f"tool call arguments are not JSON: {arguments[:80]!r}") from None
        if not isinstance(value, dict):
            raise ValueError("tool call arguments must be a JSON object")
        return arguments

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a mapping, as chat templates iterate them (vLLM's
        ``_postprocess_messages``: empty arguments are ``{}``)."""
        return json.loads(self.arguments) if self.arguments else {}


class ToolCall(BaseModel):
    """A call the assistant made, as OpenAI returns it and clients send it back."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": _MESSAGE_RULES})

    role: str = Field(description="One the model's chat template renders.")
    content: str | list[ContentPart] | None = Field(
        None, description="A string, or text parts (joined with newlines)."
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="Assistant messages only.")
    tool_call_id: str | None = Field(
        None, description="Tool messages (required there): the id of an earlier tool call."
    )
    reasoning_content: str | None = Field(None, description="An assistant turn's reasoning.")
    reasoning: str | None = Field(None, description="vLLM's name for reasoning_content.")

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

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are for assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined with newlines (vLLM's "string"
        content format), None as empty."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def reasoning_text(self) -> str | None:
        """The assistant turn's reasoning from either field, ``reasoning_content`` first."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


def answered_calls_precede(messages: Sequence[ChatMessage]) -> None:
    """Every tool message answers a tool call of an earlier assistant message; a ValueError
    naming the first id that answers none."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls.update(call.id for call in m.tool_calls or ())
        elif m.role == "tool" and m.tool_call_id not in calls:
            raise ValueError(
                f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an "
                "earlier assistant message"
            )
