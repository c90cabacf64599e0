"""Why a request cannot be set up in the KV state, beyond "not now": errors the engine turns
into a failed request with a status, rather than a wait."""

from __future__ import annotations


class HostStoreUnavailable(RuntimeError):
    """The node's host KV store did not answer (down, restarted, or refused this worker's
    generation): hierarchy admissions fail fast until it is back."""


def describe(e: BaseException) -> str:
    """A one-line account of a failed host-store call (gRPC errors by code and details)."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        c = code()
        return f"{getattr(c, 'name', c)}: {details() or 'no details'}"
    return str(e) or type(e).__name__
