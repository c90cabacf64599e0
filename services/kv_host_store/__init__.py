"""The node's host KV store (DESIGN §1, §3): one arena file under /dev/shm holding every
committed KV row as host backup, and a gRPC service for its metadata (allocate, mark durable,
look up, release, stats) and its owners (worker processes with a generation and a lease; a dead
owner's requests are adopted by its successor or expire). Bytes never cross gRPC: workers map
the arena (``map_arena``) and copy rows between their GPU and the mapping directly.

For workers: ``KVHostStoreClient`` / ``AsyncKVHostStoreClient``, ``map_arena`` and the records
and errors they return. For running the service: ``KVHostStoreSettings`` and ``serve``
(``services.kv_host_store.server``).
"""

from __future__ import annotations

from services.kv_host_store.arena import ArenaMapping, map_arena
from services.kv_host_store.client import AsyncKVHostStoreClient, KVHostStoreClient
from services.kv_host_store.errors import (
    ArenaError,
    ArenaInUse,
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreError,
)
from services.kv_host_store.records import (
    ArenaInfo,
    OwnerLease,
    Region,
    RegionSpec,
    ReleaseResult,
    RequestInfo,
    RowRange,
    StoreStats,
)
from services.kv_host_store.settings import KVHostStoreSettings

__all__ = [
    "ArenaError",
    "ArenaInUse",
    "ArenaInfo",
    "ArenaMapping",
    "AsyncKVHostStoreClient",
    "CapacityExhausted",
    "FailedPrecondition",
    "InvalidArgument",
    "KVHostStoreClient",
    "KVHostStoreSettings",
    "NotFound",
    "OwnerLease",
    "PermissionDenied",
    "Region",
    "RegionSpec",
    "ReleaseResult",
    "RequestInfo",
    "RowRange",
    "StoreError",
    "StoreStats",
    "map_arena",
]
