"""Which workers recently served which leading pages: a bounded LRU map from page keys
(``prefix_keys``) to the places that served them, in one gateway replica's memory.

A place is a worker and the host store it used (``Place``). Workers that report the same store
share its cached prefixes, so a page served on any worker of a node counts for every worker of
that node; a store that restarted reports a new id, and what it held stops matching. Keys chain,
so a node that served page i of a query served its pages before i too: a match reaches the
deepest page a node served. The index forgets the least recently recorded pages past
``capacity``, a chain's deepest first, and keeps the ``holders`` most recent places per page.
It is a guess that a prefix is still cached: the store evicts on its own
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

    @property
    def node(self) -> str:
        """What shares the prefixes it served: its store's workers, or without a store the
        worker alone."""
        return f"store:{self.store_id}" if self.store_id else f"worker:{self.address}"


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
        # bumped by every record: a match made at one version holds until the next
        self.version = 0

    def __len__(self) -> int:
        return len(self._pages)

    def record(self, keys: Sequence[int], place: Place) -> None:
        """``place`` served (and left cached) the chain of pages ``keys``: each gets ``place``
        as its newest holder and becomes recently used, the first page most recently, so that
        the index forgets a chain's deepest pages first (the ones fewest prompts share)."""
        pages = self._pages
        self.version += 1
        for key in reversed(keys):
            held = pages.pop(key, ())
            others = tuple(p for p in held if p.address != place.address)
            pages[key] = (*others[len(others) - self.holders + 1 :], place)
        while len(pages) > self.capacity:
            pages.popitem(last=False)

    def match(self, keys: Sequence[int], places: Sequence[Place]) -> dict[str, Matched]:
        """For each of ``places``: the leading ``keys`` its node likely holds — up to the
        deepest page one of its node's workers served (a store holds a chain's pages from the
        first on) — and those up to the deepest the worker itself served. A read: nothing
        becomes more recent. Probes from the last key back, so a long hit costs few probes."""
        nodes = {p.node for p in places}
        own = set(places)
        node_pages: dict[str, int] = {}
        own_pages: dict[Place, int] = {}
        for i in range(len(keys) - 1, -1, -1):
            if not nodes and not own:
                break
            for h in self._pages.get(keys[i], ()):
                if h.node in nodes:
                    nodes.discard(h.node)
                    node_pages[h.node] = i + 1
                if h in own:
                    own.discard(h)
                    own_pages[h] = i + 1
        return {p.address: Matched(node_pages.get(p.node, 0), own_pages.get(p, 0)) for p in places}
