"""Cached prefixes: complete pages that finished requests left in the arena, owned by the store.

A worker hands over a request whose regions hold the rows and index keys of whole pages of one
token sequence (``HostStore.cache_prefix``); from then on the store owns them — no worker's
death or generation touches them — and names them by their pages' chained hashes
(``prefix_index``). A worker admitting a request whose prompt begins with cached pages takes a
*lease* on the longest match (``acquire``), copies what it needs and returns the lease
(``release``). A record is evicted least-recently-used when an allocation finds no room, never
while a lease holds it; a lease of a worker process that died is dropped by the store's sweep.
Records are immutable: nothing writes a cached region after it is handed over.

Pure bookkeeping, unlocked: ``HostStore`` serializes calls and frees the bytes (``free``).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.kv_host_store.errors import InvalidArgument, NotFound
from services.kv_host_store.prefix_index import PrefixIndex
from services.kv_host_store.records import PrefixHit, Region


@dataclass
class _Record:
    regions: tuple[Region, ...]
    page_size: int
    pages: int
    nbytes: int  # aligned arena bytes its regions hold
    refs: int = 0  # live leases


@dataclass(frozen=True)
class _Lease:
    record_id: str
    owner: str
    generation: int


class PrefixCache:
    def __init__(self, free: Callable[[Region], int]) -> None:
        """``free(region)`` returns a cached region's bytes to the arena (its bytes freed)."""
        self._free = free
        self._records: OrderedDict[str, _Record] = OrderedDict()  # least recently used first
        self._indexes: dict[int, PrefixIndex] = {}  # by page size
        self._leases: dict[str, _Lease] = {}
        self.nbytes = 0
        self.evictions = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def leases(self) -> int:
        return len(self._leases)

    def _index(self, page_size: int) -> PrefixIndex:
        if page_size not in self._indexes:
            self._indexes[page_size] = PrefixIndex(page_size)
        return self._indexes[page_size]

    def add(
        self,
        regions: Sequence[Region],
        nbytes: int,
        hashes: Sequence[str],
        token_ids: Sequence[int],
        page_size: int,
    ) -> bool:
        """Takes ``regions`` (``nbytes`` aligned bytes) as the record of the pages ``hashes``
        name. False, freeing them, when a record already holds every one of those pages; else
        True, and records whose every page this one holds are freed (unless leased)."""
        if not hashes:
            raise InvalidArgument("a cached prefix holds at least one complete page")
        if len(token_ids) < len(hashes) * page_size:
            raise InvalidArgument(
                f"{len(hashes)} pages of {page_size} tokens need that many token ids, "
                f"got {len(token_ids)}"
            )
        index = self._index(page_size)
        if index.covers(hashes, token_ids):
            for r in regions:
                self._free(r)
            return False
        record_id = uuid.uuid4().hex
        index.add(record_id, hashes, token_ids)
        self._records[record_id] = _Record(tuple(regions), page_size, len(hashes), nbytes)
        self.nbytes += nbytes
        for old in map(str, index.covered_by(record_id)):
            if self._records[old].refs == 0:
                self._drop(old)
        return True

    def acquire(
        self,
        hashes: Sequence[str],
        token_ids: Sequence[int],
        page_size: int,
        owner: str,
        generation: int,
        whole: bool = False,
    ) -> PrefixHit | None:
        """A lease on the record holding the longest run of the query's leading pages (with
        ``whole``, of the records ending where the run does); None when none holds its first
        page. The record is now the most recently used."""
        index = self._indexes.get(page_size)
        match = None if index is None else index.longest_match(hashes, token_ids, whole)
        if match is None:
            return None
        record_id = str(match.record)
        rec = self._records[record_id]
        rec.refs += 1
        self._records.move_to_end(record_id)
        lease_id = uuid.uuid4().hex
        self._leases[lease_id] = _Lease(record_id, owner, generation)
        self.hits += 1
        return PrefixHit(lease_id, match.pages, match.pages * page_size, rec.regions)

    def release(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"no prefix lease {lease_id!r}")
        self._records[lease.record_id].refs -= 1

    def drop_leases(self, dead: Callable[[str, int], bool]) -> int:
        """Ends the leases of worker processes that ``dead(owner, generation)`` says are gone;
        returns how many."""
        gone = [k for k, lease in self._leases.items() if dead(lease.owner, lease.generation)]
        for k in gone:
            self.release(k)
        return len(gone)

    def evict_one(self) -> bool:
        """Frees the least recently used record no lease holds; False when every record is
        leased (or there is none)."""
        for record_id, rec in self._records.items():
            if rec.refs == 0:
                self._drop(record_id)
                self.evictions += 1
                return True
        return False

    def _drop(self, record_id: str) -> None:
        rec = self._records.pop(record_id)
        self._indexes[rec.page_size].remove(record_id)
        for r in rec.regions:
            self._free(r)
        self.nbytes -= rec.nbytes
