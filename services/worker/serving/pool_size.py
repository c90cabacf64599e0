"""What sizes a KV pool none was given (``engine.config.with_sized_pool``): the most the seats
can use (``pool_ceiling``) and what the pool holds that does not grow with sessions."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.worker.hierarchy.tail import tail_rows
from services.worker.kv.config import KVCacheConfig, bytes_per_token
from services.worker.kv.row_codec import kv_codecs
from services.worker.kv.workspace import workspace_bytes
from services.worker.serving.hierarchy_build import hierarchy_fixed_bytes, hot_rows


def pool_fixed_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """What a pool holds that does not grow with sessions, in any mode (``cfg.kv_pool_bytes``
    aside): the hierarchy modes' fixed allocations and the index-score workspace."""
    return hierarchy_fixed_bytes(model_cfg, cfg) + workspace_bytes(model_cfg, cfg)


def pool_ceiling(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """The most KV pool bytes a worker can use in any mode (``cfg.kv_pool_bytes`` aside): every
    slot's whole context held on the device as resident serving stores it (rows and index
    keys), each slot's hot cache and tail beside it, and ``pool_fixed_bytes``. A larger pool
    holds nothing more."""
    codecs = kv_codecs(model_cfg, cfg.kv_cache_dtype, cfg.dtype)
    esize = torch.empty((), dtype=cfg.dtype).element_size()
    per_token = bytes_per_token(
        model_cfg, esize, True, codecs.rows.row_bytes, codecs.keys.row_bytes
    )
    beside = len(model_cfg.stored_sources) * (
        hot_rows(model_cfg, cfg) + tail_rows(cfg.page_size, cfg.ring_extra)
    )
    per_slot = cfg.max_model_len * per_token + beside * codecs.rows.row_bytes
    return int(pool_fixed_bytes(model_cfg, cfg) + cfg.max_slots * per_slot)


def pool_bounds(model_cfg: ModelConfig, cfg: KVCacheConfig) -> tuple[int, int]:
    """(``pool_ceiling``, ``pool_fixed_bytes``)."""
    return pool_ceiling(model_cfg, cfg), pool_fixed_bytes(model_cfg, cfg)
