"""The host store's logic, with no gRPC in it: regions of the arena, who owns them, and which
of their rows are durable.

Ownership is per *request*: every region of a request belongs to the worker process — worker id
and generation (``owners``) — that allocated the request's first region or adopted it, and only
that owner may allocate more, mark durable, look up or release. When the owner process dies its
requests become adoptable: ``adopt`` transfers one to a live owner (regions stay where they are:
nothing is copied), and calls still in flight from the dead generation are refused. The adopter
may be the dead worker's successor or a live *peer*: a peer that found the owner unreachable
fences its generation as it adopts (``fence``), and a draining owner offers a request to peers
(``hand_over``); either way ownership stays single — one adopter wins, and the previous holder's
calls on the request are refused from then on, even if its process comes back. Requests nobody
adopts within ``orphan_ttl_s`` of their owner's death (or hand-over) are freed by
``expire_orphans``.

A request may also be handed to the store as a *cached prefix* (``cache_prefix``,
``prefix_cache``): the store owns it from then on, leases it to admissions whose prompt begins
with its pages, and evicts it least-recently-used when an allocation finds no room — never
while leased, and never a worker's own regions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from services.kv_host_store.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from services.kv_host_store.owners import OwnerTable
from services.kv_host_store.placement import Placement
from services.kv_host_store.prefix_cache import PrefixCache
from services.kv_host_store.records import (
    OwnerLease,
    PrefixHit,
    Region,
    RegionSpec,
    ReleaseResult,
    RequestInfo,
    StoreStats,
)
from services.kv_host_store.region_table import Holding, RegionTable
from services.kv_host_store.validation import INT32, check_id, check_int


def _who(owner: str, generation: int) -> str:
    return f"{owner!r}" if generation == 0 else f"{owner!r} generation {generation}"


def _check_holder(request_id: str, req: Holding, owner: str, generation: int) -> None:
    if (req.owner, req.generation) != (owner, generation):
        raise PermissionDenied(
            f"request {request_id!r} is owned by {_who(req.owner, req.generation)}, "
            f"not {_who(owner, generation)}"
        )


class HostStore:
    """Regions of one arena of ``capacity`` bytes, keyed by region id and indexed by request.

    Thread-safe: every public method holds one lock (the gRPC server runs on asyncio and the
    metrics endpoint scrapes from its own thread). Returned ``Region``s are snapshots.
    ``clock`` (seconds, monotonic) drives leases and orphan expiry; tests inject their own.
    ``placement`` says where new regions go in the arena (``placement.py``).
    Owner-scoped calls take the caller's ``generation`` (0: an owner that never registered).
    """

    def __init__(
        self,
        capacity: int,
        alignment: int = 4096,
        *,
        orphan_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        placement: Placement = Placement(),
    ) -> None:
        self._t = RegionTable(capacity, alignment, placement)
        self._lock = threading.Lock()
        self._owners = OwnerTable()
        self._clock = clock
        self.orphan_ttl_s = orphan_ttl_s
        self._adoptions = 0
        self._fenced = 0  # owner generations ended by a peer's adoption
        self._handovers = 0
        self._orphans_expired = 0
        self._prefixes = PrefixCache(self._t.free_detached)

    @property
    def capacity(self) -> int:
        return self._t.alloc.capacity

    @property
    def alignment(self) -> int:
        return self._t.alloc.alignment

    # -- owners ------------------------------------------------------------------------------

    def register_owner(self, owner: str, ttl_s: float, salt: str = "") -> OwnerLease:
        """A new generation of worker id ``owner``, writing rows of ``salt`` (what a peer must
        match to adopt its requests; "" unknown: any peer may); the previous generation's
        requests become adoptable at once (the process that held them has restarted)."""
        check_id("owner", owner)
        with self._lock:
            return self._owners.register(owner, float(ttl_s), self._clock(), salt)

    def renew_owner(self, owner: str, generation: int) -> OwnerLease:
        check_id("owner", owner)
        with self._lock:
            return self._owners.renew(owner, generation, self._clock())

    def release_owner(self, owner: str, generation: int) -> None:
        """Graceful end of a generation: what it still holds becomes adoptable now."""
        check_id("owner", owner)
        with self._lock:
            self._owners.release(owner, generation, self._clock())

    def _owned_request(self, request_id: str, owner: str, generation: int) -> Holding:
        self._owners.check_caller(owner, generation)
        req = self._t.requests.get(request_id)
        if req is None:
            raise NotFound(f"no regions for request {request_id!r}")
        _check_holder(request_id, req, owner, generation)
        return req

    def _owned_region(self, region_id: str, owner: str, generation: int) -> Region:
        region = self._t.regions.get(region_id)
        if region is None:
            raise NotFound(f"no region {region_id!r}")
        self._owned_request(region.request_id, owner, generation)
        return region

    # -- regions -----------------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        owner: str,
        source: int,
        num_rows: int,
        row_bytes: int,
        generation: int = 0,
    ) -> Region:
        """A new contiguous region of ``num_rows * row_bytes`` bytes for rows of ``source`` of
        ``request_id``; no rows are durable yet. Raises ``PermissionDenied`` when the request
        belongs to another owner, ``FailedPrecondition`` for a stale generation and
        ``CapacityExhausted`` (naming requested vs largest free bytes) when no contiguous free
        range fits, even with every unleased cached prefix evicted. A request may hold several
        regions of one source."""
        (region,) = self.allocate_many(
            request_id, owner, [RegionSpec(source, num_rows, row_bytes)], generation
        )
        return region

    def allocate_many(
        self,
        request_id: str,
        owner: str,
        specs: Sequence[RegionSpec],
        generation: int = 0,
    ) -> list[Region]:
        """``allocate`` of each of ``specs`` for ``request_id``, in order, all or nothing: when
        one does not fit (``CapacityExhausted``, naming it) those allocated before it are freed
        and the request holds what it held before. One call for a request's regions (a source
        each, and its session's), where a region at a time would cost a round trip each."""
        check_id("request_id", request_id)
        check_id("owner", owner)
        if not specs:
            raise InvalidArgument("no regions asked for")
        for spec in specs:
            check_int("source", spec.source, *INT32)
            check_int("num_rows", spec.num_rows, lo=1)
            check_int("row_bytes", spec.row_bytes, lo=1)
        with self._lock:
            self._owners.check_caller(owner, generation)
            req = self._t.requests.get(request_id)
            if req is not None:
                _check_holder(request_id, req, owner, generation)
            evict, salt = self._prefixes.evict_one, self._owners.salt(owner)
            out: list[Region] = []
            try:
                for spec in specs:
                    out.append(self._t.add(
                        request_id, owner, generation, spec.source, spec.num_rows,
                        spec.row_bytes, evict, salt,
                    ))  # fmt: skip
            except BaseException:
                for region in out:
                    self._t.free(region)
                raise
            return out

    def mark_durable(
        self, region_id: str, owner: str, start_row: int, end_row: int, generation: int = 0
    ) -> int:
        """Records that rows ``[start_row, end_row)`` of the region hold complete, committed
        bytes; calls may arrive in any order and overlap. Returns the region's durable rows."""
        check_id("region_id", region_id)
        check_id("owner", owner)
        check_int("start_row", start_row, lo=0)
        check_int("end_row", end_row)
        with self._lock:
            region = self._owned_region(region_id, owner, generation)
            if not start_row < end_row <= region.num_rows:
                raise InvalidArgument(
                    f"rows [{start_row}, {end_row}) must be a non-empty range inside the "
                    f"region's {region.num_rows} rows"
                )
            return self._t.mark(region, start_row, end_row)

    def lookup(self, request_id: str, owner: str, generation: int = 0) -> list[Region]:
        """Every region of ``request_id`` with its durable rows, ordered by (source, offset)."""
        check_id("request_id", request_id)
        check_id("owner", owner)
        with self._lock:
            return self._t.of(self._owned_request(request_id, owner, generation))

    def release(
        self,
        owner: str,
        *,
        request_id: str | None = None,
        region_id: str | None = None,
        generation: int = 0,
    ) -> ReleaseResult:
        """Frees one region (``region_id``) or every region of a request (``request_id``):
        exactly one must be given (an empty string counts as not given, as in the proto)."""
        check_id("owner", owner)
        if bool(request_id) == bool(region_id):
            raise InvalidArgument("give exactly one of request_id and region_id")
        with self._lock:
            if region_id:
                check_id("region_id", region_id)
                victims = [self._owned_region(region_id, owner, generation)]
            else:
                rid = check_id("request_id", request_id)
                victims = self._t.of(self._owned_request(rid, owner, generation))
            freed = sum(self._t.free(region) for region in victims)
            return ReleaseResult(released=len(victims), bytes_freed=freed)

    # -- cached prefixes ---------------------------------------------------------------------

    def cache_prefix(
        self,
        request_id: str,
        owner: str,
        generation: int,
        hashes: list[str],
        token_ids: list[int],
        page_size: int,
    ) -> bool:
        """Hands every region of ``request_id`` to the store as the cached prefix of
        ``len(hashes)`` complete pages of ``token_ids`` (``prefix_index.page_hashes``): each
        region holds, from row 0, the rows of those pages, complete. The request is gone from
        its owner's holdings either way; False when a cached prefix already held every page
        (its regions are freed)."""
        check_id("request_id", request_id)
        check_int("page_size", page_size, lo=1)
        with self._lock:
            self._owned_request(request_id, owner, generation)
            regions, nbytes = self._t.detach(request_id)
            return self._prefixes.add(regions, nbytes, hashes, token_ids, page_size)

    def acquire_prefix(
        self,
        owner: str,
        generation: int,
        hashes: list[str],
        token_ids: list[int],
        page_size: int,
        whole: bool = False,
    ) -> PrefixHit | None:
        """A lease for ``(owner, generation)`` on the cached prefix holding the most leading
        pages of the query (``whole``: of those ending where the match does); None when none
        holds its first page. The lease keeps the record from eviction until
        ``release_prefix`` (or its owner's death)."""
        check_id("owner", owner)
        check_int("page_size", page_size, lo=1)
        with self._lock:
            self._owners.check_caller(owner, generation)
            return self._prefixes.acquire(hashes, token_ids, page_size, owner, generation, whole)

    def release_prefix(self, lease_id: str) -> None:
        check_id("lease_id", lease_id)
        with self._lock:
            self._prefixes.release(lease_id)

    # -- adoption and orphans ----------------------------------------------------------------

    def list_requests(self, owner: str = "", adoptable_only: bool = False) -> list[RequestInfo]:
        """Requests holding regions (of ``owner``'s generations, or everyone's), by id."""
        with self._lock:
            now = self._clock()
            out = []
            for request_id, req in sorted(self._t.requests.items()):
                dead = self._adoptable_since(req, now)
                if (owner and req.owner != owner) or (adoptable_only and dead is None):
                    continue
                age = 0.0 if dead is None else max(0.0, now - dead)
                held = self._t.held_bytes(req)
                info = RequestInfo(
                    request_id, req.owner, req.generation, len(req.region_ids), held,
                    dead is not None, age,
                )  # fmt: skip
                out.append(info)
            return out

    def _adoptable_since(self, req: Holding, now: float) -> float | None:
        """Since when ``req`` may be adopted: its owner's death or its hand-over; None while
        its live owner keeps it."""
        dead = self._owners.dead_since(req.owner, req.generation, now)
        return dead if dead is not None else req.handed_over

    def adopt(
        self,
        request_id: str,
        owner: str,
        generation: int,
        *,
        from_owner: str = "",
        fence: bool = False,
        from_generation: int = 0,
    ) -> list[Region]:
        """Transfers every region of an adoptable request (its owner dead, or it was handed
        over) to the live ``(owner, generation)``, atomically, and returns them; adopting a
        request one already holds returns its regions. ``from_owner``: the worker id the caller
        takes it from (and ``from_generation``, 0: any) — refused when the request belongs to
        another by now (an adopter racing this one won, or that worker's successor resumed it). ``fence`` (with ``from_owner``): the caller found that owner's process
        unreachable; its current generation is ended first (``OwnerTable.fence``), so every
        request it holds becomes adoptable and its calls are refused. Raises
        ``FailedPrecondition`` while the request's owner lives and keeps it, for a caller that
        is not a live registered owner, and when the caller's rows are computed otherwise than
        the request's (their registered salts differ)."""
        check_id("request_id", request_id)
        check_id("owner", owner)
        if fence and not from_owner:
            raise InvalidArgument("fence names the owner to fence: give from_owner")
        with self._lock:
            now = self._clock()
            self._owners.check_caller(owner, generation)
            if generation == 0 or not self._owners.is_live(owner, generation, now):
                raise FailedPrecondition(
                    f"only a live registered owner may adopt; {_who(owner, generation)} is "
                    "not one (register, or renew the lease)"
                )
            req = self._t.requests.get(request_id)
            if req is None:
                raise NotFound(f"no regions for request {request_id!r}")
            if (req.owner, req.generation) == (owner, generation):
                return self._t.of(req)
            if (from_owner and req.owner != from_owner) or (
                from_generation and req.generation != from_generation
            ):
                raise FailedPrecondition(
                    f"request {request_id!r} belongs to {_who(req.owner, req.generation)} now, "
                    f"not {_who(from_owner, from_generation)}: another adopter took it"
                )
            mine = self._owners.salt(owner)
            if req.salt and mine and req.salt != mine:
                raise FailedPrecondition(
                    f"request {request_id!r} holds rows of another model or KV layout than "
                    f"{_who(owner, generation)} computes (salt {req.salt[:12]} vs {mine[:12]})"
                )
            if fence and self._adoptable_since(req, now) is None:
                self._owners.fence(req.owner, req.generation, now)
                self._fenced += 1
            if self._adoptable_since(req, now) is None:
                raise FailedPrecondition(
                    f"request {request_id!r} belongs to the live owner "
                    f"{_who(req.owner, req.generation)}: not adoptable"
                )
            self._t.transfer(req, owner, generation)
            self._adoptions += 1
            return self._t.of(req)

    def hand_over(self, request_id: str, owner: str, generation: int) -> None:
        """The live owner offers ``request_id`` to its peers (it drains, or cannot hold it):
        adoptable from now on, by any live owner (``adopt``); until one adopts it, it is still
        the owner's. Handing over a request twice changes nothing."""
        check_id("request_id", request_id)
        check_id("owner", owner)
        with self._lock:
            req = self._owned_request(request_id, owner, generation)
            if req.handed_over is None:
                req.handed_over = self._clock()
                self._handovers += 1

    def expire_orphans(self) -> int:
        """Frees the requests whose owner died at least ``orphan_ttl_s`` ago and that nobody
        adopted; returns how many (the server's sweeper calls this periodically)."""
        with self._lock:
            now = self._clock()
            expired = [
                req
                for req in self._t.requests.values()
                if (dead := self._adoptable_since(req, now)) is not None
                and now - dead >= self.orphan_ttl_s
            ]
            for req in expired:
                for region in self._t.of(req):
                    self._t.free(region)
            self._orphans_expired += len(expired)
            self._prefixes.drop_leases(lambda o, g: self._owners.dead_since(o, g, now) is not None)
            return len(expired)

    def stats(self) -> StoreStats:
        with self._lock:
            a = self._t.alloc
            return StoreStats(
                capacity_bytes=a.capacity,
                used_bytes=a.used_bytes,
                regions=len(self._t.regions),
                requests=len(self._t.requests),
                durable_bytes=self._t.durable_bytes,
                allocations_refused=self._t.refused,
                largest_free_bytes=a.largest_free(),
                owners_live=self._owners.live_count(self._clock()),
                adoptions=self._adoptions,
                owners_fenced=self._fenced,
                handovers=self._handovers,
                orphans_expired=self._orphans_expired,
                prefix_records=len(self._prefixes),
                prefix_bytes=self._prefixes.nbytes,
                prefix_evictions=self._prefixes.evictions,
                prefix_hits=self._prefixes.hits,
            )
