"""Builds a hierarchy payload from the KV config: hot cache and tail sizes, the page pool that
the KV budget leaves after fixed allocations, and the host backups (the node's store, or a
private arena in this process)."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.arena import ArenaMapping
from services.worker.hierarchy.backend import get_backend
from services.worker.hierarchy.device_store import DeviceStore, StoreShape
from services.worker.hierarchy.host_backup import HostBackups
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.hierarchy.region_store import RegionStore
from services.worker.hierarchy.sizing import fixed_bytes
from services.worker.hierarchy.staging import staging_bytes
from services.worker.hierarchy.tail import tail_rows
from services.worker.kv.config import KVCacheConfig
from services.worker.kv.row_codec import RowCodec, kv_codecs
from services.worker.serving.hierarchy_payload import HierarchyPayload


def hot_rows(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """B, rounded up to whole pages (default 2k)."""
    p = cfg.page_size
    return -(-(cfg.hot_cache_rows or 2 * model_cfg.index_topk) // p) * p


def session_floor_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """The pool bytes one admitted hierarchy session holds whatever its length: B rows and the
    tail's rows per stored source (the index keys, which grow with it, aside)."""
    rows = hot_rows(model_cfg, cfg) + tail_rows(cfg.page_size, cfg.ring_extra)
    return len(model_cfg.stored_sources) * rows * _row_codec(model_cfg, cfg).row_bytes


def prefill_scratch_tokens(cfg: KVCacheConfig) -> int:
    """Tokens of prefill scratch: a prefill pass's chunks (at most ``max_prefill_tokens``)
    with the computed prefixes of the prefills it continues, and a prompt's whole prefix
    (shorter than the context) beside its last chunk (``prefill.py``, ``Prefixes.room``)."""
    return max(cfg.max_prefill_tokens, cfg.max_model_len)


def hierarchy_fixed_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """Allocations of a hierarchy mode that do not grow with sessions: token rings, prefill
    scratch, hot-cache metadata and staging (index keys and pages excluded; so is the
    index-score workspace every mode holds, ``kv.workspace``). Token rings hold rows in the
    serving dtype; the rest holds stored rows (packed in fp8)."""
    row = _row_codec(model_cfg, cfg).row_bytes
    scratch_tokens = prefill_scratch_tokens(cfg)
    b = hot_rows(model_cfg, cfg)
    return (
        token_ring_bytes(model_cfg, cfg)
        + fixed_bytes(model_cfg, cfg.max_slots, cfg.max_model_len, b, scratch_tokens, row)
        + staging_bytes(model_cfg, cfg.max_slots, cfg.spec_block, row)
    )


def token_ring_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """The token rings every mode holds, in the serving dtype: a windowed or compressed
    source's (``KVCache.rings``) and the model's own state rings (``extra["state_rings"]``);
    the MTP layer's carry aside."""
    esize = torch.empty((), dtype=cfg.dtype).element_size()
    rings = 0
    for src in model_cfg.sources:
        if src.window > 0 or src.compress > 1:
            rows = max(src.window, src.compress) + cfg.token_ring_extra
            rings += cfg.max_slots * rows * model_cfg.d_kv * esize
    for rows, width in model_cfg.extra.get("state_rings", ()):
        rings += cfg.max_slots * (rows + cfg.token_ring_extra) * width * esize
    return rings


def _row_codec(model_cfg: ModelConfig, cfg: KVCacheConfig) -> RowCodec:
    return kv_codecs(model_cfg, cfg.kv_cache_dtype, cfg.dtype).rows


def build_hierarchy(
    model_cfg: ModelConfig,
    cfg: KVCacheConfig,
    host: tuple[RegionStore, ArenaMapping] | None,
    fixed_other: int,
) -> tuple[HierarchyPayload, HostBackups, LocalHostStore | None]:
    """(payload, host backups, the private store if one was made). ``fixed_other``: device
    bytes already spoken for (token rings, the index-score workspace; index keys take pages of
    the pool). ``host``: the node's (store, arena mapping); None makes a private arena. The
    device store and host backups hold stored rows (``kv_cache_dtype``: packed in fp8, so a
    row's host backup is its packed bytes)."""
    codec = _row_codec(model_cfg, cfg)
    p = cfg.page_size
    b = hot_rows(model_cfg, cfg)
    ring = tail_rows(p, cfg.ring_extra)
    scratch_tokens = prefill_scratch_tokens(cfg)
    fixed = (
        fixed_other
        + fixed_bytes(
            model_cfg, cfg.max_slots, cfg.max_model_len, b, scratch_tokens, codec.row_bytes
        )
        + staging_bytes(model_cfg, cfg.max_slots, cfg.spec_block, codec.row_bytes)
    )
    page_bytes = p * codec.row_bytes
    num_pages = (cfg.kv_pool_bytes - fixed) // page_bytes
    per_request = len(model_cfg.stored_sources) * (b + ring) // p
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
        store, mapping, cfg.owner, len(model_cfg.stored_sources), codec.stored_width,
        codec.storage, cfg.max_slots, cfg.device, writer=cfg.host_writer,
    )  # fmt: skip
    shape = StoreShape(
        cfg.max_slots, cfg.max_model_len, p, b, ring, scratch_tokens, int(num_pages),
        cfg.spec_block, optional_history=cfg.mode == "adaptive",
    )  # fmt: skip
    device_store = DeviceStore.build(
        model_cfg, shape, backups, get_backend(cfg.resolver, cfg.host_reads), codec
    )
    residency = cfg.residency if cfg.mode == "adaptive" else None
    payload = HierarchyPayload(
        model_cfg, device_store, residency, durable=cfg.durable, prefetch=cfg.followers
    )
    return payload, backups, local
