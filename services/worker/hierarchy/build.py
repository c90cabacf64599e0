"""Builds a hierarchy payload from the KV config: hot cache and tail sizes, the page pool that
the KV budget leaves after fixed allocations, and the host backups (the node's store, or a
private arena in this process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.hierarchy.backend import get_backend
from services.worker.hierarchy.host_backup import HostBackups
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.hierarchy.payload import HierarchyPayload
from services.worker.hierarchy.sizing import fixed_bytes, staging_bytes
from services.worker.model.config import ModelConfig

if TYPE_CHECKING:
    from services.worker.kv.cache import KVCacheConfig


def hot_rows(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """B, rounded up to whole pages (default 2k)."""
    p = cfg.page_size
    return -(-(cfg.hot_cache_rows or 2 * model_cfg.index_topk) // p) * p


def hierarchy_fixed_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """Allocations of a hierarchy mode that do not grow with sessions: token rings, prefill
    scratch, hot-cache metadata and staging (index keys and pages excluded)."""
    esize = torch.empty((), dtype=cfg.dtype).element_size()
    rings = 0
    for src in model_cfg.sources:
        if src.window > 0 or src.compress > 1:
            rows = max(src.window, src.compress) + cfg.ring_extra
            rings += cfg.max_slots * rows * model_cfg.d_kv * esize
    scratch_tokens = max(cfg.max_prefill_tokens, cfg.max_model_len)
    b = hot_rows(model_cfg, cfg)
    return (
        rings
        + fixed_bytes(model_cfg, cfg.max_slots, cfg.max_model_len, b, scratch_tokens, esize)
        + staging_bytes(model_cfg, cfg.max_slots, cfg.spec_block, esize)
    )


def build_hierarchy(
    model_cfg: ModelConfig, cfg: KVCacheConfig, host: tuple | None, fixed_other: int
) -> tuple[HierarchyPayload, HostBackups, LocalHostStore | None]:
    """(payload, host backups, the private store if one was made). ``fixed_other``: device
    bytes already spoken for (token rings; index keys take pages of the pool). ``host``: (store, arena mapping)."""
    esize = torch.empty((), dtype=cfg.dtype).element_size()
    p = cfg.page_size
    b = hot_rows(model_cfg, cfg)
    ring = -(-(p + cfg.ring_extra) // p) * p  # one page plus a verification block
    scratch_tokens = max(cfg.max_prefill_tokens, cfg.max_model_len)
    fixed = fixed_other + fixed_bytes(
        model_cfg, cfg.max_slots, cfg.max_model_len, b, scratch_tokens, esize
    )
    page_bytes = p * model_cfg.d_kv * esize
    num_pages = (cfg.kv_pool_bytes - fixed) // page_bytes
    per_request = len(model_cfg.sources) * (b + ring) // p
    if num_pages < per_request:
        raise ValueError(
            f"a KV pool of {cfg.kv_pool_bytes} B leaves {max(0, num_pages)} pages after fixed "
            f"allocations of {fixed} B; one request needs {per_request} pages of "
            f"{page_bytes} B (hot cache + tail): enlarge the pool or lower max_num_seqs, "
            "max_model_len or the hot cache"
        )
    local = None
    if host is None:
        local = LocalHostStore(cfg.host_arena_bytes)
        host = (local, local.mapping)
    store, mapping = host
    backups = HostBackups(
        store, mapping, cfg.owner, len(model_cfg.sources), model_cfg.d_kv, cfg.dtype,
        cfg.max_slots, cfg.device,
    )  # fmt: skip
    ops = get_backend(cfg.resolver)
    payload = HierarchyPayload(
        model_cfg, backups, cfg.max_slots, cfg.max_model_len, p, b, ring,
        scratch_tokens, int(num_pages), cfg.dtype, cfg.device,
        resolver=ops.resolve, backup=ops.backup, restore=ops.restore,
        mode=cfg.mode,
        reserve_pages=cfg.reserve_pages, populate_pages=cfg.populate_pages,
        populate_payback=cfg.populate_payback, overlap_refills=cfg.overlap_refills,
        reclaim_order=cfg.reclaim_order, spec_block=cfg.spec_block, durable=cfg.durable,
    )  # fmt: skip
    return payload, backups, local
