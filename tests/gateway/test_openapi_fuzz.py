"""Bodies generated from the gateway's own ``/openapi.json`` (schemathesis), sent in-process to
the app wired to the real worker.

For every operation, schema-valid requests (positive mode) must be answered 200 — a 400 only
where the body breaks one of the rules the operation's description states beyond the schema,
and then with exactly the documented body — and schema-invalid ones (negative mode) must be
refused with a 4xx, unless what pydantic's lax mode reads from them (``0`` as ``false``) is
itself schema-valid. Never a 5xx, and every response conforms to the schema (schemathesis'
status-code, content-type, header and body checks; each event of a stream included).

The rules beyond the schema that remain, each a 400 with the OpenAI error body (``_broken_rule``
predicts them from the body alone):

- ``min_tokens`` greater than the completion budget (``max_completion_tokens``, else
  ``max_tokens``) — one field compared with another, which JSON Schema cannot state;
- ``/v1/completions``: the prompts of a batch times ``n`` past the server's ``max_n`` (a
  product of two fields);
- ``/v1/completions``: ``max_tokens`` 0 without ``echo`` (schemathesis generates no bodies
  from a schema clause stating it);
- the prompt's tokens plus the budget past the model's context (the prompt's length in tokens
  is known only after rendering and tokenizing);
- chat: ``chat_template_kwargs.documents`` that is not a list of objects (the built-in template
  refuses no other argument);
- chat: repeated tool names, a named ``tool_choice`` that names none of the tools, tool call
  ``arguments`` that are not a JSON object's text, a ``tool_call_id`` that answers no earlier
  call (``_broken_tool_rule``);
- ``logit_bias`` token ids past the vocabulary (a run-time limit in a key).

Rejections that depend on the server's state rather than the body (429/503 from admission, a
prompt past a worker's KV capacity, a body past ``max_request_bytes``) cannot occur here: one
client, a worker with the default KV pool, bodies of a few KiB. Budgets are cut to at most
``MAX_TOKENS`` (still schema-valid) so that each call is quick on the CPU.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from dhisparse.tokenizer import ByteTokenizer, render_chat
from services.gateway import GatewaySettings, create_app
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest

from .conftest import MODEL, WorkerProcess

MAX_TOKENS = 3
MAX_N = 8  # the server's largest n (its default is 16; see ``api``)
POSITIVE_EXAMPLES = 150
NEGATIVE_EXAMPLES = 75
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
TOKENIZER = ByteTokenizer()


@pytest.fixture(scope="module")
def api(worker: WorkerProcess) -> schemathesis.BaseSchema:
    """The schema as the app serves it once its worker has answered (schemathesis starts the
    app's lifespan, and with it the first poll of the worker, to fetch it)."""
    gateway = GatewaySettings(
        workers=[worker.address],
        model=MODEL,
        health_interval_s=2.0,
        default_max_tokens=MAX_TOKENS,
        # best_of equal to n is one if/then clause per n up to max_n; past some 17 clauses
        # beside the completions' properties schemathesis' generator gives up on the schema
        max_n=MAX_N,
    )
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(gateway))


def _limits(api: schemathesis.BaseSchema) -> dict[str, int]:
    """The run-time limits the served schema states (read back, not assumed)."""
    props = api.raw_schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    max_n = props["n"]["maximum"]
    max_tokens = next(p["maximum"] for p in props["max_tokens"]["anyOf"] if "maximum" in p)
    vocab_size = next(p["maximum"] for p in props["top_k"]["anyOf"] if "maximum" in p)
    return {"max_n": max_n, "max_model_len": max_tokens + 1, "vocab_size": vocab_size}


def _short_budget(body: Any) -> Any:
    """``body`` with every completion budget cut to at most ``MAX_TOKENS`` (a JSON integer may
    come as ``5.0``)."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and value > MAX_TOKENS
            ):
                body[field] = 1 + int(value) % MAX_TOKENS
    return body


def _chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = []
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        messages.append({"role": m["role"], "content": content or "", "name": m.get("name")})
    text = render_chat(
        TOKENIZER.chat_template,
        messages,
        add_generation_prompt=body.get("add_generation_prompt", True),
    )
    return len(TOKENIZER.encode(text))


def _completion_prompts(prompt: Any) -> list[Any]:
    """The batch, as the gateway reads it (a JSON integer may be written ``1.0``)."""
    if isinstance(prompt, str) or all(isinstance(t, int | float) for t in prompt):
        return [prompt]
    return list(prompt)


def _broken_tool_rule(body: dict[str, Any]) -> str | None:
    """The rule of tools and tool histories that a chat ``body`` breaks (the validators check
    the tools, then the messages one by one, then the history)."""
    names = [t["function"]["name"] for t in body.get("tools") or ()]
    if len(set(names)) < len(names):
        return "tool names must be unique"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        return "not a tool"
    for m in body["messages"]:
        for call in m.get("tool_calls") or ():
            arguments = call["function"].get("arguments", "")
            try:
                parsed = json.loads(arguments) if arguments else {}
            except ValueError:
                return "tool call arguments are not JSON"
            if not isinstance(parsed, dict):
                return "tool call arguments must be a JSON object"
    calls: set[str] = set()
    for m in body["messages"]:
        calls.update(call["id"] for call in m.get("tool_calls") or ())
        if m["role"] == "tool" and m.get("tool_call_id") not in calls:
            return "answers no tool call"
    fmt = (body.get("response_format") or {}).get("type")
    if (
        names
        and (body.get("tool_choice") or "auto") == "auto"
        and fmt in ("json_object", "json_schema")
    ):
        return "a JSON response_format beside tools"
    return None


def _broken_rule(path: str, body: dict[str, Any], limits: dict[str, int]) -> str | None:
    """The rule beyond the schema that ``body`` breaks, as a fragment of the error message the
    gateway documents for it; None when it breaks none."""
    if path == CHAT and (rule := _broken_tool_rule(body)) is not None:
        return rule
    budget = body.get("max_tokens")
    if path == CHAT:
        budget = body.get("max_completion_tokens") or budget
    if budget is not None and body.get("min_tokens", 0) > budget:
        return f"min_tokens ({int(body['min_tokens'])}) must be less than or equal to max_tokens"
    if path == COMPLETIONS and budget == 0 and not body.get("echo"):
        return "max_tokens may be 0 only with echo"
    documents = (body.get("chat_template_kwargs") or {}).get("documents")
    listed = isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    if path == CHAT and documents is not None and not listed:
        return "documents must be a list of objects"
    n = int(body.get("n", 1))
    if path == COMPLETIONS:
        prompts = _completion_prompts(body["prompt"])
        if len(prompts) * n > limits["max_n"]:
            return f"a batch of {len(prompts)} prompts with n={n} asks for more than"
        lengths = [
            len(TOKENIZER.encode(p, add_bos=True)) if isinstance(p, str) else len(p)
            for p in prompts
        ]
    else:
        lengths = [_chat_prompt_tokens(body)]
    room = limits["max_model_len"] - (budget or 1)
    if any(length > room for length in lengths):
        return f"This model's maximum context length is {limits['max_model_len']} tokens"
    if any(int(key) >= limits["vocab_size"] for key in body.get("logit_bias") or ()):
        return "logit_bias token id"
    if path == CHAT and body.get("min_tokens", 0) > 0 and _constrained(body):
        return "min_tokens cannot be combined with a grammar"  # the worker's check, the last
    return None


def _constrained(body: dict[str, Any]) -> bool:
    """Whether a chat ``body`` asks for a grammar (``constraints.grammar_for``): tools under a
    tool choice other than "none" (OpenAI's default: "auto" when tools are given), or a JSON
    response format."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    fmt = (body.get("response_format") or {}).get("type")
    return bool(tools and choice != "none") or fmt in ("json_object", "json_schema")


def _error(content: bytes) -> dict[str, Any]:
    body = json.loads(content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _validator(api: schemathesis.BaseSchema, path: str) -> jsonschema_rs.Validator:
    """The served schema of ``path``'s request body."""
    name = "ChatCompletionRequest" if path == CHAT else "CompletionRequest"
    root = {"$ref": f"#/components/schemas/{name}", "components": api.raw_schema["components"]}
    return jsonschema_rs.Draft202012Validator(root)


def _read_as_valid(api: schemathesis.BaseSchema, path: str, body: Any) -> bool:
    """Whether the gateway's reading of a schema-invalid ``body`` is schema-valid: pydantic's
    lax mode reads ``0`` as ``false``, ``"5"`` as ``5``; accepting those is reading them, not a
    rule the schema states and the server skips."""
    model = ChatCompletionRequest if path == CHAT else CompletionRequest
    try:
        read = model.model_validate(body).model_dump(mode="json", exclude_unset=True)
    except ValidationError:
        return False
    return _validator(api, path).is_valid(read)


def _fuzz(api: schemathesis.BaseSchema, method: str, path: str, mode: GenerationMode) -> Counter:
    """Runs the generated cases of one operation; returns how many got each status."""
    operation = api[path][method]
    limits = _limits(api)
    positive = mode is GenerationMode.POSITIVE
    cases = operation.as_strategy(generation_mode=mode)
    if positive:
        cases = cases.map(lambda case: setattr(case, "body", _short_budget(case.body)) or case)
    examples = POSITIVE_EXAMPLES if positive else NEGATIVE_EXAMPLES
    if method == "GET":
        examples = 3  # no parameters: every case is the same request
    statuses: Counter = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=cases)
    def check(case: schemathesis.Case) -> None:
        response = case.call()
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)
        if method == "GET":
            assert response.status_code == 200, response.content[:300]
        elif not positive:
            if response.status_code == 200:
                assert _read_as_valid(api, path, case.body), case.body
            else:
                assert 400 <= response.status_code < 500, response.content[:300]
                assert _error(response.content)["code"] == response.status_code
        elif (rule := _broken_rule(path, case.body, limits)) is None:
            assert response.status_code == 200, (case.body, response.content[:500])
        else:
            assert response.status_code == 400, (rule, case.body, response.content[:300])
            error = _error(response.content)
            assert error["type"] == "BadRequestError"
            assert rule in error["message"], (rule, error)

    check()
    return statuses


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_generation_bodies_from_the_schema(
    api: schemathesis.BaseSchema, path: str, mode: GenerationMode
) -> None:
    statuses = _fuzz(api, "POST", path, mode)
    total = sum(statuses.values())
    if mode is GenerationMode.POSITIVE:
        # Most bodies pass: the rules beyond the schema are the exception (a batch times n past
        # max_n is the most common one, and only completions have it).
        assert statuses[200] >= 0.6 * total, statuses
    else:
        assert statuses[400] >= 0.75 * total, statuses


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics"])
def test_get_routes_conform(api: schemathesis.BaseSchema, path: str) -> None:
    _fuzz(api, "GET", path, GenerationMode.POSITIVE)


@pytest.mark.parametrize(
    ("path", "body", "rule"),
    [
        (CHAT, {"min_tokens": 3, "max_tokens": 2}, "min_tokens (3) must be less than"),
        (CHAT, {"min_tokens": 3, "max_completion_tokens": 2, "max_tokens": 5}, "min_tokens (3)"),
        (COMPLETIONS, {"prompt": ["a"] * 5, "n": 2}, "a batch of 5 prompts with n=2"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}, "maximum context length"),
        (COMPLETIONS, {"prompt": "x" * 4090, "max_tokens": 10}, "maximum context length"),
    ],
)
def test_documented_rules_beyond_the_schema(
    api: schemathesis.BaseSchema, path: str, body: dict[str, Any], rule: str
) -> None:
    """Each rule of ``_broken_rule`` on a schema-valid body: the documented 400, predicted."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "a"}
    body = {**base, **body}
    _validator(api, path).validate(body)
    assert _broken_rule(path, body, _limits(api)) is not None
    operation = api[path]["POST"]
    case = operation.Case(body=body)
    response = case.call()
    case.validate_response(response, checks=CHECKS)
    assert response.status_code == 400
    error = _error(response.content)
    assert rule in error["message"], error


def test_schema_states_the_servers_limits(api: schemathesis.BaseSchema) -> None:
    """The run-time values placed into the schema are the worker's and the settings'."""
    schemas = api.raw_schema["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["anyOf"][0]["enum"] == [MODEL]
    vocab_size = TOKENIZER.vocab_size
    assert _limits(api) == {"max_n": MAX_N, "max_model_len": 4096, "vocab_size": vocab_size}
    assert chat["top_k"]["anyOf"][0]["maximum"] == vocab_size
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "user", "assistant"]
    seed = chat["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)  # exact, not floats
    responses = api.raw_schema["paths"][CHAT]["post"]["responses"]
    assert "422" not in responses
    assert {"200", "400", "404", "413", "429", "503"} <= set(responses)
    assert "text/event-stream" in responses["200"]["content"]
