"""The KV state of a worker: payload (mode-specific), index keys and token rings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.kv.backend import PayloadBackend
from services.worker.kv.index_keys import IndexKeys
from services.worker.kv.resident import ResidentPayload
from services.worker.kv.token_ring import TokenRing
from services.worker.model.config import ModelConfig

MODES = ("resident",)


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes of the KV pools by class (eq. 3): required + optional + reserve + free = capacity."""

    capacity: int
    required: int
    optional: int
    reserve: int
    free: int


@dataclass(frozen=True)
class KVCacheConfig:
    mode: str = "resident"
    kv_pool_bytes: int = 256 << 20
    page_size: int = 16
    max_slots: int = 32
    max_model_len: int = 8192
    ring_extra: int = 8  # verification block rows kept beyond window/group (K_max)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def bytes_per_token(cfg: ModelConfig, elem_bytes: int) -> float:
    """Device payload + index-key bytes one token adds in resident serving."""
    payload = sum(cfg.d_kv * elem_bytes / s.compress for s in cfg.sources)
    keys = sum(
        cfg.d_index * elem_bytes / cfg.sources[cfg.layers[i].source].compress
        for i in cfg.index_producers
    )
    return payload + keys


class KVCache:
    """Everything a worker keeps per slot for attention: ``payload`` (where rows live: the
    mode), ``index_keys`` (always resident) and one ``TokenRing`` per source that has a local
    window or compression."""

    def __init__(self, model_cfg: ModelConfig, cfg: KVCacheConfig) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"unknown serving mode {cfg.mode!r}; choose from {MODES}")
        self.model_cfg = model_cfg
        self.cfg = cfg
        esize = torch.empty((), dtype=cfg.dtype).element_size()
        self.rings: dict[int, TokenRing] = {}
        for s, src in enumerate(model_cfg.sources):
            if src.window > 0 or src.compress > 1:
                ring = max(src.window, src.compress) + cfg.ring_extra
                self.rings[s] = TokenRing(
                    cfg.max_slots, ring, model_cfg.d_kv, cfg.dtype, cfg.device
                )
        fixed = sum(r.nbytes for r in self.rings.values())
        if fixed >= cfg.kv_pool_bytes:
            raise ValueError(
                f"kv pool of {cfg.kv_pool_bytes} B cannot hold the token rings ({fixed} B)"
            )
        self.tokens_capacity = int((cfg.kv_pool_bytes - fixed) // bytes_per_token(model_cfg, esize))
        args = (
            self.tokens_capacity,
            cfg.page_size,
            cfg.max_slots,
            cfg.max_model_len,
            cfg.dtype,
            cfg.device,
        )
        self.index_keys = IndexKeys(model_cfg, *args)
        self.payload: PayloadBackend = ResidentPayload(model_cfg, *args)

    @property
    def mode(self) -> str:
        return self.payload.mode

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        return self.payload.can_ensure(slot, num_tokens) and self.index_keys.can_ensure(
            slot, num_tokens
        )

    def ensure(self, slot: int, num_tokens: int) -> bool:
        """Room for a slot's first ``num_tokens`` tokens in every pool, or no change at all."""
        if not self.can_ensure(slot, num_tokens):
            return False
        ok = self.payload.ensure(slot, num_tokens) and self.index_keys.ensure(slot, num_tokens)
        assert ok
        return True

    def release(self, slot: int) -> None:
        self.payload.release(slot)
        self.index_keys.release(slot)
        for r in self.rings.values():
            r.clear(slot)

    def memory(self) -> MemoryUsage:
        pools = [*self.payload.pools, *self.index_keys.pools.values()]  # type: ignore[attr-defined]
        required = sum(r.nbytes for r in self.rings.values()) + sum(p.used_bytes for p in pools)
        capacity = self.cfg.kv_pool_bytes
        return MemoryUsage(capacity, required, 0, 0, max(0, capacity - required))

    @property
    def nbytes(self) -> int:
        rings = sum(r.nbytes for r in self.rings.values())
        return self.payload.nbytes + self.index_keys.nbytes + rings
