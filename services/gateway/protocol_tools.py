"""What a chat request asks of the model's output beyond text: OpenAI's function ``tools``, the
``tool_choice`` among them, and a ``response_format`` (JSON, or JSON following a schema).

The models check each value alone; the rules that tie ``tools`` and ``tool_choice`` together
live in ``ChatCompletionRequest``. Whether the model has a tool-call format at all, and whether
xgrammar compiles a schema, is ``constraints``' question (it needs the served model).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.schema_edit import JsonSchema

# OpenAI's rule for function and response-format names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

_OBJECT_SCHEMA: JsonSchema = {
    "type": "object",
    "properties": {"type": {"const": "object"}},
    "required": ["type"],
}


def _parameters_schema(schema: JsonSchema) -> None:
    """The parameters are a JSON Schema of an object (``_object_schema`` checks it)."""
    for part in schema.get("anyOf", [schema]):
        if part.get("type") == "object":
            part.update(_OBJECT_SCHEMA)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=NAME_PATTERN, description="Unique among the request's tools.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None,
        description='A JSON Schema with "type": "object"; omitted: no arguments.',
        json_schema_extra=_parameters_schema,
    )

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type") != "object":
            raise ValueError('parameters must be a JSON Schema with "type": "object"')
        return parameters


class ToolDefinition(BaseModel):
    """One of OpenAI's function tools."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as chat templates and xgrammar read it: OpenAI's JSON, unset fields left
        out (a template renders what it is given)."""
        return self.model_dump(exclude_none=True)


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": N}}``: call N, once."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # "schema" would shadow BaseModel.schema.
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="Omitted: any JSON object (as json_object)."
    )


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]
