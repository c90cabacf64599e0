"""The host arena: one file under /dev/shm that the store creates and the node's workers map.

The store only creates, sizes, locks and finally removes the file (it never touches the bytes,
so it does not import torch). A worker maps the same file with ``map_arena`` and moves rows
between its GPU and the mapping directly; on a GPU it registers the mapping with CUDA as pinned
memory so kernels can read it under UVA.

Files, not ``multiprocessing.shared_memory``: its resource tracker unlinks a segment when an
attaching process exits, and the arena must outlive workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

from services.kv_host_store.errors import ArenaError, ArenaInUse
from services.kv_host_store.fit import check_arena_fits

if TYPE_CHECKING:
    import numpy as np
    import torch

    from services.kv_host_store.records import Region


class HostArena:
    """The store's handle on the arena file: creates it fresh and holds an exclusive ``flock``
    on it for the store's lifetime, so a second store on the same path fails instead of
    silently sharing (and corrupting) it. Workers never take the lock."""

    def __init__(self, path: Path, capacity: int, fd: int) -> None:
        self.path = path
        self.capacity = capacity
        self._fd: int | None = fd

    @classmethod
    def create(cls, path: str | Path, capacity: int, *, preallocate: bool = False) -> HostArena:
        """A fresh, zero-filled arena file of ``capacity`` bytes at ``path``.

        A file left there by a store that is gone (crashed, or kept with remove-on-exit off) is
        replaced by a new file, not reused: workers still mapping the old one keep their old
        bytes and learn from the new ``store_id`` to remap. ``preallocate`` reserves the tmpfs
        pages now, so an over-committed /dev/shm fails here and not as a SIGBUS in a worker.
        Raises ``ArenaInUse`` when a live store holds the file, ``ArenaError`` when the arena
        does not fit /dev/shm or the memory available (``check_arena_fits``).
        """
        path = Path(path)
        if capacity <= 0:
            raise ArenaError(f"arena capacity must be positive, got {capacity}")
        if path.exists():
            cls._remove_stale(path)
        check_arena_fits(path, capacity)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        except FileExistsError as e:  # another store created it since we looked
            raise ArenaInUse(f"arena {path} was created by another store just now") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, capacity)
            if preallocate:
                os.posix_fallocate(fd, 0, capacity)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, capacity, fd)

    @staticmethod
    def _remove_stale(path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise ArenaInUse(f"arena {path} is held by another running kv_host_store") from e
        else:
            os.unlink(path)
        finally:
            os.close(fd)  # also drops the lock

    def close(self, *, remove: bool) -> None:
        """Releases the lock; with ``remove``, unlinks the file too — but only if the path
        still names this arena's file (a newer store may have replaced it)."""
        if self._fd is None:
            return
        try:
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                        os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = None


class ArenaMapping:
    """A worker's shared, writable mapping of the whole arena.

    ``tensor`` is ``[capacity] uint8`` on the CPU, sharing memory with the file (and so with
    the store and every other worker on the node); ``array`` is the same bytes as numpy.
    Views returned by ``region``/``rows`` alias the mapping: writes land in the arena.
    """

    def __init__(self, path: Path, capacity: int, mm: mmap.mmap) -> None:
        import numpy as np
        import torch

        self.path = path
        self.capacity = capacity
        self._mmap: mmap.mmap | None = mm
        self.array: np.ndarray = np.frombuffer(mm, dtype=np.uint8)  # [capacity] uint8
        self.tensor: torch.Tensor = torch.from_numpy(self.array)  # [capacity] uint8
        self.pinned = False

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """``[nbytes] uint8`` view of arena bytes ``[offset, offset + nbytes)``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise ValueError(
                f"bytes [{offset}, {offset + nbytes}) outside the arena of {self.capacity}"
            )
        return self.tensor[offset : offset + nbytes]

    def rows(self, offset: int, num_rows: int, row_bytes: int) -> torch.Tensor:
        """``[num_rows, row_bytes] uint8`` view of ``num_rows`` rows starting at ``offset``."""
        return self.region(offset, num_rows * row_bytes).view(num_rows, row_bytes)

    def rows_of(self, region: Region) -> torch.Tensor:
        """``[region.num_rows, region.row_bytes] uint8`` view of a region's rows."""
        return self.rows(region.offset, region.num_rows, region.row_bytes)

    def pin(self) -> bool:
        """Registers the mapping with CUDA as pinned host memory (``cudaHostRegister``), so the
        GPU can read it directly. Returns ``False`` without an accelerator (nothing to pin for).
        Registration takes time in proportion to the arena (more for a fresh file, whose pages
        are first touched): a huge arena wants this off the hot path. A Triton kernel then reads
        the registered mapping directly, and ``tensor.is_pinned()`` is true."""
        import torch

        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.capacity, 0)
        if int(err) != 0:
            raise ArenaError(f"cudaHostRegister of {self.path} failed with error {int(err)}")
        self.pinned = True
        return True

    def unpin(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False

    def close(self) -> None:
        """Unpins and drops this object's references; the mapping goes away once no view of
        it is alive (closing it under a live view would leave that view dangling)."""
        self.unpin()
        mm, self._mmap = self._mmap, None
        del self.tensor, self.array
        if mm is not None:
            # Views still alive elsewhere keep the mapping valid; it goes when they do.
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> ArenaMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_arena(path: str | Path, capacity: int | None = None) -> ArenaMapping:
    """Maps an existing arena file read-write and shared.

    Never creates or resizes the file (``torch.from_file`` would do both on a wrong path or
    size). With ``capacity`` given, the file must be exactly that size — a mismatch means it
    belongs to another store configuration. Raises ``ArenaError``.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as e:
        raise ArenaError(f"no arena file at {path}: is the kv_host_store running?") from e
    try:
        size = os.fstat(fd).st_size  # of the file we opened, not of whatever the path names now
        if capacity is not None and size != capacity:
            raise ArenaError(f"arena {path} is {size} bytes, expected {capacity}")
        if size == 0:
            raise ArenaError(f"arena {path} is empty")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file alive
    return ArenaMapping(path, size, mm)
