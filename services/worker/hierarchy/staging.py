"""Staging (DESIGN §5, eq. 11): where a verification round's misses go when their union outgrows
the hot cache.

Each query of a speculative block keeps its own selection; a request's union of them may exceed
B even when every query's selection fits. The resolver sends the overflow to the request's
staging rows for that call only (they never enter the hot cache), ``K_max * k`` rows per slot
and source. Layer groups run in sequence, so chi simultaneously live payload sources each get one
arena, reused by the next group once every reader is done: ``M_stage = chi * N * K_max * k *
d_kv``."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.family.config import ModelConfig


class StagingOverflow(RuntimeError):
    """A round's misses exceed the unprotected hot-cache entries and the request's staging."""


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
    return [arena.get(s, 0) for s in cfg.stored_sources], chi


def staging_bytes(cfg: ModelConfig, max_slots: int, spec_block: int, row_bytes: int) -> int:
    """Eq. 11: chi arenas of N * K_max * k stored rows of ``row_bytes`` (no speculation:
    none)."""
    if spec_block <= 1:
        return 0
    return staging_arenas(cfg)[1] * max_slots * spec_block * cfg.index_topk * row_bytes


@dataclass(frozen=True)
class StagingLayout:
    """Where the staging arenas lie in the device store: from row ``base``, chi arenas of
    ``max_slots * rows_per_slot`` rows; ``source_base[s]`` is the first row of source s's arena
    (0 rows per slot without speculation)."""

    chi: int
    rows_per_slot: int
    source_base: tuple[int, ...]
    total_rows: int


def lay_out_staging(cfg: ModelConfig, max_slots: int, spec_block: int, base: int) -> StagingLayout:
    """The staging arenas of verification blocks of ``spec_block`` queries (1: no speculation,
    no staging), laid out from store row ``base``."""
    n = len(cfg.stored_sources)
    if spec_block <= 1:
        return StagingLayout(0, 0, (base,) * n, 0)
    arenas, chi = staging_arenas(cfg)
    per_slot = spec_block * cfg.index_topk
    bases = tuple(base + arenas[s] * max_slots * per_slot for s in range(n))
    return StagingLayout(chi, per_slot, bases, chi * max_slots * per_slot)
