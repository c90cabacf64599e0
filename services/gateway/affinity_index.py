"""Which workers recently served which leading pages: a bounded LRU map from page keys
(``prefix_keys``) to the places that served them, in one gateway replica's memory.

A place is a worker and the host store it used (``Place``). Workers that report the same store
share its cached prefixes, so a page served on any worker of a node counts for every worker of
that node; a store that restarted reports a new id, and what it held stops matching. The index
forgets the least recently recorded pages past ``capacity`` and keeps the ``holders`` most
recent places per page. It is a guess that a prefix is still cached: the store evicts on its own
terms and checks the tokens on admission, so a stale entry costs a misrouted request's hit, never
a wrong answer. Each replica learns only from the requests it routed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """A worker and the host store whose cached prefixes it imports (``""``: none; then only
    the worker itself counts as holding what it served)."""

    address: str
    store_id: str = ""

    def shares_with(self, other: Place) -> bool:
        """Whether a prefix ``other`` served is likely cached for this worker: the same store,
        or, without a store, the same worker."""
        if self.store_id:
            return self.store_id == other.store_id
        return self.address == other.address and not other.store_id


@dataclass(frozen=True)
class Matched:
    """A worker's leading pages of a query: ``pages`` that its node likely holds, of which the
    worker itself served the first ``own_pages``."""

    pages: int = 0
    own_pages: int = 0


class AffinityIndex:
    def __init__(self, capacity: int, holders: int = 4) -> None:
        if capacity < 1 or holders < 1:
            raise ValueError(f"capacity and holders must be >= 1, got {capacity}, {holders}")
        self.capacity = capacity
        self.holders = holders
        self._pages: OrderedDict[int, tuple[Place, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def record(self, keys: Sequence[int], place: Place) -> None:
        """``place`` served (and, once done, left cached) the pages ``keys``: each becomes the
        most recently used, with ``place`` its newest holder."""
        pages = self._pages
        for key in keys:
            held = pages.pop(key, ())
            others = tuple(p for p in held if p.address != place.address)
            pages[key] = (*others[-(self.holders - 1) :], place) if self.holders > 1 else (place,)
        while len(pages) > self.capacity:
            pages.popitem(last=False)

    def match(self, keys: Sequence[int], places: Sequence[Place]) -> dict[str, Matched]:
        """For each of ``places``: how many of the leading ``keys`` its node likely holds, and
        how many the worker itself served. A read: nothing becomes more recent."""
        pages = {p.address: 0 for p in places}
        own = dict(pages)
        live = list(places)
        own_live = {p.address for p in places}
        for i, key in enumerate(keys):
            held = self._pages.get(key)
            if not held or not live:
                break
            live = [p for p in live if any(p.shares_with(h) for h in held)]
            for p in live:
                pages[p.address] = i + 1
                if p.address in own_live and p in held:
                    own[p.address] = i + 1
                else:
                    own_live.discard(p.address)
        return {a: Matched(pages[a], own[a]) for a in pages}
