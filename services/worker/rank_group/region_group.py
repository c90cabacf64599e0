"""The node's host store as the ranks of a tensor-parallel group share it: one set of host
regions for the group, which every rank reads and rank 0 alone writes.

Every TP rank computes the same KV rows and index keys (the latent row and the indexer are
replicated) and makes the same allocation calls in the same order (``rank_group.lockstep``).
Rank 0 makes each call to the store and broadcasts its answer — the region, or the error the
store raised — so every rank holds the same regions; durable marks and releases are rank 0's
alone. Rank 0 is the only writer of the arena (``KVCacheConfig.host_writer``): its backups of
a step are ordered before that step's sampled tokens are read back, so they have landed
before the next step's broadcast lets any rank read them.

Cached prefixes (``serving.prefix_reuse``): an admission looks one up on every rank at the same
point of the same step, so rank 0 asks the store and broadcasts the hit; its lease is rank 0's
to return. Leaving a prefix behind is rank 0's alone, through the store itself (a request can
end between two steps, where the other ranks make no call to meet a broadcast)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

from services.kv_host_store.records import PrefixHit, Region, RegionSpec
from services.worker.hierarchy.region_store import RegionStore
from services.worker.kv.errors import HostStoreUnavailable, describe
from services.worker.parallel.comm import Comm


def portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (to reach the other ranks), else its account."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # a gRPC error holds its call
        return HostStoreUnavailable(describe(e))
    return e


class GroupRegionStore:
    """A ``RegionStore`` over rank 0's ``store`` (the other ranks' is never called)."""

    def __init__(self, store: RegionStore, comm: Comm) -> None:
        self.store = store
        self.comm = comm

    def _leader_answers(self, call):
        """Rank 0's answer to ``call()`` on every rank (or the error it raised, raised)."""
        if self.comm.is_leader:
            try:
                value = call()
            except Exception as e:
                self.comm.broadcast_object(("error", portable(e)))
                raise
            self.comm.broadcast_object(("ok", value))
            return value
        kind, value = self.comm.broadcast_object(None)
        if kind == "error":
            raise value
        return value

    def allocate(
        self,
        request_id: str,
        owner: str,
        source: int,
        num_rows: int,
        row_bytes: int,
        generation: int = 0,
    ) -> Region:
        return self._leader_answers(
            lambda: self.store.allocate(request_id, owner, source, num_rows, row_bytes, generation)
        )

    def allocate_many(
        self, request_id: str, owner: str, specs: Sequence[RegionSpec], generation: int = 0
    ) -> list[Region]:
        return self._leader_answers(
            lambda: self.store.allocate_many(request_id, owner, specs, generation)
        )

    def acquire_prefix(
        self, owner: str, generation: int, hashes: list[str], token_ids: list[int],
        page_size: int, whole: bool = False,
    ) -> PrefixHit | None:  # fmt: skip
        return self._leader_answers(
            lambda: self.store.acquire_prefix(
                owner, generation, hashes, token_ids, page_size, whole
            )
        )

    def release_prefix(self, lease_id: str) -> None:
        if self.comm.is_leader:
            self.store.release_prefix(lease_id)

    def cache_prefix(
        self,
        request_id: str,
        owner: str,
        generation: int,
        hashes: list[str],
        token_ids: list[int],
        page_size: int,
    ) -> bool:
        raise RuntimeError(
            "a tensor-parallel group leaves cached prefixes through rank 0's own store, alone"
        )

    def mark_durable(
        self, region_id: str, owner: str, start_row: int, end_row: int, generation: int = 0
    ) -> int:
        if self.comm.is_leader:
            return self.store.mark_durable(region_id, owner, start_row, end_row, generation)
        return 0

    def release_request(self, owner: str, request_id: str, generation: int = 0) -> object:
        if self.comm.is_leader:
            return self.store.release_request(owner, request_id, generation)
        return None

    def release_region(self, owner: str, region_id: str, generation: int = 0) -> object:
        if self.comm.is_leader:
            return self.store.release_region(owner, region_id, generation)
        return None
