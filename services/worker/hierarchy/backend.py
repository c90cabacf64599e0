"""Picks the hierarchy's device-side operations by backend: the torch reference or the Triton
kernels, for the resolver and for the bulk row copies between the store and the host arena."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from services.worker.hierarchy.host_copy import backup_rows_ref, restore_rows_ref
from services.worker.hierarchy.resolver import resolve_ref


class Backend(NamedTuple):
    resolve: Callable  # selection -> locations, queuing and copying misses
    backup: Callable  # device rows -> host arena
    restore: Callable  # host arena -> device rows


def get_backend(name: str) -> Backend:
    if name == "torch":
        return Backend(resolve_ref, backup_rows_ref, restore_rows_ref)
    if name == "triton":
        from services.worker.hierarchy.host_copy import backup_rows_triton, restore_rows_triton
        from services.worker.hierarchy.resolver_triton import resolve_triton

        return Backend(resolve_triton, backup_rows_triton, restore_rows_triton)
    raise ValueError(f"unknown resolver {name!r}; choose torch or triton")
