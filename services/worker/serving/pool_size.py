"""What sizes a KV pool none was given (``engine.config.with_sized_pool``): the most the seats
can use (``cache.pool_ceiling``) and what the pool holds that does not grow with sessions."""

from __future__ import annotations

from dhisparse.family.config import ModelConfig
from services.worker.kv.config import KVCacheConfig
from services.worker.kv.workspace import workspace_bytes
from services.worker.serving.cache import pool_ceiling
from services.worker.serving.hierarchy_build import hierarchy_fixed_bytes


def pool_fixed_bytes(model_cfg: ModelConfig, cfg: KVCacheConfig) -> int:
    """What a pool holds that does not grow with sessions, in any mode (``cfg.kv_pool_bytes``
    aside): the hierarchy modes' fixed allocations and the index-score workspace."""
    return hierarchy_fixed_bytes(model_cfg, cfg) + workspace_bytes(model_cfg, cfg)


def pool_bounds(model_cfg: ModelConfig, cfg: KVCacheConfig) -> tuple[int, int]:
    """(``pool_ceiling``, ``pool_fixed_bytes``)."""
    return pool_ceiling(model_cfg, cfg), pool_fixed_bytes(model_cfg, cfg)
