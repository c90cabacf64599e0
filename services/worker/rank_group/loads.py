"""The group's serving ranks as rank 0 knows them (DESIGN §8): under data-parallel attention
each rank reports its load after every step (``Placement.report``) and rank 0 adds the others'
to its own; otherwise (a rank alone, tensor parallel, any follower) one rank serves and there
are no others to count."""

from __future__ import annotations

from services.worker.rank_group.lockstep import Lockstep
from services.worker.rank_group.placement import Placement, RankLoad
from services.worker.serving.prefix_reuse import PrefixStats


class RankLoads:
    def __init__(self, placement: Placement | None, lockstep: Lockstep | None) -> None:
        """``placement``: rank 0's placement under data-parallel attention, else None."""
        self._placement = placement
        self._lockstep = lockstep

    @property
    def serving_ranks(self) -> int:
        """The ranks that each serve their own requests: the group under data-parallel
        attention (each with this rank's seats and KV capacity), else one."""
        return len(self._placement.loads) if self._placement is not None else 1

    def reported(self) -> list[RankLoad]:
        """Each serving rank's load as it last reported it (none without data-parallel
        attention)."""
        return list(self._placement.loads) if self._placement is not None else []

    def others_busy(self) -> bool:
        """Whether another rank has work, or rank 0 has mutations queued for one."""
        if self._placement is None:
            return False
        assert self._lockstep is not None
        return self._placement.others_busy or self._lockstep.pending

    @property
    def others_running(self) -> int:
        return self._placement.others_running if self._placement is not None else 0

    @property
    def others_waiting(self) -> int:
        return self._placement.others_waiting if self._placement is not None else 0

    @property
    def others_prefill_tokens(self) -> int:
        return self._placement.others_prefill_tokens if self._placement is not None else 0

    @property
    def others_sessions_resumed(self) -> int:
        p = self._placement
        return p.others_sessions_resumed if p is not None else 0

    def others_prefix(self) -> list[PrefixStats]:
        """The other ranks' prefix-reuse counts (data-parallel attention, rank 0)."""
        return self._placement.others_prefix if self._placement is not None else []

    def others_free_bytes(self) -> int:
        return self._placement.others_free_bytes if self._placement is not None else 0

    def owners(self) -> list[tuple[str, int]]:
        """Under data-parallel attention, each serving rank's own registration with the node's
        store (owner, generation), by rank, as it last reported it: where the sessions of that
        rank are held. Empty otherwise (the worker's own registration holds them)."""
        return [(load.owner, load.generation) for load in self.reported()]

    def store_problems(self) -> list[str]:
        """Each other rank whose link to the node's host store was not ok at its last report
        (a rank reports after every step, and at start-up); the other ranks of a tensor-
        parallel group hold no link of their own."""
        return self._placement.store_problems() if self._placement is not None else []
