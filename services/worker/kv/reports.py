"""What a payload reports about its work (``PayloadBackend.census`` and ``residency_stats``):
defined with the KV contract so that every serving mode and its readers share one type."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Census:
    """Selected entries by how they resolved, and distinct rows copied from the host.

    Resolvers return it as a [4] int64 device tensor (direct, hot, host, copied) so that
    counting never synchronises; ``Census.of`` reads one."""

    direct: int = 0
    hot: int = 0
    host: int = 0
    copied: int = 0

    @staticmethod
    def of(t: torch.Tensor) -> Census:
        return Census(*(int(x) for x in t.tolist()))


@dataclass
class ResidencyStats:
    """Adaptive residency's counters (mode ``adaptive``)."""

    reclaim_events: int = 0
    reclaim_pages: int = 0
    reclaim_latency: list[float] = field(default_factory=list)  # seconds, drained by readers
    repopulated_pages: int = 0  # published (their copy completed)
    refill_pages: int = 0  # whose copy was queued (the step that queues it pays for it)
    admissions_waited: int = 0
