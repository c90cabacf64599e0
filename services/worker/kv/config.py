"""What a worker's KV state is configured with, and the byte arithmetic shared with the
benchmarks: the serving modes and their settings (the hierarchy's host-read order and
followers' prefetch, adaptive residency's), the pool classes of eq. 3, and bytes per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dhisparse.family.config import ModelConfig

MODES = ("resident", "hisparse", "adaptive")
# whom reclaim takes first (``residency.policy``)
RECLAIM_ORDERS = ("largest", "smallest", "oldest", "newest")


@dataclass(frozen=True)
class HostReadOrder:
    """The order a step's host reads are issued in (``hierarchy.read_order``)."""

    # sort a step's queued host reads by address before the copy: off, as the sort runs over
    # every selected entry of every resolve, hits included (docs/results/host_layout.md)
    by_address: bool = False


@dataclass(frozen=True)
class FollowerPrefetch:
    """When an index producer's followers are resolved (``hierarchy.selection``). Either way
    the locations and the bytes copied are the same.

    A producer's selection serves the follower layers after it (IndexShare), each with a source
    of its own, so their resolutions — hot-cache lookups and host reads — can start as soon as
    the selection exists. Overlapped, they run on a side stream beside the producer's attention
    and the layers in between (inside a captured CUDA graph: a parallel branch of the graph);
    inline, they run on the pass's own stream before the producer's attention."""

    overlap: bool = True  # on a GPU: beside the layers in between (False: inline)


@dataclass(frozen=True)
class ResidencyConfig:
    """What load-adaptive residency is configured with (mode ``adaptive``)."""

    reserve_pages: int = 0  # M_res of eq. 3, in pages: kept free for admissions
    populate_pages: int = 256  # optional pages refilled per attempt
    # refill a request's history only while it has at least this many times V/k decode steps
    # left (a refilled page pays back its copy after about V/k steps; 0: always)
    populate_payback: float = 1.0
    overlap_refills: bool = False  # GPU: refill copies on a side stream beside decode passes
    reclaim_order: str = "largest"  # largest | smallest | oldest | newest

    def __post_init__(self) -> None:
        if self.reclaim_order not in RECLAIM_ORDERS:
            raise ValueError(
                f"unknown reclaim order {self.reclaim_order!r}; choose from {RECLAIM_ORDERS}"
            )
        if self.reserve_pages < 0 or self.populate_pages < 0 or self.populate_payback < 0:
            raise ValueError("reserve_pages, populate_pages and populate_payback must be >= 0")


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
    # rank 0 writes the rows every rank reads, ``rank_group.region_group``)
    host_writer: bool = True

    @property
    def token_ring_extra(self) -> int:
        """Rows a token ring keeps beyond its window, group or state rows: a verify block's
        (``ring_extra``) and a page's, so that when a request leaves its pages as a cached
        prefix, its rings still hold every row that a reader at the last page boundary before
        its position needs (``serving.prefix_reuse``)."""
        return self.ring_extra + self.page_size

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
    """Device bytes one token adds: index keys, plus the stored sources' rows when they are
    resident (a source that keeps no history adds none: its window is a ring).
    ``row_bytes`` / ``key_bytes``: a stored row's and key's bytes when they are not ``d_kv`` /
    ``d_index`` elements of ``elem_bytes`` (FP8: the packed sizes)."""
    key = cfg.d_index * elem_bytes if key_bytes is None else key_bytes
    row = cfg.d_kv * elem_bytes if row_bytes is None else row_bytes
    keys = sum(key / cfg.sources[cfg.layers[i].source].compress for i in cfg.key_producers)
    if not payload:
        return keys
    return keys + sum(row / cfg.sources[s].compress for s in cfg.stored_sources)
