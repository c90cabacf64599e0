"""A private arena and host store in this process, for offline generation and tests: the same
interface as ``KVHostStoreClient`` (``RegionStore`` and the owner calls), so an engine cannot
tell the difference. Two engines sharing one ``LocalHostStore`` behave like two worker
processes on one node."""

from __future__ import annotations

import contextlib
import os
import uuid
import weakref
from collections.abc import Sequence

from services.kv_host_store.arena import HostArena, map_arena
from services.kv_host_store.placement import Placement
from services.kv_host_store.records import (
    ArenaInfo,
    OwnerLease,
    PrefixHit,
    Region,
    RegionSpec,
    ReleaseResult,
    RequestInfo,
    StoreStats,
)
from services.kv_host_store.store import HostStore


class LocalHostStore:
    def __init__(
        self,
        capacity: int,
        path: str | None = None,
        *,
        orphan_ttl_s: float = 300.0,
        placement: Placement = Placement(),
    ) -> None:
        self.path = path or f"/dev/shm/dhisparse-local-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._arena = HostArena.create(self.path, capacity)
        self.store = HostStore(capacity, orphan_ttl_s=orphan_ttl_s, placement=placement)
        self.mapping = map_arena(self.path, capacity)
        self.store_id = uuid.uuid4().hex
        # The file must not outlive the process even when close() is never called.
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def get_arena(self) -> ArenaInfo:
        return ArenaInfo(self.path, self.store.capacity, self.store.alignment, self.store_id)

    def allocate(
        self,
        request_id: str,
        owner: str,
        source: int,
        num_rows: int,
        row_bytes: int,
        generation: int = 0,
    ) -> Region:
        return self.store.allocate(request_id, owner, source, num_rows, row_bytes, generation)

    def allocate_many(
        self, request_id: str, owner: str, specs: Sequence[RegionSpec], generation: int = 0
    ) -> list[Region]:
        return self.store.allocate_many(request_id, owner, specs, generation)

    def mark_durable(
        self, region_id: str, owner: str, start_row: int, end_row: int, generation: int = 0
    ) -> int:
        return self.store.mark_durable(region_id, owner, start_row, end_row, generation)

    def lookup(self, request_id: str, owner: str, generation: int = 0) -> list[Region]:
        return self.store.lookup(request_id, owner, generation)

    def release_request(self, owner: str, request_id: str, generation: int = 0) -> ReleaseResult:
        return self.store.release(owner, request_id=request_id, generation=generation)

    def release_region(self, owner: str, region_id: str, generation: int = 0) -> ReleaseResult:
        return self.store.release(owner, region_id=region_id, generation=generation)

    def register_owner(self, owner: str, ttl_s: float, salt: str = "") -> OwnerLease:
        return self.store.register_owner(owner, ttl_s, salt)

    def renew_owner(self, owner: str, generation: int) -> OwnerLease:
        return self.store.renew_owner(owner, generation)

    def release_owner(self, owner: str, generation: int) -> None:
        self.store.release_owner(owner, generation)

    def list_requests(self, owner: str = "", adoptable_only: bool = False) -> list[RequestInfo]:
        return self.store.list_requests(owner, adoptable_only)

    def adopt(
        self, request_id: str, owner: str, generation: int, from_owner: str = "",
        fence: bool = False, from_generation: int = 0,
    ) -> list[Region]:  # fmt: skip
        return self.store.adopt(
            request_id, owner, generation, from_owner=from_owner, fence=fence,
            from_generation=from_generation,
        )  # fmt: skip

    def hand_over(self, request_id: str, owner: str, generation: int) -> None:
        self.store.hand_over(request_id, owner, generation)

    def cache_prefix(
        self,
        request_id: str,
        owner: str,
        generation: int,
        hashes: list[str],
        token_ids: list[int],
        page_size: int,
    ) -> bool:
        return self.store.cache_prefix(request_id, owner, generation, hashes, token_ids, page_size)

    def acquire_prefix(
        self, owner: str, generation: int, hashes: list[str], token_ids: list[int],
        page_size: int, whole: bool = False,
    ) -> PrefixHit | None:  # fmt: skip
        return self.store.acquire_prefix(owner, generation, hashes, token_ids, page_size, whole)

    def release_prefix(self, lease_id: str) -> None:
        self.store.release_prefix(lease_id)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def close(self) -> None:
        self.mapping.close()
        self._arena.close(remove=True)
        self._finalizer.detach()


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
