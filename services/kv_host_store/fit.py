"""Whether a host arena of a given capacity fits this machine: the arena is a file on a tmpfs
(``/dev/shm``), so it needs room on that filesystem and, as its rows are written, memory. A
store that starts with an arena that does not fit fails later, as a SIGBUS in a worker or an
out-of-memory kill; this check fails it at start, naming the setting to change."""

from __future__ import annotations

import os
from pathlib import Path

from services.kv_host_store.errors import ArenaError

# How the store's own CLI and `dhisparse up` name the arena's size.
CAPACITY_SETTING = (
    "DHISPARSE_KV_STORE_CAPACITY (kv-host-store --capacity; dhisparse up --kv-store-capacity)"
)


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where the kernel does not report it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def filesystem_free(directory: Path) -> int:
    """Bytes an unprivileged writer may still allocate on ``directory``'s filesystem."""
    vfs = os.statvfs(directory)
    return vfs.f_bavail * vfs.f_frsize


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def misfit(capacity: int, where: str, free: int, available: int | None, setting: str) -> str | None:
    """Why an arena of ``capacity`` bytes does not fit ``free`` bytes on the filesystem at
    ``where`` and ``available`` bytes of memory (None: unknown), naming ``setting``; None when
    it fits."""
    if capacity > free:
        return (
            f"host arena of {_gib(capacity)} ({capacity} bytes) does not fit in {where} "
            f"({_gib(free)} free): lower {setting}, or enlarge that filesystem"
        )
    if available is not None and capacity > available:
        return (
            f"host arena of {_gib(capacity)} ({capacity} bytes) does not fit in this "
            f"machine's available memory ({_gib(available)} MemAvailable): lower {setting}"
        )
    return None


def check_arena_fits(path: str | Path, capacity: int, setting: str = CAPACITY_SETTING) -> None:
    """Raises ``ArenaError`` naming ``setting`` unless an arena of ``capacity`` bytes at
    ``path`` fits both the free space of its filesystem and the memory available. A file
    already at ``path`` (a stale arena, replaced at start) counts as free space."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ArenaError(f"the arena's directory {path.parent} does not exist")
    free = filesystem_free(path.parent)
    if path.is_file():
        free += path.stat().st_blocks * 512
    reason = misfit(capacity, str(path.parent), free, mem_available(), setting)
    if reason is not None:
        raise ArenaError(reason)
