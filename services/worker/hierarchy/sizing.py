"""Device memory of the hierarchy besides its page pool and staging (``staging.py``): prefill
scratch and hot-cache metadata. Pure arithmetic over the model config."""

from __future__ import annotations

from dhisparse.family.config import ModelConfig


def fixed_bytes(
    cfg: ModelConfig,
    max_slots: int,
    max_model_len: int,
    hot_cache_rows: int,
    scratch_tokens: int,
    row: int,
) -> int:
    """Bytes besides the page pool: prefill scratch and hot-cache metadata of every stored
    source for all slots, with stored rows of ``row`` bytes."""
    total = 0
    for s in cfg.stored_sources:
        src = cfg.sources[s]
        rows = max_model_len // src.compress
        scratch = scratch_tokens // src.compress + max_slots
        map_bytes = 2 if hot_cache_rows <= 32767 else 4
        total += scratch * row + max_slots * (rows * map_bytes + hot_cache_rows * 16)
    return total
