"""Admission by memory across gateway replicas, all real processes: a redis-server, two workers
with a 1 MiB KV pool each (four sessions of 112 tokens), and `dhisparse gateway` replicas
sharing the Redis ledger.

Checked against the ledger itself (read from Redis in one MULTI per worker, every few ms):
never more admitted than a worker's capacity; nothing leaked after clients disconnect or a
gateway is SIGKILLed (its leases expire with their TTL); 429 exactly when the queue is full and
503 exactly when the deadline passes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import redis.asyncio as aioredis

from dhisparse import metrics as names
from dhisparse.capacity import profile_from_model_config, required_bytes
from dhisparse.family.presets import preset_topology
from services.gateway.redis_ledger import RedisLedger

from .conftest import (
    MODEL,
    TIGHT_DEADLINE_S,
    TIGHT_QUEUE,
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    capacity_held,
    kill_process,
    launch_gateway,
    ledger_violations,
    start_gateway,
    wait_gateway,
)

pytestmark = pytest.mark.slow

CAPACITY = 1 << 20  # the small workers' --kv-pool-mib 1
PROFILE = profile_from_model_config(preset_topology(MODEL), page_size=16)
PROMPT = list(range(10, 22))  # 12 token ids


def need(max_tokens: int) -> int:
    return required_bytes(PROFILE, len(PROMPT) + max_tokens, "resident")


def body(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass
class LedgerWatch:
    """Reads every worker's ledger entry in one MULTI each, over and over, and records what it
    saw; ``violations`` lists every state that broke the invariant."""

    redis: aioredis.Redis
    prefix: str
    workers: list[str]
    violations: list[str] = field(default_factory=list)
    most_sessions: dict[str, int] = field(default_factory=dict)
    reads: int = 0

    def keys(self, worker: str) -> tuple[str, str, str]:
        p = self.prefix
        return f"{p}:worker:{worker}", f"{p}:leases:{worker}", f"{p}:expiry:{worker}"

    async def read(self, worker: str) -> tuple[dict[str, str], dict[str, str]]:
        wk, lk, _ = self.keys(worker)
        async with self.redis.pipeline(transaction=True) as p:
            p.hgetall(wk).hgetall(lk)
            info, leases = await p.execute()
        return info, leases

    async def check(self) -> None:
        for w in self.workers:
            self.violations += await ledger_violations(self.redis, self.prefix, w)
            _, leases = await self.read(w)
            self.most_sessions[w] = max(self.most_sessions.get(w, 0), len(leases))
        self.reads += 1

    async def sessions(self, worker: str) -> int:
        return len((await self.read(worker))[1])

    async def expiries(self) -> dict[str, float]:
        """The latest lease expiry (server ms) per worker."""
        out = {}
        for w in self.workers:
            top = await self.redis.zrange(self.keys(w)[2], -1, -1, withscores=True)
            out[w] = top[0][1] if top else 0.0
        return out

    async def admitted(self, worker: str) -> int:
        return int((await self.read(worker))[0].get("admitted", 0))

    async def drained(self) -> bool:
        """No bytes admitted on any worker."""
        return all([await self.admitted(w) == 0 for w in self.workers])

    async def one_session_each(self) -> bool:
        return [await self.sessions(w) for w in self.workers] == [1] * len(self.workers)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[LedgerWatch]:
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await self.check()
                await asyncio.sleep(0.005)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            stop.set()
            await task


async def eventually(
    probe: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.05
) -> float:
    """Seconds until ``await probe()`` is true; fails after ``timeout``."""
    start = time.monotonic()
    while not await probe():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(interval)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def replicas(
    redis_server: RedisServer,
    small_workers: list[WorkerProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[GatewayProcess]]:
    """Two gateways on both small workers, sharing one ledger."""
    prefix = redis_server.prefix()
    args = ["--redis-url", redis_server.url, "--ledger-prefix", prefix]
    args += ["--health-interval-s", "0.5", "--queue-deadline-s", "60"]
    workers = [w.address for w in small_workers]
    logs = [tmp_path_factory.mktemp("replicas") / f"gateway-{i}.log" for i in range(2)]
    gateways = [launch_gateway(workers, log, *args) for log in logs]
    try:
        for gw, log in zip(gateways, logs, strict=True):
            wait_gateway(gw, log)
        yield gateways
    finally:
        for gw in gateways:
            kill_process(gw.proc)


@pytest.fixture
async def watch(
    redis_server: RedisServer, replicas: list[GatewayProcess], small_workers: list[WorkerProcess]
) -> AsyncIterator[LedgerWatch]:
    r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield LedgerWatch(r, replicas[0].ledger_prefix, [w.address for w in small_workers])
    finally:
        await r.aclose()


async def stream_completion(client: httpx.AsyncClient, max_tokens: int) -> list[dict]:
    """A streamed completion to its end: its chunks (the final usage chunk included)."""
    payload = {**body(max_tokens, stream=True), "stream_options": {"include_usage": True}}
    chunks = []
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return chunks
            if line:
                chunks.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError("the stream ended without [DONE]")


async def test_two_replicas_never_admit_beyond_capacity(
    replicas: list[GatewayProcess], watch: LedgerWatch, small_workers: list[WorkerProcess]
) -> None:
    per_worker = CAPACITY // need(100)
    assert per_worker == 4
    clients = [httpx.AsyncClient(base_url=gw.base_url, timeout=120) for gw in replicas]
    try:
        async with watch.watching():
            # Three times what both workers hold, half through each replica, all at once.
            jobs = [stream_completion(clients[i % 2], 100) for i in range(6 * per_worker)]
            results = await asyncio.gather(*jobs)
        for chunks in results:
            assert chunks[-1]["usage"]["completion_tokens"] == 100
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == (
                "length"
            )
    finally:
        for c in clients:
            await c.aclose()
    assert not watch.violations, watch.violations[:5]
    assert watch.reads > 50
    # Capacity did bind: each worker held as many sessions as fit, never more.
    assert watch.most_sessions == {w.address: per_worker for w in small_workers}
    await eventually(watch.drained, timeout=2)  # every lease came back
    # Every admitted request's wait was measured; some waited for capacity.
    counts = [gw.metric(names.ALLOCATION_WAIT + "_count", model=MODEL) or 0 for gw in replicas]
    waits = [gw.metric(names.ALLOCATION_WAIT + "_sum", model=MODEL) or 0 for gw in replicas]
    assert sum(counts) >= 6 * per_worker and sum(waits) > 0
    for gw in replicas:
        assert gw.metric(names.QUEUE_DEPTH, model=MODEL) == 0
        for w in small_workers:
            assert gw.metric(names.FREE_CAPACITY_BYTES, model=MODEL, worker=w.address) is not None


async def test_client_disconnects_release_at_once(
    replicas: list[GatewayProcess],
    watch: LedgerWatch,
    redis_server: RedisServer,
    small_workers: list[WorkerProcess],
) -> None:
    """Mid-stream and while queued: the leases come back long before their TTL (10 s)."""
    gw = replicas[0]
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client, watch.watching():
        async with contextlib.AsyncExitStack() as open_streams:
            readers = []  # held: a line iterator that is collected closes its response
            for _ in range(2):  # one per worker: 312 tokens leave room for no second
                cm = client.stream("POST", "/v1/completions", json=body(300, stream=True))
                r = await open_streams.enter_async_context(cm)
                assert r.status_code == 200
                readers.append(r.aiter_lines())
                for _ in range(3):
                    await anext(readers[-1])
            assert [await watch.sessions(w) for w in watch.workers] == [1, 1]
        # Leaving the block closed both connections mid-stream.
        released = await eventually(watch.drained, timeout=2)
        assert released < 2
    assert all(w.wait_idle(timeout=5) for w in small_workers)

    # A request waiting for capacity whose client gives up leaves the queue.
    workers = [w.address for w in small_workers]
    async with capacity_held(redis_server.url, gw.ledger_prefix, workers):
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body(10))
        await eventually(lambda: _queue_empty(gw), timeout=3)
    assert not watch.violations


async def _queue_empty(gw: GatewayProcess) -> bool:
    return gw.metric(names.QUEUE_DEPTH, model=MODEL) == 0


async def test_a_killed_gateways_leases_expire(
    replicas: list[GatewayProcess],
    watch: LedgerWatch,
    redis_server: RedisServer,
    small_workers: list[WorkerProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """SIGKILL a replica while it streams: its leases stay until their TTL (3 s, renewed every
    second), then a surviving replica's poll reclaims them and the capacity serves again."""
    ttl = 3.0
    args = ["--redis-url", redis_server.url, "--ledger-prefix", replicas[0].ledger_prefix]
    args += ["--lease-ttl-s", str(ttl), "--health-interval-s", "0.5"]
    log = tmp_path_factory.mktemp("doomed") / "gateway.log"
    doomed = start_gateway(watch.workers, log, *args)
    try:
        async with httpx.AsyncClient(base_url=doomed.base_url, timeout=30) as client:

            async def stream_until_killed() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("POST", "/v1/completions", json=body(400, True)) as r:
                        async for _ in r.aiter_lines():
                            pass

            streams = [asyncio.create_task(stream_until_killed()) for _ in range(2)]
            await eventually(watch.one_session_each, timeout=10)
            first = await watch.expiries()
            await asyncio.sleep(1.2)
            renewed = await watch.expiries()
            assert all(renewed[w] > first[w] for w in watch.workers), (first, renewed)
            os.kill(doomed.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.gather(*streams)
        doomed.proc.wait(5)
        async with watch.watching():
            await asyncio.sleep(0.5)
            # The gateway is gone but its leases are not: only the TTL returns them.
            assert [await watch.sessions(w) for w in watch.workers] == [1, 1]
            await eventually(watch.drained, timeout=ttl + 3)
            returned = time.monotonic() - killed
        # The last renewal was under a second before the kill, so expiry came at least
        # TTL - 1 s after it; the surviving replica polls every 0.5 s.
        assert ttl - 1.1 <= returned <= ttl + 2.0, returned
        assert not watch.violations
        assert all(w.wait_idle(timeout=5) for w in small_workers)  # the workers aborted too
        # The capacity serves again: two 412-token sessions (one per worker) start at once.
        async with (
            httpx.AsyncClient(base_url=replicas[0].base_url, timeout=30) as client,
            contextlib.AsyncExitStack() as open_streams,
        ):
            start = time.monotonic()
            for _ in range(2):
                cm = client.stream("POST", "/v1/completions", json=body(400, stream=True))
                r = await open_streams.enter_async_context(cm)
                assert r.status_code == 200
            assert time.monotonic() - start < 2
            assert [await watch.sessions(w) for w in watch.workers] == [1, 1]
    finally:
        kill_process(doomed.proc)


async def test_429_exactly_when_the_queue_is_full_and_503_exactly_at_the_deadline(
    tight_gateway: GatewayProcess, redis_server: RedisServer, small_workers: list[WorkerProcess]
) -> None:
    gw, worker = tight_gateway, small_workers[0].address
    rejected = names.REQUESTS_REJECTED + "_total"
    full = {"model": MODEL, "reason": "queue-full", "status": "429"}
    late = {"model": MODEL, "reason": "deadline", "status": "503"}
    before = (gw.metric(rejected, **full) or 0, gw.metric(rejected, **late) or 0)
    async with (
        capacity_held(redis_server.url, gw.ledger_prefix, [worker]) as ledger,
        httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client,
    ):

        async def timed_post() -> tuple[httpx.Response, float]:
            start = time.monotonic()
            r = await client.post("/v1/completions", json=body(20))
            return r, time.monotonic() - start

        # The queue fills: TIGHT_QUEUE requests wait.
        waiting = [asyncio.create_task(timed_post()) for _ in range(TIGHT_QUEUE)]
        await eventually(lambda: _depth_is(gw, TIGHT_QUEUE), timeout=3)
        # One more is turned away at once.
        r, took = await timed_post()
        assert r.status_code == 429 and took < 1.0
        assert r.headers["retry-after"] == "1"
        assert r.headers["x-dhisparse-reason"] == "queue-full"
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("RateLimitError", 429)
        # The waiting ones get 503 when their deadline passes, not before.
        for r, took in await asyncio.gather(*waiting):
            assert r.status_code == 503, r.text
            assert r.headers["x-dhisparse-reason"] == "deadline"
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            assert TIGHT_DEADLINE_S <= took < TIGHT_DEADLINE_S + 1.0
        # Room in the queue again: a request waits, and capacity that returns before its
        # deadline (another replica releasing) admits it.
        admitted_late = asyncio.create_task(timed_post())
        await eventually(lambda: _depth_is(gw, 1), timeout=3)
        await asyncio.sleep(0.3)
        await ledger.release(worker, f"holder-{worker}")
        r, took = await admitted_late
        assert r.status_code == 200, r.text
        assert 0.3 <= took < TIGHT_DEADLINE_S
    assert gw.metric(rejected, **full) == before[0] + 1
    assert gw.metric(rejected, **late) == before[1] + TIGHT_QUEUE


async def _depth_is(gw: GatewayProcess, depth: int) -> bool:
    return gw.metric(names.QUEUE_DEPTH, model=MODEL) == depth


async def test_no_leases_left_behind(
    redis_server: RedisServer, replicas: list[GatewayProcess], small_workers: list[WorkerProcess]
) -> None:
    """After every test above, the shared ledger holds nothing."""
    ledger = RedisLedger(redis_server.url, prefix=replicas[0].ledger_prefix)
    workers = [w.address for w in small_workers]

    async def empty() -> bool:
        usage = await ledger.usage(workers)
        assert {u.capacity_bytes for u in usage.values()} == {CAPACITY}
        return {(u.sessions, u.admitted_bytes) for u in usage.values()} == {(0, 0)}

    try:
        await eventually(empty, timeout=2)  # releases run in the background
    finally:
        await ledger.close()
