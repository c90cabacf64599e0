"""OpenAI-shaped errors and the handlers that make every failure one of them.

The body is vLLM's nested form ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the HTTP status as an int. A client's mistake is always 4xx: malformed JSON and schema violations
are 400 (never FastAPI's 422), and only genuine server faults become 500.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.routing import AdmissionRejected

log = logging.getLogger(__name__)

# Why admission turned a request away (queue-full, no-capacity, deadline, too-large, no-worker,
# ledger-unavailable), as llm-d's x-llm-d-request-dropped-reason.
REASON_HEADER = "x-dhisparse-reason"

# Location parts pydantic adds for union members ("list[int]", "function-after[...]").
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[a-z-]+\[.*\])$")

# The ``type`` per status, named like the exceptions of the openai client (as vLLM does).
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error (``error_body``), for the OpenAPI schema."""

    error: ErrorDetail


class APIError(Exception):
    """An error that reaches the client as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or ERROR_TYPES.get(status, "APIError")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, error_type=self.error_type)


def error_body(
    status: int, message: str, *, param: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type or ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model")


def context_overflow(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> APIError:
    """vLLM's wording, which clients match on to trim their history."""
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens} tokens in the messages, Please reduce the length of "
            "the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    return APIError(400, message, param="messages")


def admission_error(e: AdmissionRejected) -> APIError:
    """429/503 with ``Retry-After`` and the reason header; 400 for a request too large for
    every worker (vLLM's context-length shape)."""
    headers = {REASON_HEADER: e.reason}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    param = "messages" if e.status == 400 else None
    return APIError(e.status, e.message, param=param, headers=headers)


def service_unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, headers=headers)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic/FastAPI error dicts."""
    parts: list[str] = []
    param: str | None = None
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            parts.append(f"Invalid JSON body: {ctx.get('error', e.get('msg', ''))}")
            continue
        # Union members add their type name to the location; drop it for readability.
        loc = [p for p in loc if not _UNION_TAG.match(p)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = str(e.get("msg", "invalid value"))
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "Invalid request", param


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return error_response(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    return error_response(bad_request(message, param))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = "Not Found: no such endpoint"
    return error_response(APIError(exc.status_code, detail, headers=exc.headers))


async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(APIError(500, f"Internal server error: {type(exc).__name__}"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
