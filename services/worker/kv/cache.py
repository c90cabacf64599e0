"""The KV state of a worker: payload (where rows live: the serving mode), index keys (always
resident) and token rings (local windows and incomplete compression groups)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.kv.backend import PayloadBackend
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.index_keys import IndexKeys
from services.worker.kv.resident import ResidentPayload
from services.worker.kv.token_ring import TokenRing
from services.worker.model.config import ModelConfig

MODES = ("resident", "hisparse", "adaptive")


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
    ring_extra: int = 8  # verification block rows kept beyond window/group/page (K_max)
    hot_cache_rows: int | None = None  # B (hierarchy modes); default 2k
    max_prefill_tokens: int = 16384  # sizes the hierarchy's prefill scratch
    host_arena_bytes: int = 256 << 20  # private arena when no kv_host_store is given
    owner: str = "local"  # worker id the host regions belong to
    resolver: str = "torch"  # torch | triton
    reserve_pages: int = 0  # adaptive: admission reserve M_res, in pages
    populate_pages: int = 256  # adaptive: optional pages refilled per attempt
    reclaim_order: str = "largest"  # adaptive: largest | smallest | oldest | newest
    spec_block: int = 1  # K_max of speculative verification (1: none); sizes staging
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def bytes_per_token(cfg: ModelConfig, elem_bytes: int, payload: bool) -> float:
    """Device bytes one token adds: index keys, plus payload rows when they are resident."""
    keys = sum(
        cfg.d_index * elem_bytes / cfg.sources[cfg.layers[i].source].compress
        for i in cfg.index_producers
    )
    if not payload:
        return keys
    return keys + sum(cfg.d_kv * elem_bytes / s.compress for s in cfg.sources)


class KVCache:
    """Everything a worker keeps per slot for attention: ``payload`` (the mode), ``index_keys``
    and one ``TokenRing`` per source that has a local window or compression.

    ``host`` (hierarchy modes) is the host store: ``(RegionStore, ArenaMapping)``; without one a
    private arena is created in this process."""

    def __init__(
        self, model_cfg: ModelConfig, cfg: KVCacheConfig, host: tuple | None = None
    ) -> None:
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
        self._local_store = None
        self.host_backups = None
        rings = sum(r.nbytes for r in self.rings.values())
        keys_per_token = bytes_per_token(model_cfg, esize, payload=False)
        args = (cfg.page_size, cfg.max_slots, cfg.max_model_len, cfg.dtype, cfg.device)
        if cfg.mode == "resident":
            per_token = bytes_per_token(model_cfg, esize, payload=True)
            if rings >= cfg.kv_pool_bytes:
                raise ValueError(f"a KV pool of {cfg.kv_pool_bytes} B cannot hold the token rings")
            self.tokens_capacity = int((cfg.kv_pool_bytes - rings) // per_token)
            self.index_keys = IndexKeys(model_cfg, self.tokens_capacity, *args)
            self.payload: PayloadBackend = ResidentPayload(model_cfg, self.tokens_capacity, *args)
        else:
            # Index keys for every slot at full length (or half the pool), then pages.
            self.tokens_capacity = int(
                min(cfg.max_slots * cfg.max_model_len, cfg.kv_pool_bytes // 2 // keys_per_token)
            )
            self.index_keys = IndexKeys(model_cfg, self.tokens_capacity, *args)
            self.payload = self._hierarchy(model_cfg, cfg, host, esize, rings)
        self._admitted: set[int] = set()

    @staticmethod
    def hierarchy_fixed_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
        """Allocations of a hierarchy mode that do not grow with sessions: token rings,
        prefill scratch, hot-cache metadata and staging (index keys and pages excluded)."""
        from services.worker.kv.hierarchy.payload import HierarchyPayload

        esize = torch.empty((), dtype=cfg.dtype).element_size()
        rings = 0
        for src in model_cfg.sources:
            if src.window > 0 or src.compress > 1:
                rows = max(src.window, src.compress) + cfg.ring_extra
                rings += cfg.max_slots * rows * model_cfg.d_kv * esize
        p = cfg.page_size
        hot_rows = -(-(cfg.hot_cache_rows or 2 * model_cfg.index_topk) // p) * p
        scratch_tokens = max(cfg.max_prefill_tokens, cfg.max_model_len)
        return (
            rings
            + HierarchyPayload.fixed_bytes(
                model_cfg, cfg.max_slots, cfg.max_model_len, hot_rows, scratch_tokens, esize
            )
            + HierarchyPayload.staging_bytes(model_cfg, cfg.max_slots, cfg.spec_block, esize)
        )

    def _hierarchy(
        self, model_cfg: ModelConfig, cfg: KVCacheConfig, host: tuple | None, esize: int, rings: int
    ) -> PayloadBackend:
        from services.worker.kv.hierarchy.host import HostBackups, LocalHostStore
        from services.worker.kv.hierarchy.payload import HierarchyPayload
        from services.worker.kv.hierarchy.resolver import get_resolver

        p = cfg.page_size
        hot_rows = -(-(cfg.hot_cache_rows or 2 * model_cfg.index_topk) // p) * p
        ring = -(-(p + cfg.ring_extra) // p) * p  # one page plus a verification block
        scratch_tokens = max(cfg.max_prefill_tokens, cfg.max_model_len)
        fixed = (
            rings
            + self.index_keys.nbytes
            + HierarchyPayload.fixed_bytes(
                model_cfg, cfg.max_slots, cfg.max_model_len, hot_rows, scratch_tokens, esize
            )
        )
        page_bytes = p * model_cfg.d_kv * esize
        num_pages = (cfg.kv_pool_bytes - fixed) // page_bytes
        per_request = len(model_cfg.sources) * (hot_rows + ring) // p
        if num_pages < per_request:
            raise ValueError(
                f"a KV pool of {cfg.kv_pool_bytes} B leaves {max(0, num_pages)} pages after fixed "
                f"allocations of {fixed} B; one request needs {per_request} pages of "
                f"{page_bytes} B (hot cache + tail): enlarge the pool or lower max_num_seqs, "
                "max_model_len or the hot cache"
            )
        if host is None:
            self._local_store = LocalHostStore(cfg.host_arena_bytes)
            host = (self._local_store, self._local_store.mapping)
        store, mapping = host
        self.host_backups = HostBackups(
            store, mapping, cfg.owner, len(model_cfg.sources), model_cfg.d_kv, cfg.dtype,
            cfg.max_slots, cfg.device,
        )  # fmt: skip
        return HierarchyPayload(
            model_cfg, self.host_backups, cfg.max_slots, cfg.max_model_len, p, hot_rows, ring,
            scratch_tokens, int(num_pages), cfg.dtype, cfg.device,
            resolver=get_resolver(cfg.resolver, cfg.device), mode=cfg.mode,
            reserve_pages=cfg.reserve_pages, populate_pages=cfg.populate_pages,
            reclaim_order=cfg.reclaim_order, spec_block=cfg.spec_block,
        )  # fmt: skip

    @property
    def mode(self) -> str:
        return self.payload.mode

    # ---- slots ------------------------------------------------------------------------------
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

    def admit(self, slot: int, request_id: str, num_tokens: int, max_tokens: int) -> bool:
        """Sets up a new request in a free slot with room for ``num_tokens`` now and at most
        ``max_tokens`` ever; False changes nothing."""
        if not self.can_ensure(slot, num_tokens):
            return False
        if not self.payload.admit(slot, request_id, max_tokens):
            return False
        ok = self.ensure(slot, num_tokens)
        assert ok
        self._admitted.add(slot)
        return True

    def release(self, slot: int) -> None:
        self._admitted.discard(slot)
        self.payload.release(slot)
        self.index_keys.release(slot)
        for r in self.rings.values():
            r.clear(slot)

    # ---- a forward pass ---------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> None:
        self.payload.begin(batch)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        self.payload.commit(batch, num_tokens)

    # ---- accounting -------------------------------------------------------------------------
    def maintain(self) -> None:
        """Between steps: completions, reclaim and repopulation (adaptive mode)."""
        maintain = getattr(self.payload, "maintain", None)
        if maintain is not None:
            maintain()

    def note_queue(self, waiting: int) -> None:
        """The scheduler's queue after admissions (adaptive residency holds back then)."""
        residency = getattr(self.payload, "residency", None)
        if residency is not None:
            residency.note_queue(waiting)

    def settling(self) -> bool:
        """Whether memory is still on its way back (copies or drains in flight): an admission
        that does not fit now may fit after a few steps."""
        residency = getattr(self.payload, "residency", None)
        return residency is not None and residency.settling()

    def check(self) -> None:
        """Checks the residency invariant and eq. 3 (tests and ``DHISPARSE_CHECK_INVARIANTS``)."""
        check = getattr(self.payload, "check", None)
        if check is not None:
            check()

    def memory(self) -> MemoryUsage:
        """The pool by class (eq. 3). Fixed allocations (rings, prefill scratch, metadata) and
        index keys in use count as required."""
        held, fixed = self.payload.memory_bytes(len(self._admitted))
        keys = self.index_keys.used_bytes
        rings = sum(r.nbytes for r in self.rings.values())
        capacity = self.cfg.kv_pool_bytes
        classes = getattr(self.payload, "memory_classes", None)
        if classes is None:
            required, optional, reserve = held + fixed + keys + rings, 0, 0
        else:
            req_pages, optional, reserve, _ = classes()
            required = req_pages + fixed + keys + rings
        free = max(0, capacity - required - optional - reserve)
        return MemoryUsage(capacity, required, optional, reserve, free)

    def fixed_bytes(self) -> int:
        """Allocations that do not grow with sessions (rings, scratch, metadata, staging)."""
        rings = sum(r.nbytes for r in self.rings.values())
        return rings + self.payload.memory_bytes(0)[1]

    def layout(self) -> dict:
        """The KV geometry, for exact admission sizing at the gateway."""
        payload = self.payload
        return {
            "kv_dtype_bytes": torch.empty((), dtype=self.cfg.dtype).element_size(),
            "page_size": self.cfg.page_size,
            "hot_cache_rows": getattr(payload.geo[0], "hot_entries", None)
            if hasattr(payload, "geo")
            else None,
            "tail_rows": getattr(payload, "ring", None),
            "spec_block": self.cfg.spec_block,
        }

    def census(self):
        """Selected rows resolved direct / hot / host and rows copied from the host so far, or
        None in resident serving (synchronises on a GPU)."""
        return getattr(self.payload, "census", None)

    @property
    def row_bytes(self) -> int:
        return self.model_cfg.d_kv * torch.empty((), dtype=self.cfg.dtype).element_size()

    @property
    def nbytes(self) -> int:
        rings = sum(r.nbytes for r in self.rings.values())
        return self.payload.nbytes + self.index_keys.nbytes + rings

    def close(self) -> None:
        if self.host_backups is not None:
            self.host_backups.close()
        if self._local_store is not None:
            self._local_store.close()
            self._local_store = None
