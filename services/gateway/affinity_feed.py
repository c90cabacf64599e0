"""Prefix-affinity records shared by every gateway replica through one Redis stream.

Each replica's index (``affinity_index``) learns from the requests it routed; behind a load
balancer that is only its share of a conversation's turns, so a turn routed by another replica
would miss the node that holds its history. The feed makes the replicas' indexes one: every
record (a chain of page keys and the place that served it) is appended to the stream
``{prefix}:affinity``, trimmed to about ``max_entries`` records, and each replica's reader
applies the others' records to its own index as they arrive. A replica that starts applies the
stream's retained records first, so it routes like the others from its first request.

Routing still reads memory only: no Redis round trip on a request's path. A record reaches the
other replicas within one blocking read. While Redis is unreachable, records are dropped (the
first failure of an outage is logged) and every replica routes by what it knows; the index is a
guess anyway (a stale or missing entry costs a hit, never a wrong answer)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.gateway.affinity_index import AffinityIndex, Place

log = logging.getLogger(__name__)

# How long a reader blocks on the stream before it reads again (and notices a close).
BLOCK_MS = 1000
# Records waiting to be appended; past this a burst drops records instead of queueing them.
SEND_QUEUE = 1024


@dataclass(frozen=True)
class Record:
    """One chain of page keys served (and left cached) at ``place``."""

    keys: tuple[int, ...]
    place: Place

    def fields(self, replica: str) -> dict[bytes, bytes]:
        return {
            b"r": replica.encode(),
            b"a": self.place.address.encode(),
            b"s": self.place.store_id.encode(),
            b"k": np.asarray(self.keys, dtype="<u8").tobytes(),
        }

    @classmethod
    def parse(cls, fields: dict[bytes, bytes]) -> tuple[str, Record]:
        """(the replica that sent it, the record)."""
        keys = tuple(int(k) for k in np.frombuffer(fields[b"k"], dtype="<u8"))
        place = Place(fields[b"a"].decode(), fields[b"s"].decode())
        return fields[b"r"].decode(), cls(keys, place)


@dataclass
class FeedStats:
    """Cumulative counters, read by metrics and tests."""

    sent: int = 0  # this replica's records appended
    applied: int = 0  # other replicas' records applied to the index
    dropped: int = 0  # records not appended (queue full, or Redis unreachable)


class AffinityFeed:
    def __init__(
        self,
        url: str,
        index: AffinityIndex,
        *,
        prefix: str,
        max_entries: int = 4096,
        count: Callable[[str], None] | None = None,
    ) -> None:
        """``index``: this replica's, which the reader fills; ``prefix``: the deployment's
        Redis namespace (the ledger's); ``max_entries``: the records the stream retains;
        ``count``: told each record's outcome (``sent``, ``applied``, ``dropped``), beside
        ``stats``."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.stream = f"{prefix}:affinity"
        self.index = index
        self.max_entries = max_entries
        self.replica = uuid.uuid4().hex
        self.redis = aioredis.Redis.from_url(url, decode_responses=False)
        self.stats = FeedStats()
        self.count = count
        self._queue: asyncio.Queue[Record] = asyncio.Queue(SEND_QUEUE)
        self._tasks: list[asyncio.Task] = []
        self._down = False  # the last Redis call failed: the next failure is not logged

    def publish(self, keys: Sequence[int], place: Place) -> None:
        """Appends a record this replica made (already in its own index) to the stream, in
        the background."""
        if not keys:
            return
        try:
            self._queue.put_nowait(Record(tuple(keys), place))
        except asyncio.QueueFull:
            self._count("dropped")

    async def start(self) -> None:
        """Applies the retained records, then reads and sends in the background."""
        last = await self._catch_up()
        self._tasks = [
            asyncio.create_task(self._read(last), name="affinity-feed-reader"),
            asyncio.create_task(self._send(), name="affinity-feed-sender"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.redis.aclose()

    async def _catch_up(self) -> bytes:
        """Applies every retained record (of any replica: this one is new); the id to read
        on from (``$``-like: the newest, or the start of an empty stream)."""
        try:
            entries = await self.redis.xrange(self.stream, "-", "+")
        except RedisError as e:
            self._failed(e)
            return b"$"
        self._apply(entries, skip_own=False)
        return entries[-1][0] if entries else b"0-0"

    async def _read(self, last: bytes) -> None:
        while True:
            try:
                got = await self.redis.xread({self.stream: last}, block=BLOCK_MS)
            except RedisError as e:
                self._failed(e)
                await asyncio.sleep(BLOCK_MS / 1000)
                continue
            self._up()
            for _, entries in got:
                if entries:
                    self._apply(entries, skip_own=True)
                    last = entries[-1][0]

    async def _send(self) -> None:
        while True:
            record = await self._queue.get()
            try:
                await self.redis.xadd(
                    self.stream, record.fields(self.replica), maxlen=self.max_entries,
                    approximate=True,
                )  # fmt: skip
            except RedisError as e:
                self._count("dropped")
                self._failed(e)
                continue
            self._up()
            self._count("sent")

    def _apply(self, entries: list, skip_own: bool) -> None:
        for _, fields in entries:
            try:
                replica, record = Record.parse(fields)
            except (KeyError, ValueError, UnicodeDecodeError):
                log.warning("affinity feed: skipped a malformed record in %s", self.stream)
                continue
            if skip_own and replica == self.replica:
                continue
            self.index.record(record.keys, record.place)
            self._count("applied")

    def _count(self, outcome: str) -> None:
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        if self.count is not None:
            self.count(outcome)

    def _failed(self, e: Exception) -> None:
        if not self._down:
            log.warning("affinity feed %s unavailable: %s; routing by this replica's own records",
                        self.stream, e)  # fmt: skip
        self._down = True

    def _up(self) -> None:
        if self._down:
            log.info("affinity feed %s available again", self.stream)
        self._down = False
