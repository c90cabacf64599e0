"""Server-sent events and client disconnects.

Frames are ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. An error after the
stream has started cannot change the status any more, so it goes out as a ``data:`` frame
holding the OpenAI error body, followed by ``[DONE]`` (as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from services.gateway.errors import APIError

log = logging.getLogger(__name__)

T = TypeVar("T")

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_frame(payload: BaseModel | dict[str, Any] | str) -> bytes:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif not isinstance(payload, str):
        payload = json.dumps(payload, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def sse_frames(events: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    """Frames ``events``, then ``[DONE]``. Errors become an error frame; a client disconnect
    (cancellation) propagates so that the generation behind ``events`` is cancelled."""
    try:
        async for event in events:
            yield data_frame(event)
    except APIError as e:
        yield data_frame(e.body())
    except Exception as e:
        log.exception("stream failed")
        yield data_frame(APIError(500, f"Internal server error: {type(e).__name__}").body())
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
    yield DONE_FRAME


def sse_response(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    return StreamingResponse(
        sse_frames(events), media_type="text/event-stream", headers=SSE_HEADERS
    )


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by now, so the only message left to receive is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``, cancelling it if the client disconnects first (then raises
    ``ClientDisconnected``). Starlette cancels a *streaming* response on disconnect by itself;
    this covers the time before one exists and non-streaming responses."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    return task.result()
