"""Argument checks shared by the store's operations: what a malformed call is refused with."""

from __future__ import annotations

from services.kv_host_store.errors import InvalidArgument

MAX_ID_LEN = 256  # ids are uuids or similar; a bound keeps a buggy caller from bloating memory
INT32 = (-(2**31), 2**31 - 1)  # the proto's source field


def check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string")
    if len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{name} is longer than {MAX_ID_LEN} characters")
    return value


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise InvalidArgument(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidArgument(f"{name} must be <= {hi}, got {value}")
    return value
