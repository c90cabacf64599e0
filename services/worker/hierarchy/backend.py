"""The hierarchy's device-side operations by backend: the torch reference or the Triton
kernels, for the resolver, for the bulk row copies between the store and the host arena, and
for reserving the resolver's workspace before a CUDA-graph capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from services.worker.hierarchy.host_copy import backup_rows_ref, restore_rows_ref
from services.worker.hierarchy.resolver import resolve_ref
from services.worker.kv.config import HostReadOrder


def _no_workspace(
    device: torch.device, stream: int, tokens: int, k: int, reqs: int, entries: int
) -> None:
    """The torch reference allocates as it goes: nothing to reserve."""


class Backend(NamedTuple):
    resolve: Callable  # selection -> locations, queuing and copying misses
    backup: Callable  # device rows -> host arena
    restore: Callable  # host arena -> device rows
    reserve: Callable = _no_workspace  # the resolver's workspace at its largest, on a stream


def get_backend(name: str, order: HostReadOrder = HostReadOrder()) -> Backend:
    """The ``torch`` reference or the ``triton`` kernels; ``order``: how the Triton resolver
    issues a step's host reads (the reference copies as it resolves)."""
    if name == "torch":
        return Backend(resolve_ref, backup_rows_ref, restore_rows_ref)
    if name == "triton":
        from services.worker.hierarchy.host_copy import backup_rows_triton, restore_rows_triton
        from services.worker.hierarchy.resolver_triton import TritonResolver, reserve_workspace

        resolve = TritonResolver(order)
        return Backend(resolve, backup_rows_triton, restore_rows_triton, reserve_workspace)
    raise ValueError(f"unknown resolver {name!r}; choose torch or triton")
