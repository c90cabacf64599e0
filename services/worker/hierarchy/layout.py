"""Where things lie in the hierarchy's device store: rows ``[0, pages * p)`` are the page pool
(hot caches, tails, optional history and the index keys all take pages from it), then each
source's prefill scratch, then the staging arenas of speculative verification (eq. 11). Each
source gets the geometry that maps its rows to store rows, and its hot cache's metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.hot_cache import HotCache
from services.worker.hierarchy.sizing import staging_arenas
from services.worker.model.config import ModelConfig


@dataclass
class StoreLayout:
    store: torch.Tensor  # [rows, d_kv]
    geo: list[SourceGeometry]  # per source
    hot: list[HotCache]  # per source
    chi: int  # staging arenas (0: no speculation)
    stage_rows_total: int


def lay_out_store(
    cfg: ModelConfig,
    max_slots: int,
    max_model_len: int,
    page: int,
    hot_cache_rows: int,
    ring_rows: int,
    scratch_tokens: int,
    num_pages: int,
    spec_block: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> StoreLayout:
    n = len(cfg.sources)
    scratch = [scratch_tokens // s.compress + max_slots for s in cfg.sources]
    base = num_pages * page
    arenas, chi = staging_arenas(cfg) if spec_block > 1 else ([0] * n, 0)
    stage_rows = spec_block * cfg.index_topk if spec_block > 1 else 0
    stage_base = base + sum(scratch)
    stage_rows_total = chi * max_slots * stage_rows
    store = torch.zeros(stage_base + stage_rows_total, cfg.d_kv, dtype=dtype, device=device)
    geo: list[SourceGeometry] = []
    hot: list[HotCache] = []
    for s, src in enumerate(cfg.sources):
        max_rows = max_model_len // src.compress
        stage = stage_base + arenas[s] * max_slots * stage_rows
        geo.append(SourceGeometry.create(
            max_slots, page, hot_cache_rows, ring_rows, base, scratch[s], max_rows, device,
            stage, stage_rows,
        ))  # fmt: skip
        hot.append(HotCache(max_slots, hot_cache_rows, max_rows, device))
        base += scratch[s]
    return StoreLayout(store, geo, hot, chi, stage_rows_total)
