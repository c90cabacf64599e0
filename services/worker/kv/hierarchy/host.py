"""Host backups: every committed row of every request, in the node's kv_host_store arena.

One request's rows of one source are one contiguous region (DESIGN §3), so a step's misses
fall in a few windows of the arena. The worker maps the arena file and moves bytes itself; the
store only hands out regions and records which rows are durable."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from services.kv_host_store.arena import ArenaMapping, HostArena, map_arena
from services.kv_host_store.intervals import add_range, contains
from services.kv_host_store.records import Region, RowRange
from services.kv_host_store.store import HostStore

log = logging.getLogger(__name__)


class RegionStore(Protocol):
    """What the worker needs of the host store: ``KVHostStoreClient`` or ``LocalHostStore``."""

    def allocate(
        self, request_id: str, owner: str, source: int, num_rows: int, row_bytes: int
    ) -> Region: ...

    def mark_durable(self, region_id: str, owner: str, start_row: int, end_row: int) -> int: ...

    def release_request(self, owner: str, request_id: str) -> object: ...

    def release_region(self, owner: str, region_id: str) -> object: ...


class LocalHostStore:
    """A private arena and store in this process, for offline generation and tests; the same
    interface as the gRPC client."""

    def __init__(self, capacity: int, path: str | None = None) -> None:
        self.path = path or f"/dev/shm/dhisparse-local-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._arena = HostArena.create(self.path, capacity)
        self.store = HostStore(capacity)
        self.mapping = map_arena(self.path, capacity)
        # The file must not outlive the process even when close() is never called.
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def allocate(
        self, request_id: str, owner: str, source: int, num_rows: int, row_bytes: int
    ) -> Region:
        return self.store.allocate(request_id, owner, source, num_rows, row_bytes)

    def mark_durable(self, region_id: str, owner: str, start_row: int, end_row: int) -> int:
        return self.store.mark_durable(region_id, owner, start_row, end_row)

    def release_request(self, owner: str, request_id: str) -> object:
        return self.store.release(owner, request_id=request_id)

    def release_region(self, owner: str, region_id: str) -> object:
        return self.store.release(owner, region_id=region_id)

    def close(self) -> None:
        self.mapping.close()
        self._arena.close(remove=True)
        self._finalizer.detach()


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class HostPointer:
    """A host tensor as a Triton kernel argument: under UVA a pinned (registered) host pointer
    is valid on the device, but Triton refuses CPU tensors, so pass pointer and dtype only."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


@dataclass
class _Backed:
    region: Region
    base: int  # element offset of row 0 in the typed arena view
    durable: tuple[RowRange, ...] = ()  # rows holding committed bytes (merged)


class HostBackups:
    """Per slot and source: a region and its element base in ``arena`` (the typed view)."""

    def __init__(
        self,
        store: RegionStore,
        mapping: ArenaMapping,
        owner: str,
        num_sources: int,
        row_elems: int,
        dtype: torch.dtype,
        max_slots: int,
        device: torch.device | str,
    ) -> None:
        self.store = store
        self.owner = owner
        self.num_sources = num_sources
        self.row_elems = row_elems
        esize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = row_elems * esize
        usable = mapping.capacity - mapping.capacity % esize
        self.arena = mapping.tensor[:usable].view(dtype)  # [capacity / esize] host elements
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            mapping.pin()
        self.arena_ptr = HostPointer(self.arena)
        # [max_slots, num_sources] element base of each region (-1: none), for kernels
        self.base = torch.full((max_slots, num_sources), -1, dtype=torch.int64, device=device)
        self._backed: dict[int, list[_Backed]] = {}
        self._request_of: dict[int, str] = {}
        self._durability = _DurabilityReporter(store, owner)

    def admit(self, slot: int, request_id: str, rows_per_source: list[int]) -> None:
        """Allocates one contiguous region per source; raises the store's CapacityExhausted."""
        esize = self.arena.element_size()
        backed: list[_Backed] = []
        try:
            for s, rows in enumerate(rows_per_source):
                region = self.store.allocate(
                    request_id, self.owner, s, max(1, rows), self.row_bytes
                )
                assert region.offset % esize == 0
                backed.append(_Backed(region, region.offset // esize))
        except Exception:
            if backed:
                self.store.release_request(self.owner, request_id)
            raise
        self._backed[slot] = backed
        self._request_of[slot] = request_id
        self.base[slot] = torch.tensor([b.base for b in backed], dtype=torch.int64)

    def release(self, slot: int) -> None:
        """Frees the slot's regions (by region, not by request id: a client may reuse a finished
        request's id before this release reaches the store)."""
        self._request_of.pop(slot, None)
        backed = self._backed.pop(slot, [])
        self.base[slot] = -1
        for b in backed:
            self._durability.release(b.region.region_id)

    def rows_view(self, slot: int, source: int, start: int, end: int) -> torch.Tensor:
        """[end - start, row_elems] host view of rows of one slot's source."""
        b = self._backed[slot][source].base
        return self.arena[b + start * self.row_elems : b + end * self.row_elems].view(
            -1, self.row_elems
        )

    def write(self, slot: int, source: int, start: int, values: torch.Tensor) -> None:
        """Backs up rows ``start ..`` of a slot's source (values [n, row_elems]). From a GPU the
        copy is asynchronous into the registered arena: it is ordered before every later
        kernel, including the resolver's host reads, so nothing waits for it."""
        n = values.shape[0]
        self.rows_view(slot, source, start, start + n).copy_(values, non_blocking=self.on_gpu)

    def mark_durable(self, slot: int, source: int, start: int, end: int) -> None:
        """Rows [start, end) of the slot's source now hold committed bytes on the host."""
        if end <= start:
            return
        b = self._backed[slot][source]
        b.durable = add_range(b.durable, start, end)
        self._durability.report(b.region.region_id, start, end)

    def durable(self, slot: int, source: int, start: int, end: int) -> bool:
        """Whether rows [start, end) of the slot's source all have host copies."""
        return end <= start or contains(self._backed[slot][source].durable, start, end)

    def close(self) -> None:
        self._durability.close()


class _DurabilityReporter:
    """Reports durable row ranges (and releases) to the store off the engine thread, in order."""

    def __init__(self, store: RegionStore, owner: str) -> None:
        self.store = store
        self.owner = owner
        self._q: queue.SimpleQueue[tuple[str, tuple] | None] = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="durability", daemon=True)
        self._t.start()

    def report(self, region_id: str, start: int, end: int) -> None:
        self._q.put(("durable", (region_id, start, end)))

    def release(self, region_id: str) -> None:
        self._q.put(("release", (region_id,)))

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=10)

    def flush(self) -> None:
        """Waits until everything queued so far reached the store (tests)."""
        done = threading.Event()
        self._q.put(("flush", (done,)))
        done.wait(timeout=10)

    def _run(self) -> None:
        while True:
            batch = [self._q.get()]
            while True:  # drain what queued up meanwhile, so ranges of a region merge
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            pending: dict[str, tuple[RowRange, ...]] = {}
            for item in batch:
                if item is None:
                    self._flush(pending)
                    return
                op, args = item
                if op == "durable":
                    pending[args[0]] = add_range(pending.get(args[0], ()), args[1], args[2])
                    continue
                if op == "release":  # its durable rows no longer matter
                    pending.pop(args[0], None)
                self._flush(pending)
                pending = {}
                self._call(op, args)
            self._flush(pending)

    def _flush(self, pending: dict[str, tuple[RowRange, ...]]) -> None:
        for region_id, ranges in pending.items():
            for r in ranges:
                self._call("durable", (region_id, r.start, r.end))

    def _call(self, op: str, args: tuple) -> None:
        try:
            if op == "durable":
                self.store.mark_durable(args[0], self.owner, args[1], args[2])
            elif op == "release":
                self.store.release_region(self.owner, args[0])
            else:
                args[0].set()
        except Exception:  # the store being down must not take the engine with it
            log.exception("host store call %s failed", op)
