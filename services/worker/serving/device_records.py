"""Cached prefixes on the device: records of device pages named by their pages' chained hashes
(``kv_host_store.prefix_index``), least recently used first.

A record holds its pages (``hold``: the pools count it as one more holder) from ``add`` until
it is dropped (``let_go``): when a newer record holds every one of its pages, or when memory is
short (``evict_one``, least recently used first). What a record is — the rows and index keys of
resident mode (``serving.device_prefix``), the index keys of a hierarchy mode
(``serving.key_records``) — is the caller's; this keeps the index and the order."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from services.kv_host_store.prefix_index import PrefixIndex

R = TypeVar("R")


class DeviceRecords(Generic[R]):
    def __init__(
        self, page_size: int, hold: Callable[[R], None], let_go: Callable[[R], None]
    ) -> None:
        self.index = PrefixIndex(page_size)
        self._hold, self._let_go = hold, let_go
        self._records: OrderedDict[int, R] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    def find(
        self, hashes: Sequence[str], token_ids: Sequence[int], whole: bool = False
    ) -> tuple[R, int] | None:
        """The record holding the longest run of the query's leading pages and that run's
        pages (``PrefixIndex.longest_match``), now the most recently used; None: no page."""
        match = self.index.longest_match(hashes, token_ids, whole=whole)
        if match is None:
            return None
        self._records.move_to_end(match.record)
        return self._records[match.record], match.pages

    def covers(self, hashes: Sequence[str], token_ids: Sequence[int]) -> bool:
        return self.index.covers(hashes, token_ids)

    def add(self, hashes: Sequence[str], token_ids: Sequence[int], record: R) -> None:
        """Keeps ``record`` (its pages held from now on) under its pages' ``hashes``; drops the
        records it holds whole."""
        rid = next(self._ids)
        self._hold(record)
        self.index.add(rid, hashes, token_ids)
        self._records[rid] = record
        for old in self.index.covered_by(rid):
            self._drop(old)

    def evict_one(self) -> bool:
        """Drops the least recently used record (its pages nothing else holds are free
        again); False when there is none."""
        if not self._records:
            return False
        self._drop(next(iter(self._records)))
        self.evictions += 1
        return True

    def _drop(self, rid: int) -> None:
        self.index.remove(rid)
        self._let_go(self._records.pop(rid))
