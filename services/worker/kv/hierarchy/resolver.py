"""Picks the resolver implementation (the torch reference or the fused Triton kernels) and the
matching host-backup scatter."""

from __future__ import annotations

from services.worker.kv.hierarchy.backup import backup_rows_ref
from services.worker.kv.hierarchy.resolver_ref import resolve_ref


def get_resolver(name: str, device: str):
    if name == "torch":
        return resolve_ref
    if name == "triton":
        from services.worker.kv.hierarchy.resolver_triton import resolve_triton

        return resolve_triton
    raise ValueError(f"unknown resolver {name!r}; choose torch or triton")


def get_backup(name: str):
    """The backup scatter of the same backend as the resolver ``name``."""
    if name == "triton":
        from services.worker.kv.hierarchy.backup import backup_rows_triton

        return backup_rows_triton
    return backup_rows_ref


def get_restore(name: str):
    """The host-to-device row copy of the same backend as the resolver ``name``."""
    if name == "triton":
        from services.worker.kv.hierarchy.backup import restore_rows_triton

        return restore_rows_triton
    from services.worker.kv.hierarchy.backup import restore_rows_ref

    return restore_rows_ref
