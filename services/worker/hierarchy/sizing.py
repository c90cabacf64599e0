"""Device memory of the hierarchy besides its page pool: staging arenas (eq. 11), prefill
scratch and hot-cache metadata. Pure arithmetic over the model config."""

from __future__ import annotations

from services.worker.model.config import ModelConfig


def staging_arenas(cfg: ModelConfig) -> tuple[list[int], int]:
    """Staging arena of each source and chi, the number of arenas.

    Layers run in producer groups (a producer and its followers, whose transfers start
    together); the sources of one group are live at once and need distinct arenas, and the next
    group reuses them once the group's attention is done (stream order). A source read by
    several groups (a shared source) keeps the arena of its first group."""
    arena: dict[int, int] = {}
    chi = 1
    for i, spec in enumerate(cfg.layers):
        if spec.index != "producer":
            continue
        group = [spec.source] + [
            f.source for f in cfg.layers if f.index == "follower" and f.leader == i
        ]
        seen: list[int] = []
        for src in group:
            if src not in seen:
                seen.append(src)
        chi = max(chi, len(seen))
        for pos, src in enumerate(seen):
            arena.setdefault(src, pos)
    return [arena.get(s, 0) for s in range(len(cfg.sources))], chi


def staging_bytes(cfg: ModelConfig, max_slots: int, spec_block: int, elem_bytes: int) -> int:
    """Eq. 11: chi arenas of N * K_max * k rows (no speculation: none)."""
    if spec_block <= 1:
        return 0
    return staging_arenas(cfg)[1] * max_slots * spec_block * cfg.index_topk * cfg.d_kv * elem_bytes


def fixed_bytes(
    cfg: ModelConfig,
    max_slots: int,
    max_model_len: int,
    hot_cache_rows: int,
    scratch_tokens: int,
    elem_bytes: int,
) -> int:
    """Bytes besides the page pool: prefill scratch and hot-cache metadata for all slots."""
    row = cfg.d_kv * elem_bytes
    total = 0
    for src in cfg.sources:
        rows = max_model_len // src.compress
        scratch = scratch_tokens // src.compress + max_slots
        map_bytes = 2 if hot_cache_rows <= 32767 else 4
        total += scratch * row + max_slots * (rows * map_bytes + hot_cache_rows * 16)
    return total
