"""The gateway's ``/openapi.json``: what the routes accept and answer, limits of the running
server included, so that a client (or a fuzzer) generating from it sends only what is accepted.

FastAPI's own document is edited in three ways: every route documents its responses (the
OpenAI error body on each 4xx/5xx it can give, the event stream of ``stream: true``), FastAPI's
422 goes (validation errors are 400 here), and the limits known only at run time — the served
model's name and context length, the vocabulary, ``max_n``, ``max_logprobs``, the roles the
chat template renders — are placed into the request schemas (``specialize``). The rules no JSON
Schema can state are in each operation's description (``CHAT_RULES``, ``COMPLETION_RULES``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from services.gateway.errors import ERROR_TYPES, REASON_HEADER, ErrorResponse
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import ChatCompletionChunk, CompletionResponse
from services.gateway.schema_edit import JsonSchema, constrain, constrain_items, members

# What each error status means here; every one has the ``ErrorResponse`` body.
_ERROR_MEANINGS: dict[int, str] = {
    400: "The body breaks the schema or one of the rules in the operation's description.",
    401: "The gateway has an API key and the request lacks it ('Authorization: Bearer <key>').",
    404: "The model asked for is not the one served.",
    413: "The body is larger than the gateway's limit (max_request_bytes).",
    429: "Admission's queue for the model is full, or would not reach the request within its "
    "deadline; retry after Retry-After seconds.",
    500: "A fault of the server or a worker.",
    503: "No worker can take the request now; retry after Retry-After seconds.",
}
_RETRY_HEADERS: JsonSchema = {
    "Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}},
    REASON_HEADER: {
        "description": "Why admission turned the request away",
        "schema": {
            "type": "string",
            "enum": [
                "queue-full",
                "expected-wait",
                "no-capacity",
                "deadline",
                "too-large",
                "no-worker",
                "ledger-unavailable",
            ],
        },
    },
}
_GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503)

CHAT_RULES = """Rules beyond the schema (each a 400 with the OpenAI error body):
- `min_tokens` must not exceed `max_completion_tokens` (else `max_tokens`) when one is given.
- The rendered prompt's tokens plus `max_completion_tokens` (else `max_tokens`) must fit the
  model's context (vLLM's wording: "This model's maximum context length is ..."); without a
  budget the prompt alone must leave room for one token.
- A prompt longer than a worker's KV capacity is refused by the worker, or by admission when it
  fits no worker (`x-dhisparse-reason: too-large`).
- A model's own chat template may refuse an order of roles (the built-in one renders any).
- `chat_template_kwargs` are the chat template's arguments (`enable_thinking`,
  `reasoning_effort`; `thinking` for DeepSeek-V3.2's and V4's formats, the efforts a V4 release names itself:
  "max", and 0731's "low"; for DeepSeek-V4.1 "max" or an integer budget from 1 to 100),
  which it may refuse; `documents`
  among them must be a list of objects; `messages`, `add_generation_prompt` and `tools` there
  are ignored (`tools` and `reasoning_effort` are fields of their own).
- Tool names are unique; a named `tool_choice` must name one of `tools`.
- An assistant message's tool call `arguments` are a JSON object as text; a `tool` message's
  `tool_call_id` must be the id of a tool call of an earlier assistant message.
- `logit_bias` token ids must be in the model's vocabulary.
- Tools (unless `tool_choice` is "none") need a model with a tool-call format; a JSON
  `response_format` beside tools needs `tool_choice` "none", "required" or a named function;
  a schema the grammar engine cannot compile is refused (param `tools` or `response_format`).

Load and availability give 429/503 with Retry-After; an error after a stream has started comes
as one `data:` event holding the error body, then `[DONE]`."""

COMPLETION_RULES = """Rules beyond the schema (each a 400 with the OpenAI error body):
- `min_tokens` must not exceed `max_tokens` when that is given.
- `max_tokens` may be 0 (the prompt alone) only with `echo`.
- The prompts of a batch times `n` must not exceed the server's largest `n`.
- Each prompt's tokens plus `max_tokens` must fit the model's context (vLLM's wording: "This
  model's maximum context length is ..."); without `max_tokens` the prompt alone must leave room
  for one token. A text prompt that tokenizes to nothing is refused.
- A prompt longer than a worker's KV capacity is refused by the worker, or by admission when it
  fits no worker (`x-dhisparse-reason: too-large`).

Load and availability give 429/503 with Retry-After; an error after a stream has started comes
as one `data:` event holding the error body, then `[DONE]`."""


@dataclass(frozen=True)
class SchemaLimits:
    """What the request schemas are specialised with; None: not known yet (no worker answered)."""

    max_n: int
    max_logprobs: int
    vocab_size: int
    roles: tuple[str, ...]
    empty_text_prompt_ok: bool  # the tokenizer adds special tokens (a BOS): "" is a prompt
    max_request_bytes: int
    api_key: bool
    served_model: str | None = None
    max_model_len: int | None = None
    tool_calls: bool = True  # the model has a tool-call format (else tools need "none")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` entries of a route for these error statuses."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {
            "model": ErrorResponse,
            "description": f"{ERROR_TYPES[status]}: {_ERROR_MEANINGS[status]}",
        }
        if status in (429, 503):
            entry["headers"] = _RETRY_HEADERS
        elif status == 400:  # too-large: a request no worker can hold
            entry["headers"] = {REASON_HEADER: _RETRY_HEADERS[REASON_HEADER]}
        out[status] = entry
    return out


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, Any]:
    """A generation route's responses: ``body`` as JSON, or with ``stream: true`` an event
    stream whose events each hold a ``chunk``, an error body or ``[DONE]``."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": f"#/components/schemas/{chunk.__name__}"},
                                {"$ref": f"#/components/schemas/{ErrorResponse.__name__}"},
                            ]
                        },
                    },
                ]
            }
        },
    }
    ok = {
        "model": body,
        "description": "The completion, or with stream: true its server-sent events",
        "content": {"text/event-stream": {"schema": event}},
    }
    return {200: ok, **error_responses(*_GENERATION_ERRORS)}


def _put_components(
    schema: JsonSchema, models: list[tuple[type[BaseModel], JsonSchemaMode]], *, replace: bool
) -> None:
    """pydantic's schemas of ``models`` (and what they refer to) as components: ones that no
    route names (``replace=False``: for event streams), or in place of FastAPI's, which has
    turned every bound into a float (``replace=True``: a seed's int64 bound must stay exact)."""
    _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, sub in defs.get("$defs", {}).items():
        if replace:
            components[name] = sub
        else:
            components.setdefault(name, sub)


def _drop_422(schema: JsonSchema) -> None:
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _best_of_clauses(max_n: int) -> list[JsonSchema]:
    """``best_of`` equal to ``n`` as one ``if``/``then`` per value of ``n`` (JSON Schema cannot
    compare two fields)."""
    clauses: list[JsonSchema] = [
        {
            "if": {"not": {"required": ["n"]}},
            "then": {"properties": {"best_of": {"enum": [1, None]}}},
        }
    ]
    for n in range(1, max_n + 1):
        clauses.append(
            {
                "if": {"properties": {"n": {"const": n}}, "required": ["n"]},
                "then": {"properties": {"best_of": {"enum": [n, None]}}},
            }
        )
    return clauses


def _limit_generation(props: JsonSchema, limits: SchemaLimits) -> None:
    """The fields both generation requests share."""
    if limits.served_model is not None:
        constrain(props["model"], "string", enum=[limits.served_model])
    constrain(props["n"], "integer", maximum=limits.max_n)
    if limits.max_model_len is not None:
        for budget in ("max_tokens", "max_completion_tokens"):
            if budget in props:  # the shortest prompt is one token
                constrain(props[budget], "integer", maximum=limits.max_model_len - 1)
    constrain(props["top_k"], "integer", maximum=limits.vocab_size)
    constrain_items(props["stop_token_ids"], "integer", maximum=limits.vocab_size - 1)


def _limit_completion(request: JsonSchema, limits: SchemaLimits) -> None:
    props = request["properties"]
    constrain(props["logprobs"], "integer", maximum=min(20, limits.max_logprobs))
    constrain(props["prompt_logprobs"], "integer", maximum=min(20, limits.max_logprobs))
    constrain(props["best_of"], "integer", maximum=limits.max_n)
    request.setdefault("allOf", []).extend(_best_of_clauses(limits.max_n))
    prompt = props["prompt"]
    constrain_items(prompt, "integer", maximum=limits.vocab_size - 1)
    for part in members(prompt):
        if part["type"] == "array" and part["items"]["type"] in ("string", "array"):
            part["maxItems"] = limits.max_n  # a batch: each prompt has n >= 1 choices
    if not limits.empty_text_prompt_ok:
        constrain(prompt, "string", minLength=1)
        constrain_items(prompt, "string", minLength=1)


def _limit_access(schema: JsonSchema, limits: SchemaLimits) -> None:
    """The body limit in the 413s; the API key as a security scheme of ``/v1``."""
    for item in schema["paths"].values():
        for operation in item.values():
            too_large = operation.get("responses", {}).get("413")
            if too_large is not None:
                too_large["description"] = (
                    f"{ERROR_TYPES[413]}: The body is larger than {limits.max_request_bytes} bytes."
                )
    if limits.api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema["paths"].items():
            if path.startswith("/v1"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]


# A model without a tool-call format takes tools only under tool_choice "none".
_NO_TOOL_CALLS: JsonSchema = {
    "if": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
    "then": {"properties": {"tool_choice": {"const": "none"}}, "required": ["tool_choice"]},
}


def specialize(base: JsonSchema, limits: SchemaLimits) -> JsonSchema:
    """``base`` with the running server's limits placed into it."""
    schema = copy.deepcopy(base)
    components = schema["components"]["schemas"]
    chat, completion = components["ChatCompletionRequest"], components["CompletionRequest"]
    for request in (chat, completion):
        _limit_generation(request["properties"], limits)
    top_logprobs = chat["properties"]["top_logprobs"]
    constrain(top_logprobs, "integer", maximum=min(20, limits.max_logprobs))
    if limits.roles:  # none: the chat route refuses every chat (the model has no template)
        components["ChatMessage"]["properties"]["role"]["enum"] = list(limits.roles)
    if not limits.tool_calls:
        chat.setdefault("allOf", []).append(_NO_TOOL_CALLS)
    _limit_completion(completion, limits)
    _limit_access(schema, limits)
    return schema


def install_openapi(app: FastAPI, limits: Callable[[], SchemaLimits]) -> None:
    """Serves ``specialize``'s document; it is rebuilt when the limits change (once the first
    worker has told its context length)."""
    cache: dict[SchemaLimits, JsonSchema] = {}
    base: list[JsonSchema] = []

    def openapi() -> JsonSchema:
        if not base:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _drop_422(doc)
            requests: list[tuple[type[BaseModel], JsonSchemaMode]] = [
                (ChatCompletionRequest, "validation"),
                (CompletionRequest, "validation"),
            ]
            _put_components(doc, requests, replace=True)
            events = [ChatCompletionChunk, CompletionResponse, ErrorResponse]
            _put_components(doc, [(m, "serialization") for m in events], replace=False)
            base.append(doc)
        now = limits()
        if now not in cache:
            cache.clear()
            cache[now] = specialize(base[0], now)
        return cache[now]

    app.openapi = openapi  # type: ignore[method-assign]
