"""The capacity ledger's contract, for both implementations: the in-process one (with a fake
clock) and the Redis one against a real redis-server (real time, short TTLs)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from services.gateway.ledger import Candidate, Ledger, LedgerUnavailable, LocalLedger, SharedBlock
from services.gateway.redis_ledger import RedisLedger

from .conftest import RedisServer, free_port, ledger_violations

CAP = 1000
TTL = 0.3  # seconds; the Redis ledger counts real (server) time


@dataclass
class Subject:
    ledger: Ledger
    advance: Callable[[float], Awaitable[None]]  # lets time pass
    # the invariant, read from the ledger's own state (within capacity: no lease was settled)
    check: Callable[..., Awaitable[None]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def local_violations(local: LocalLedger, within_capacity: bool = True) -> list[str]:
    """``ledger_violations`` for the in-process ledger's state."""
    out = []
    for name, w in local._workers.items():
        naming: dict[str, int] = {}
        for held in w.leases.values():
            for b in held.blocks:
                naming[b.key] = naming.get(b.key, 0) + 1
        own = sum(held.private for held in w.leases.values())
        counted = own + sum(size for _, size in w.blocks.values())
        cap = w.capacity_bytes if within_capacity else counted
        if not 0 <= w.admitted_bytes == counted <= cap:
            out.append(f"{name}: admitted {w.admitted_bytes}, counted {counted}")
        if naming != {k: n for k, (n, _) in w.blocks.items()}:
            out.append(f"{name}: blocks {w.blocks}, named {naming}")
        if w.usage().shared_bytes != counted - own:
            out.append(f"{name}: shared {w.usage().shared_bytes}, counted {counted - own}")
    return out


@pytest.fixture(params=["local", "redis"])
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    if request.param == "local":
        clock = FakeClock()
        local = LocalLedger(clock)

        async def advance(s: float) -> None:
            clock.now += s

        async def check(within_capacity: bool = True) -> None:
            assert local_violations(local, within_capacity) == []

        yield Subject(local, advance, check)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    ledger = RedisLedger(server.url, prefix=server.prefix(), max_connections=8)
    r = aioredis.Redis.from_url(server.url, decode_responses=True)

    async def sleep(s: float) -> None:
        await asyncio.sleep(s)

    async def check_redis(within_capacity: bool = True) -> None:
        for w in ("a", "b"):
            assert await ledger_violations(r, ledger.prefix, w, within_capacity) == []

    try:
        yield Subject(ledger, sleep, check_redis)
    finally:
        await ledger.close()
        await r.aclose()


async def test_admits_up_to_capacity_exactly(subject: Subject) -> None:
    ledger = subject.ledger
    usage = await ledger.register("a", CAP, 0)
    assert (usage.capacity_bytes, usage.admitted_bytes, usage.sessions) == (CAP, 0, 0)
    got = await ledger.acquire("l1", [Candidate("a", 600)], TTL * 100)
    assert got is not None and got.worker == "a" and got.usage.admitted_bytes == 600
    assert await ledger.acquire("l2", [Candidate("a", 401)], TTL * 100) is None
    got = await ledger.acquire("l3", [Candidate("a", 400)], TTL * 100)  # 600 + 400 == CAP
    assert got is not None and got.usage.free_bytes == 0 and got.usage.sessions == 2
    assert await ledger.acquire("l4", [Candidate("a", 1)], TTL * 100) is None
    await subject.check()
    assert await ledger.release("a", "l1")
    assert not await ledger.release("a", "l1")  # idempotent
    assert not await ledger.release("a", "never")
    assert (await ledger.usage(["a", "nobody"]))["a"].admitted_bytes == 400
    assert "nobody" not in await ledger.usage(["a", "nobody"])
    await subject.check()


async def test_first_candidate_with_room_wins(subject: Subject) -> None:
    ledger = subject.ledger
    await ledger.register("a", CAP, 0)
    await ledger.register("b", CAP, 0)
    assert (await ledger.acquire("x", [Candidate("a", 900)], 30)).worker == "a"  # type: ignore[union-attr]
    # "a" has no room for 200, "ghost" is not registered: "b" takes it.
    cands = [Candidate("ghost", 1), Candidate("a", 200), Candidate("b", 200)]
    assert (await ledger.acquire("y", cands, 30)).worker == "b"  # type: ignore[union-attr]
    # Needs may differ per worker (another mode or model config).
    assert (await ledger.acquire("z", [Candidate("a", 100), Candidate("b", 1)], 30)).worker == "a"  # type: ignore[union-attr]
    assert await ledger.acquire("w", [], 30) is None
    await subject.check()


async def test_a_group_of_candidates_takes_its_least_admitted_member_with_room(
    subject: Subject,
) -> None:
    """The ranks of a data-parallel worker are one choice: the ledger takes the one with room
    whose capacity is least admitted (ties: the first), so concurrent admissions spread."""
    ledger = subject.ledger
    await ledger.register("a", CAP, 0)
    await ledger.register("b", 2 * CAP, 0)
    group = [Candidate("a", 300, "g"), Candidate("b", 300, "g")]
    picks = [(await ledger.acquire(f"l{i}", group, 30)).worker for i in range(5)]  # type: ignore[union-attr]
    # shares after each: a .3; b .15; b .3; a .6 (a tie: the first); b .45
    assert picks == ["a", "b", "b", "a", "b"]
    # the least admitted member ("b") has no room for what it needs: the other takes it
    roomy = [Candidate("a", 300, "g"), Candidate("b", 1200, "g")]
    assert (await ledger.acquire("m", roomy, 30)).worker == "a"  # type: ignore[union-attr]
    # no member has room: the next choice is tried
    full = [Candidate("a", 500, "g"), Candidate("b", 1200, "g"), Candidate("b", 1)]
    got = await ledger.acquire("n", full, 30)
    assert got is not None and got.worker == "b" and got.usage.admitted_bytes == 901
    usage = await ledger.usage(["a", "b"])
    assert (usage["a"].admitted_bytes, usage["b"].admitted_bytes) == (900, 901)
    await subject.check()


async def test_session_limit(subject: Subject) -> None:
    ledger = subject.ledger
    await ledger.register("a", CAP, 2)
    assert await ledger.acquire("1", [Candidate("a", 1)], 30)
    assert await ledger.acquire("2", [Candidate("a", 1)], 30)
    assert await ledger.acquire("3", [Candidate("a", 1)], 30) is None
    await ledger.release("a", "1")
    assert await ledger.acquire("3", [Candidate("a", 1)], 30)


async def test_expired_leases_are_reclaimed_and_renewal_keeps_them(subject: Subject) -> None:
    ledger = subject.ledger
    await ledger.register("a", CAP, 0)
    assert await ledger.acquire("kept", [Candidate("a", 500)], TTL)
    assert await ledger.acquire("dropped", [Candidate("a", 500)], TTL)
    for _ in range(3):
        await subject.advance(TTL * 0.6)
        assert await ledger.renew("a", ["kept"], TTL) == []
    # "dropped" expired: the next acquire reclaims it first, and a renewal reports it lost.
    assert await ledger.acquire("new", [Candidate("a", 500)], TTL * 100)
    assert await ledger.renew("a", ["kept", "dropped"], TTL) == ["dropped"]
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == CAP
    await subject.advance(TTL * 1.5)
    # Registering (every poll) reclaims too.
    assert (await ledger.register("a", CAP, 0)).admitted_bytes == 500
    assert not await ledger.release("a", "kept")
    assert await ledger.release("a", "new")
    await subject.check()


async def test_dead_worker_leases_are_released_only_past_the_grace(subject: Subject) -> None:
    ledger = subject.ledger
    await ledger.register("a", CAP, 0)
    assert await ledger.acquire("1", [Candidate("a", 300)], 60)
    assert await ledger.acquire("2", [Candidate("a", 300)], 60)
    assert await ledger.release_dead_worker("a", TTL) is None  # seen just now
    await subject.advance(TTL * 1.5)
    assert await ledger.release_dead_worker("a", TTL) == 2
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 0
    assert not await ledger.release("a", "1")
    assert await ledger.release_dead_worker("nobody", TTL) == 0
    await subject.check()


@pytest.mark.parametrize("settles", [False, True])
async def test_concurrent_acquire_release_never_exceeds_capacity(
    subject: Subject, settles: bool
) -> None:
    """Many tasks race for two workers, naming shared blocks; the invariant is checked while
    they run. With ``settles`` some leases settle on fewer blocks than they named: the bytes
    add up still, though a settled block counted twice may pass the capacity."""
    ledger = subject.ledger
    await ledger.register("a", CAP, 0)
    await ledger.register("b", CAP // 2, 3)
    rng = random.Random(0)
    admitted = refused = 0
    stop = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal admitted, refused
        for j in range(15):
            need = rng.randint(50, 400)
            # a leading run of one of two prefixes' pages, each 20 bytes, shared
            keys = [f"p{rng.randint(0, 1)}k{n}" for n in range(rng.randint(0, 2))]
            shared = tuple(SharedBlock(k, 20) for k in keys)
            order = [Candidate("a", need, shared=shared), Candidate("b", need, shared=shared)]
            rng.shuffle(order)
            got = await ledger.acquire(f"{i}-{j}", order, 30)
            refused += got is None
            if got is not None:
                admitted += 1
                await asyncio.sleep(rng.random() * 0.005)
                if settles and shared and rng.random() < 0.3:  # shared fewer than named
                    await ledger.settle(got.worker, f"{i}-{j}", len(shared) - 1)
                assert await ledger.release(got.worker, f"{i}-{j}")

    async def monitor() -> None:
        while not stop.is_set():
            await subject.check(not settles)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(monitor())
    await asyncio.gather(*(client(i) for i in range(24)))
    stop.set()
    await watcher
    assert admitted > 0 and refused > 0  # capacity did bind
    usage = await ledger.usage(["a", "b"])
    assert usage["a"].admitted_bytes == usage["b"].admitted_bytes == 0
    await subject.check()


async def test_a_block_shared_by_live_leases_counts_once(subject: Subject) -> None:
    """Two leases naming the same blocks hold their bytes once; the bytes return with the last
    lease that names them, and a block no live lease names is paid again."""
    ledger = subject.ledger
    await ledger.register("a", CAP, 0)
    k1, k2, k3 = SharedBlock("k1", 150), SharedBlock("k2", 100), SharedBlock("k3", 70)
    got = await ledger.acquire("A", [Candidate("a", 600, shared=(k1, k2))], 30)
    assert got is not None and got.usage.admitted_bytes == 600
    # B needs 650, 250 of it in A's blocks: 400 more
    got = await ledger.acquire("B", [Candidate("a", 650, shared=(k1, k2))], 30)
    assert got is not None and got.usage.admitted_bytes == 1000
    assert got.usage.shared_bytes == 250
    assert await ledger.acquire("C", [Candidate("a", 1, shared=())], 30) is None
    await subject.check()
    assert await ledger.release("a", "A")  # its own 350 return; the blocks are B's now
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 650
    # k1 is named, k3 is not: 500 - 150 = 350 more
    got = await ledger.acquire("D", [Candidate("a", 500, shared=(k1, k3))], 30)
    assert got is not None and got.usage.admitted_bytes == 1000
    await subject.check()
    assert await ledger.release("a", "B")  # its 400 and k2 (no one else names it)
    usage = (await ledger.usage(["a"]))["a"]
    assert (usage.admitted_bytes, usage.shared_bytes) == (500, 220)
    assert await ledger.release("a", "D")
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 0
    await subject.check()


async def test_settling_moves_the_blocks_a_worker_did_not_share_into_the_lease(
    subject: Subject,
) -> None:
    ledger = subject.ledger
    await ledger.register("a", 2 * CAP, 0)
    k1, k2 = SharedBlock("k1", 150), SharedBlock("k2", 100)
    assert await ledger.acquire("A", [Candidate("a", 600, shared=(k1, k2))], 30)
    assert await ledger.acquire("B", [Candidate("a", 600, shared=(k1, k2))], 30)
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 950
    # B's worker shared k1 only: k2's 100 bytes are B's own as well as A's block
    assert await ledger.settle("a", "B", 1)
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 1050
    assert await ledger.settle("a", "B", 1)  # idempotent
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 1050
    await subject.check()
    assert await ledger.release("a", "A")  # 350 of its own and k2: B names only k1
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 600
    assert await ledger.settle("a", "B", 0)  # nothing shared after all: all 600 its own
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 600
    assert not await ledger.settle("a", "gone", 0)
    await subject.check()
    # an expired lease's blocks return with it
    assert await ledger.acquire("E", [Candidate("a", 300, shared=(k2,))], TTL)
    assert await ledger.acquire("F", [Candidate("a", 300, shared=(k2,))], TTL * 100)
    assert (await ledger.usage(["a"]))["a"].admitted_bytes == 1100
    await subject.advance(TTL * 1.5)
    assert (await ledger.register("a", 2 * CAP, 0)).admitted_bytes == 900
    await subject.check()


def test_a_candidate_names_distinct_blocks_within_its_need() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Candidate("a", 100, shared=(SharedBlock("k", 1), SharedBlock("k", 1)))
    with pytest.raises(ValueError, match="exceed"):
        Candidate("a", 100, shared=(SharedBlock("k", 101),))
    with pytest.raises(ValueError, match="key"):
        SharedBlock("a:b", 1)


async def test_redis_keys_are_namespaced(redis_server: RedisServer) -> None:
    prefix = redis_server.prefix()
    ledger = RedisLedger(redis_server.url, prefix=prefix)
    other = RedisLedger(redis_server.url, prefix=redis_server.prefix())
    r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await ledger.register("10.0.0.1:50051", CAP, 0)
        await ledger.acquire("l", [Candidate("10.0.0.1:50051", 10)], 30)
        keys = sorted(await r.keys(f"{prefix}:*"))
        assert keys == [
            f"{prefix}:expiry:10.0.0.1:50051",
            f"{prefix}:leases:10.0.0.1:50051",
            f"{prefix}:worker:10.0.0.1:50051",
        ]
        assert all([await r.pttl(k) > 0 for k in keys])  # a retired worker's keys go away
        # Another prefix is another ledger.
        assert await other.usage(["10.0.0.1:50051"]) == {}
    finally:
        await ledger.close()
        await other.close()
        await r.aclose()


async def test_unreachable_redis_is_ledger_unavailable() -> None:
    ledger = RedisLedger(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    try:
        with pytest.raises(LedgerUnavailable):
            await ledger.register("a", CAP, 0)
    finally:
        await ledger.close()
