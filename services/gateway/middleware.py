"""ASGI middleware that answers before any endpoint runs: API-key auth (401) and the request
body limit (413). Plain ASGI rather than ``BaseHTTPMiddleware``, which would buffer streamed
responses and hide client disconnects from the endpoints."""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import APIError, error_body


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(error_body(err.status, err.message, param=err.param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*`` (as vLLM's ``--api-key``);
    ``/health`` and ``/metrics`` stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str, protected_prefix: str = "/v1") -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self.prefix = protected_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "OPTIONS":  # CORS preflight carries no credentials
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            err = APIError(
                401,
                "Invalid API key: send it as 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await _send_error(send, err)
            return
        await self.app(scope, receive, send)


def _too_large_message(limit: int) -> str:
    return f"Request body is larger than the limit of {limit} bytes"


class BodyTooLarge(HTTPException):
    """An ``HTTPException`` so that FastAPI's body reading passes it on unchanged (it turns
    other exceptions into a 400); the error handlers give it the OpenAI shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large_message(limit))


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: at once from ``Content-Length``, or while a chunked
    body is being read (the endpoint's body read then raises ``BodyTooLarge``, which FastAPI
    passes on to the error handlers)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, APIError(413, _too_large_message(self.max_bytes)))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
