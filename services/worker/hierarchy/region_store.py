"""What the worker needs of the node's host store: ``KVHostStoreClient`` (over gRPC) or
``LocalHostStore`` (a private arena in this process) both provide it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.kv_host_store.records import PrefixHit, Region, RegionSpec


class RegionStore(Protocol):
    """What the worker needs of the host store: ``KVHostStoreClient`` or ``LocalHostStore``."""

    def allocate(
        self,
        request_id: str,
        owner: str,
        source: int,
        num_rows: int,
        row_bytes: int,
        generation: int = 0,
    ) -> Region: ...

    def allocate_many(
        self, request_id: str, owner: str, specs: Sequence[RegionSpec], generation: int = 0
    ) -> list[Region]: ...

    def mark_durable(
        self, region_id: str, owner: str, start_row: int, end_row: int, generation: int = 0
    ) -> int: ...

    def release_request(self, owner: str, request_id: str, generation: int = 0) -> object: ...

    def release_region(self, owner: str, region_id: str, generation: int = 0) -> object: ...

    def cache_prefix(
        self,
        request_id: str,
        owner: str,
        generation: int,
        hashes: list[str],
        token_ids: list[int],
        page_size: int,
    ) -> bool: ...

    def acquire_prefix(
        self, owner: str, generation: int, hashes: list[str], token_ids: list[int],
        page_size: int, whole: bool = False,
    ) -> PrefixHit | None: ...  # fmt: skip

    def release_prefix(self, lease_id: str) -> None: ...
