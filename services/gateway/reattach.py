"""Re-attaching a client's stream to a worker that died mid-generation.

A worker in a hierarchy mode keeps every session durable in the node's host store; when its
process dies, ``dhisparse up`` (or Kubernetes) restarts it under the same address and worker
id, and the new process resumes the sessions it finds there. The gateway keeps the client's
stream open meanwhile: it polls the worker until it is healthy again (or ``deadline_s``
passes), then calls ``Resume`` with the number of tokens the client already has and goes on
streaming from there — the client sees one uninterrupted stream. A successor that holds no
such session (NOT_FOUND: a peer took it over and handed it back to the store for want of room)
is asked to ``Adopt`` it from the store — from the worker that last held it (``TakeFrom``),
fenced off when its process is gone, when the successor's predecessor died adopting it before
the store moved it; NOT_FOUND again (the session was not durable, e.g. resident mode), a
refusal, or the deadline ends the stream with a 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio

from dhisparse.rpc import worker_pb2
from services.gateway import convert
from services.gateway.errors import APIError
from services.gateway.generation import GenerationDelta

log = logging.getLogger(__name__)

# How a stream looks when the worker process behind it died (connection reset, stream removed).
WORKER_GONE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
}


# How long the gateway asks a dead worker's address before judging it gone: a process that
# exited refuses the connection at once.
PROBE_TIMEOUT_S = 0.5

# The session is nowhere this worker can take it from (or the worker cannot adopt at all).
_NOT_THERE = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def unreachable(stub) -> bool:
    """Whether the worker behind ``stub`` refuses connections (its process is gone). One that
    answers, or hangs, may still write its sessions: it is never fenced off."""
    try:
        await stub.Health(worker_pb2.HealthRequest(), timeout=PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return e.code() == grpc.StatusCode.UNAVAILABLE
    return False


@dataclass(frozen=True)
class TakeFrom:
    """The worker a session was last known to be held by at the node's store: its worker id
    ``owner``, its ``generation`` there, and ``stub`` (its Worker stub: probed before the
    adoption, and fenced off when it refuses connections)."""

    owner: str
    generation: int
    stub: object


def _lost(address: str, request_id: str, why: str) -> APIError:
    return APIError(
        503,
        f"worker {address} failed mid-generation of {request_id} and the session could not "
        f"be resumed: {why}",
    )


async def wait_healthy(stub, address: str, request_id: str, deadline: float, poll_s: float) -> None:
    """Returns once the worker answers Health with ok; raises ``APIError`` 503 at ``deadline``
    (the event loop's clock)."""
    loop = asyncio.get_running_loop()
    last = "no answer"
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise _lost(address, request_id, f"the worker did not come back in time ({last})")
        try:
            health = await stub.Health(
                worker_pb2.HealthRequest(), timeout=max(0.05, min(1.0, left)), wait_for_ready=True
            )
            if health.ok:
                return
            last = f"unhealthy: {health.status}"
        except grpc.aio.AioRpcError as e:
            last = f"{e.code().name}: {e.details() or 'no details'}"
        await asyncio.sleep(min(poll_s, max(0.0, deadline - loop.time())))


async def reattach(
    stub,
    address: str,
    request_id: str,
    received: int,
    deadline_s: float,
    poll_s: float = 0.2,
    take_from: TakeFrom | None = None,
) -> AsyncIterator[GenerationDelta]:
    """The rest of ``request_id``'s deltas after its first ``received`` tokens, from the
    restarted worker at ``address`` (``stub``: its Worker stub). Survives further restarts
    within ``deadline_s`` of the call; raises ``APIError`` when the session is lost.
    ``take_from``: whom the session is adopted from when the successor holds none (None:
    whoever holds it, adoptable without fencing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    adopt = ""  # what Resume said when it found nothing: then take it from the store
    while True:
        await wait_healthy(stub, address, request_id, deadline, poll_s)
        if adopt:
            ask = worker_pb2.AdoptSessionRequest(request_id=request_id, tokens_received=received)
            if take_from is not None:
                ask.from_owner, ask.from_generation = take_from.owner, take_from.generation
                ask.fence = await unreachable(take_from.stub)
            call = stub.Adopt(ask)
        else:
            call = stub.Resume(
                worker_pb2.ResumeRequest(request_id=request_id, tokens_received=received)
            )
        try:
            async for resp in call:
                delta = convert.generation_delta(resp)
                received += len(delta.token_ids)
                yield delta
            return
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or e.code().name
            if code == grpc.StatusCode.NOT_FOUND and not adopt:
                adopt = details
                continue
            if code in _NOT_THERE:
                why = f"{adopt}; adopting it from the store: {details}" if adopt else details
                raise _lost(address, request_id, why) from e
            if code not in WORKER_GONE or loop.time() >= deadline:
                raise _lost(address, request_id, f"{code.name}: {details}") from e
            log.warning("re-attached stream of %s failed again (%s); waiting", request_id, code)
        finally:
            call.cancel()  # a no-op when it completed; otherwise the worker aborts the request
