"""What a worker's KV state is configured with, and the byte arithmetic shared with the
benchmarks: the serving modes, the pool classes of eq. 3, and bytes per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.hierarchy.follower_prefetch import FollowerPrefetch
from services.worker.hierarchy.read_order import HostReadOrder
from services.worker.model.config import ModelConfig
from services.worker.residency.config import ResidencyConfig

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
    # the most prefill tokens one pass computes, and one request's chunk: sizes the
    # hierarchy's prefill scratch (with max_model_len) and the index-score workspace
    max_prefill_tokens: int = 8192
    host_arena_bytes: int = 256 << 20  # private arena when no kv_host_store is given
    owner: str = "local"  # worker id the host regions belong to
    resolver: str = "torch"  # torch | triton
    # whether this process writes its host backups (False: a tensor-parallel follower, whose
    # rank 0 writes the rows every rank reads, ``parallel.region_group``)
    host_writer: bool = True
    # the order the Triton resolver issues a step's host reads in (exact in any order)
    host_reads: HostReadOrder = field(default_factory=HostReadOrder)
    # when an index producer's followers resolve: beside the layers in between, or inline
    followers: FollowerPrefetch = field(default_factory=FollowerPrefetch)
    residency: ResidencyConfig = field(default_factory=ResidencyConfig)  # mode adaptive
    spec_block: int = 1  # K_max of speculative verification (1: none); sizes staging
    durable: bool = False  # hierarchy: back up what a successor needs to resume each session
    dtype: torch.dtype = torch.float32  # the serving dtype: what rows are computed in
    # how rows and index keys are stored: "auto" (as computed, in ``dtype``) or "fp8" (packed
    # FP8 rows, ``kv/row_codec.py``, docs/fp8_kv.md)
    kv_cache_dtype: str = "auto"
    device: str = "cpu"


def bytes_per_token(
    cfg: ModelConfig,
    elem_bytes: int,
    payload: bool,
    row_bytes: int | None = None,
    key_bytes: int | None = None,
) -> float:
    """Device bytes one token adds: index keys, plus payload rows when they are resident.
    ``row_bytes`` / ``key_bytes``: a stored row's and key's bytes when they are not ``d_kv`` /
    ``d_index`` elements of ``elem_bytes`` (FP8: the packed sizes)."""
    key = cfg.d_index * elem_bytes if key_bytes is None else key_bytes
    row = cfg.d_kv * elem_bytes if row_bytes is None else row_bytes
    keys = sum(key / cfg.sources[cfg.layers[i].source].compress for i in cfg.index_producers)
    if not payload:
        return keys
    return keys + sum(row / s.compress for s in cfg.sources)
