"""The capacity ledger in Redis, shared by every gateway replica (contract: ``ledger.Ledger``;
key layout and scripts: ``ledger_scripts``).

Connections come from a *blocking* pool of ``max_connections``: past that, callers wait for a
free connection instead of failing (redis-py's default pool allows 100 and then raises). Redis
errors surface as ``LedgerUnavailable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.gateway import ledger_scripts as lua
from services.gateway.ledger import (
    Admitted,
    Candidate,
    LedgerUnavailable,
    SharedBlock,
    WorkerUsage,
)

# A worker's keys outlive the last write by this long: long enough for any gateway that still
# serves it to touch them again (every poll does), short enough to clean up a retired worker.
KEY_IDLE_TTL_MS = 3600 * 1000


def _usage(values: Sequence[Any]) -> WorkerUsage:
    capacity, max_sessions, admitted, sessions, shared = (int(v) for v in values)
    return WorkerUsage(capacity, max_sessions, admitted, sessions, shared)


class RedisLedger:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "dhisparse:ledger",
        max_connections: int = 16,
        timeout_s: float = 5.0,
    ) -> None:
        self.prefix = prefix
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self._register = self.redis.register_script(lua.REGISTER)
        self._acquire = self.redis.register_script(lua.ACQUIRE)
        self._renew = self.redis.register_script(lua.RENEW)
        self._release = self.redis.register_script(lua.RELEASE)
        self._settle = self.redis.register_script(lua.SETTLE)
        self._release_dead = self.redis.register_script(lua.RELEASE_DEAD)
        self._usage = self.redis.register_script(lua.USAGE)

    def keys(self, worker: str) -> tuple[str, str, str, str, str]:
        """(capacity hash, leases hash, expiry zset, blocks hash, named hash) of ``worker``."""
        p = self.prefix
        return (
            f"{p}:worker:{worker}", f"{p}:leases:{worker}", f"{p}:expiry:{worker}",
            f"{p}:blocks:{worker}", f"{p}:named:{worker}",
        )  # fmt: skip

    async def _call(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await script(keys=list(keys), args=list(args))
        except RedisError as e:
            raise LedgerUnavailable(f"redis: {type(e).__name__}: {e}") from e

    async def register(self, worker: str, capacity_bytes: int, max_sessions: int) -> WorkerUsage:
        out = await self._call(
            self._register, self.keys(worker), [capacity_bytes, max_sessions, KEY_IDLE_TTL_MS]
        )
        return _usage(out)

    async def acquire(
        self, lease_id: str, candidates: Sequence[Candidate], ttl_s: float
    ) -> Admitted | None:
        if not candidates:
            return None
        keys = [k for c in candidates for k in self.keys(c.worker)]
        args = [lease_id, _ms(ttl_s), KEY_IDLE_TTL_MS, *(c.private_bytes for c in candidates)]
        args += [c.group for c in candidates]
        args += [_blocks(c.shared) for c in candidates]
        out = await self._call(self._acquire, keys, args)
        i = int(out[0])
        return Admitted(candidates[i - 1].worker, _usage(out[1:])) if i else None

    async def renew(self, worker: str, lease_ids: Sequence[str], ttl_s: float) -> list[str]:
        if not lease_ids:
            return []
        args = [_ms(ttl_s), KEY_IDLE_TTL_MS, *lease_ids]
        return list(await self._call(self._renew, self.keys(worker), args))

    async def release(self, worker: str, lease_id: str) -> bool:
        return bool(await self._call(self._release, self.keys(worker), [lease_id]))

    async def settle(self, worker: str, lease_id: str, kept: int) -> bool:
        return bool(await self._call(self._settle, self.keys(worker), [lease_id, max(0, kept)]))

    async def release_dead_worker(self, worker: str, dead_after_s: float) -> int | None:
        n = int(await self._call(self._release_dead, self.keys(worker), [_ms(dead_after_s)]))
        return None if n < 0 else n

    async def usage(self, workers: Sequence[str]) -> dict[str, WorkerUsage]:
        if not workers:
            return {}
        keys = [k for w in workers for k in self.keys(w)[:2]]
        out = await self._call(self._usage, keys, [])
        return {w: _usage(row[1:]) for w, row in zip(workers, out, strict=True) if int(row[0])}

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()


def _blocks(blocks: Sequence[SharedBlock]) -> str:
    """``key:bytes,...``, as the scripts read them."""
    return ",".join(f"{b.key}:{b.bytes}" for b in blocks)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
