"""What load-adaptive residency is configured with (mode ``adaptive``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.residency.policy import RECLAIM_ORDERS


@dataclass(frozen=True)
class ResidencyConfig:
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
