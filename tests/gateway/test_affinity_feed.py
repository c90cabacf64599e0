"""The prefix-affinity feed (``services/gateway/affinity_feed.py``) over a real Redis: one
replica's records reach another's index, a replica that starts applies what the stream
retains, the stream stays trimmed, and a Redis that is gone costs records, never an error."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.gateway.affinity_feed import AffinityFeed
from services.gateway.affinity_index import AffinityIndex, Place
from tests.conftest import free_port
from tests.gateway.conftest import RedisServer, until


def chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def holds(index: AffinityIndex, keys: list[int], place: Place) -> bool:
    """Whether ``index`` has ``place``'s node holding the whole chain ``keys``."""
    return index.match(keys, [place])[place.address].pages == len(keys)


async def test_a_replicas_records_reach_the_other_replicas_index(redis_server: RedisServer):
    rng = random.Random(3)
    prefix = redis_server.prefix()
    a_index, b_index = AffinityIndex(1000), AffinityIndex(1000)
    a = AffinityFeed(redis_server.url, a_index, prefix=prefix)
    b = AffinityFeed(redis_server.url, b_index, prefix=prefix)
    await a.start()
    await b.start()
    try:
        node0, node1 = Place("w0:1", "store-a"), Place("w1:1", "store-b")
        one, two = chain(rng, 40), chain(rng, 7)
        a_index.record(one, node0)
        a.publish(one, node0)
        b_index.record(two, node1)
        b.publish(two, node1)
        await until(lambda: holds(b_index, one, node0) and holds(a_index, two, node1))
        # a worker of the same node (the same store) counts as holding it too
        assert holds(b_index, one, Place("w9:1", "store-a"))
        assert not holds(b_index, one, node1)
        await until(lambda: a.stats.sent == 1 and b.stats.sent == 1)
        assert a.stats.applied == 1 and b.stats.applied == 1  # the other's only
        assert a.stats.dropped == b.stats.dropped == 0
    finally:
        await a.close()
        await b.close()


async def test_a_starting_replica_applies_what_the_stream_retains(redis_server: RedisServer):
    rng = random.Random(4)
    prefix = redis_server.prefix()
    sender = AffinityFeed(redis_server.url, AffinityIndex(1000), prefix=prefix, max_entries=8)
    await sender.start()
    chains = [(chain(rng, 5), Place(f"w{i}:1", f"store-{i}")) for i in range(300)]
    try:
        for keys, place in chains:
            sender.publish(keys, place)
        await until(lambda: sender.stats.sent == len(chains))
        retained = await sender.redis.xlen(sender.stream)
        assert 8 <= retained < 300  # trimmed to about max_entries
        late_index = AffinityIndex(10_000)
        late = AffinityFeed(redis_server.url, late_index, prefix=prefix)
        await late.start()
        try:
            assert late.stats.applied == retained
            assert holds(late_index, *chains[-1])  # the newest are kept
            assert not holds(late_index, *chains[0])  # the oldest trimmed
        finally:
            await late.close()
    finally:
        await sender.close()


async def test_other_deployments_prefixes_are_apart(redis_server: RedisServer):
    rng = random.Random(5)
    index = AffinityIndex(100)
    mine = AffinityFeed(redis_server.url, index, prefix=redis_server.prefix())
    other = AffinityFeed(redis_server.url, AffinityIndex(100), prefix=redis_server.prefix())
    await mine.start()
    await other.start()
    try:
        keys, place = chain(rng, 3), Place("w:1", "s")
        other.publish(keys, place)
        await until(lambda: other.stats.sent == 1)
        await asyncio.sleep(0.2)
        assert not holds(index, keys, place) and mine.stats.applied == 0
    finally:
        await mine.close()
        await other.close()


async def test_a_redis_that_is_gone_drops_records_and_raises_nothing() -> None:
    index = AffinityIndex(100)
    feed = AffinityFeed(f"redis://127.0.0.1:{free_port()}/0", index, prefix="gone")
    await feed.start()  # the catch-up fails: it starts with nothing
    try:
        feed.publish([1, 2, 3], Place("w:1", "s"))
        await until(lambda: feed.stats.dropped == 1)
        assert feed.stats.sent == 0 and len(index) == 0
    finally:
        await feed.close()


def test_a_feed_needs_room_for_a_record() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        AffinityFeed("redis://127.0.0.1:1/0", AffinityIndex(10), prefix="p", max_entries=0)
