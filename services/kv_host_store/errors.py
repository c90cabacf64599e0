"""What the host store refuses, as exceptions that mean the same thing in-process and over gRPC.

The server maps each to one gRPC status code and the client maps the code back (``convert``),
so a caller handles ``PermissionDenied`` whether it talks to a ``HostStore`` or to the service.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every refusal by the host store; the message is meant for people."""


class InvalidArgument(StoreError, ValueError):
    """An argument is malformed or out of range (gRPC INVALID_ARGUMENT)."""


class NotFound(StoreError, LookupError):
    """No such region, or no regions for that request (gRPC NOT_FOUND)."""


class PermissionDenied(StoreError, PermissionError):
    """The caller is not the owner of the request it names (gRPC PERMISSION_DENIED)."""


class FailedPrecondition(StoreError):
    """The call does not fit the owner's state: a superseded or unregistered generation, or an
    adoption of a live owner's request (gRPC FAILED_PRECONDITION)."""


class CapacityExhausted(StoreError):
    """No contiguous free range fits the allocation (gRPC RESOURCE_EXHAUSTED).

    ``requested``/``largest_free`` are the aligned byte counts; they are ``None`` when the error
    was rebuilt by a client from a status message.
    """

    def __init__(
        self, message: str, *, requested: int | None = None, largest_free: int | None = None
    ) -> None:
        super().__init__(message)
        self.requested = requested
        self.largest_free = largest_free


class ArenaError(Exception):
    """The arena file cannot be created or mapped (wrong size, missing, held by another store)."""


class ArenaInUse(ArenaError):
    """Another live kv_host_store holds the arena file's lock."""
