"""Who may hold regions: worker processes, each a *generation* of a worker id, with a lease.

A worker process registers on start and gets the next generation of its worker id; it renews
its lease while it runs. A request held by generation g of worker w becomes *adoptable* when
that process is gone: at once when w registers a newer generation (a process registers only on
start, so g's process has exited), when g releases its registration (graceful shutdown), or
when g's lease expires, or when a live peer *fences* g (it found g's process unreachable and
adopts from it: g's calls are refused from then on, as after a release). Owners that never
registered (generation 0) have no lease and are never considered dead. Each generation registers
with the *salt* of the rows it writes (``prefix_index.PrefixSalt.root``: model, numerics, KV dtype,
page size; "" when unknown): a peer adopts only rows it computes the same way. Pure logic with an
injected clock; the store serializes calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.kv_host_store.errors import FailedPrecondition, InvalidArgument
from services.kv_host_store.records import OwnerLease


@dataclass
class _Owner:
    generation: int
    ttl_s: float
    expires: float  # the lease ends here unless renewed
    registered: float  # when this generation registered: earlier generations died by then
    released: float | None = None  # graceful release (or fencing) of this generation
    salt: str = ""  # how this generation's rows are computed ("" unknown)


class OwnerTable:
    def __init__(self, min_ttl_s: float = 0.05, max_ttl_s: float = 3600.0) -> None:
        self._owners: dict[str, _Owner] = {}
        self.min_ttl_s = min_ttl_s
        self.max_ttl_s = max_ttl_s

    def register(self, owner: str, ttl_s: float, now: float, salt: str = "") -> OwnerLease:
        """The next generation of ``owner`` (1 for the first), with a lease of ``ttl_s``, writing
        rows of ``salt``."""
        if not self.min_ttl_s <= ttl_s <= self.max_ttl_s:
            raise InvalidArgument(
                f"lease ttl must be in [{self.min_ttl_s}, {self.max_ttl_s}] s, got {ttl_s}"
            )
        prev = self._owners.get(owner)
        generation = 1 if prev is None else prev.generation + 1
        self._owners[owner] = _Owner(generation, ttl_s, now + ttl_s, now, salt=salt)
        return OwnerLease(owner, generation, ttl_s)

    def renew(self, owner: str, generation: int, now: float) -> OwnerLease:
        """Extends the lease of the current generation (also after it expired: requests nobody
        adopted meanwhile are still its own). Raises ``FailedPrecondition`` for a superseded,
        released or unknown generation."""
        o = self._current(owner, generation)
        o.expires = now + o.ttl_s
        return OwnerLease(owner, generation, o.ttl_s)

    def release(self, owner: str, generation: int, now: float) -> None:
        """Graceful end of a generation: what it still holds is adoptable from now on."""
        self._current(owner, generation).released = now

    def fence(self, owner: str, generation: int, now: float) -> None:
        """Ends the current generation ``generation`` of ``owner`` on a peer's word (its process
        is unreachable): from now on it is dead, its requests adoptable and its calls refused.
        A generation already dead stays as it is."""
        o = self._owners.get(owner)
        if o is not None and o.generation == generation and o.released is None:
            o.released = now

    def salt(self, owner: str) -> str:
        """The salt the current generation of ``owner`` registered with ("" when unknown)."""
        o = self._owners.get(owner)
        return "" if o is None else o.salt

    def check_caller(self, owner: str, generation: int) -> None:
        """A call may act for ``(owner, generation)``: the current registered generation, or
        generation 0 of an owner that never registered. Raises ``FailedPrecondition``."""
        if generation == 0 and owner not in self._owners:
            return
        self._current(owner, generation)

    def is_live(self, owner: str, generation: int, now: float) -> bool:
        return self.dead_since(owner, generation, now) is None and (
            generation == 0 or owner in self._owners
        )

    def dead_since(self, owner: str, generation: int, now: float) -> float | None:
        """When the process of ``(owner, generation)`` was known to be gone, or None while it may
        still run (or never registered)."""
        o = self._owners.get(owner)
        if o is None or generation > o.generation:
            return None
        if generation < o.generation:
            return o.registered
        if o.released is not None:
            return o.released
        return o.expires if now >= o.expires else None

    def live_count(self, now: float) -> int:
        return sum(1 for o in self._owners.values() if o.released is None and now < o.expires)

    def _current(self, owner: str, generation: int) -> _Owner:
        o = self._owners.get(owner)
        if o is None:
            raise FailedPrecondition(
                f"owner {owner!r} generation {generation} is not registered with this store "
                "(did the store restart?): register again"
            )
        if generation != o.generation:
            raise FailedPrecondition(
                f"owner {owner!r} generation {generation} was superseded by generation "
                f"{o.generation}"
            )
        if o.released is not None:
            raise FailedPrecondition(
                f"owner {owner!r} generation {generation} released its registration"
            )
        return o
