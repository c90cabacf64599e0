"""How the FP8 matmul (``fp8_linear.py``) lays out a launch: the tile configuration by batch
bucket (``DEFAULT_TILES``, a frozen table; ``python -m bench fp8-linear`` sweeps candidates
against it and passes its own through ``fp8_linear_triton(tiles=...)``); the number of K
splits is ``fp8_linear_splits.py``'s."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from services.worker.ops.arrivals import CAPACITY
from services.worker.ops.launch import TARGET_PROGRAMS


@dataclass(frozen=True)
class Tiles:
    """One launch configuration. ``block_m``: the most rows a tile takes (a launch uses the
    smallest power of two at least M, at least 16 for ``tl.dot``, up to this); ``block_n``:
    columns of y per tile; ``num_warps``, ``num_stages``: Triton's; ``split_programs``: the
    programs a launch aims for by splitting K when it has fewer output tiles
    (``k_splits``); ``k_step``: 128-column scale blocks of K per loop iteration (1 or 2: two
    loads in flight per iteration; the arithmetic is the same)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_programs: int = TARGET_PROGRAMS
    k_step: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"tiles of at least 16x16 (tl.dot), got {self.block_m}x{self.block_n}")
        if self.num_stages < 1 or self.k_step not in (1, 2):
            raise ValueError(f"num_stages >= 1 and k_step 1 or 2, got {self}")
        if not 1 <= self.split_programs <= CAPACITY:
            raise ValueError(f"split_programs must be in 1..{CAPACITY}, got {self}")

    def label(self) -> str:
        """A short name for tables: ``n64w4s4p264k1``."""
        return (
            f"n{self.block_n}w{self.num_warps}s{self.num_stages}"
            f"p{self.split_programs}k{self.k_step}"
        )


# By batch bucket: the first entry whose bound is at least M. Decode (M <= 16) takes narrow
# tiles for more programs; the largest bucket holds every M above the others.
DEFAULT_TILES: tuple[tuple[int, Tiles], ...] = (
    (16, Tiles(16, 64, 4, 4)),
    (64, Tiles(64, 64, 4, 4)),
    (1 << 62, Tiles(128, 128, 8, 3)),
)
# Under the interpreter a program is slow: few large tiles, one split.
INTERPRET_TILES = Tiles(64, 128, 1, 1, split_programs=1)


def tiles_for(m: int, interpret: bool) -> Tiles:
    """The default configuration for a batch of ``m`` rows. A fixed table, not autotuned (the
    interpreter cannot autotune, and a graph replays what was captured)."""
    if interpret:
        return INTERPRET_TILES
    return next(t for bound, t in DEFAULT_TILES if m <= bound)


def launch_block_m(tiles: Tiles, m: int) -> int:
    """BLOCK_M of a launch of ``m`` rows: the smallest power of two >= m, in 16..block_m."""
    return min(tiles.block_m, max(16, triton.next_power_of_2(m)))
