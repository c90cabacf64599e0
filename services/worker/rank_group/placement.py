"""Which rank of a data-parallel-attention group serves a new request (rank 0 decides).

Mechanism: rank 0 records each request's rank until the request finishes, and after every
step each rank reports its load (``RankLoad``). Policy: the rank the request names (the
gateway's lease holds room on that rank: ``GenerateRequest.dp_rank``); else
(``least_loaded``) the rank with the fewest requests — running, waiting, and placed on it
since its last report — then the most free KV bytes, then the lowest rank. A request stays on
its rank to the end: its KV rows, hot caches and host regions are that rank's."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.serving.prefix_reuse import PrefixStats


@dataclass(frozen=True)
class RankLoad:
    """One rank's state after a step (and at start-up, after it resumed its sessions)."""

    running: int = 0
    waiting: int = 0
    busy: bool = False  # it has work for the next step
    kv_free_bytes: int = 0
    prefill_tokens: int = 0  # prompt tokens it has computed since it started
    sessions_resumed: int = 0  # durable sessions it has resumed since it started
    store_problem: str = ""  # why its link to the node's host store is not ok ("": it is)
    owner: str = ""  # its own registration with the node's store ("", 0: none)
    generation: int = 0
    prefix: PrefixStats | None = None  # its prefix reuse's counts (None: off)

    @property
    def requests(self) -> int:
        return self.running + self.waiting


def least_loaded(loads: list[RankLoad], placed: list[int]) -> int:
    """The rank a new request goes to (``placed[r]``: requests placed on rank r since its
    ``loads[r]`` was reported)."""
    return min(
        range(len(loads)),
        key=lambda r: (loads[r].requests + placed[r], -loads[r].kv_free_bytes, r),
    )


class Placement:
    """Rank 0's record of a group of ``size`` ranks."""

    def __init__(self, size: int) -> None:
        self.loads = [RankLoad() for _ in range(size)]
        self._placed = [0] * size
        self._owner: dict[str, int] = {}

    def place(self, request_id: str, rank: int | None = None) -> int:
        """The rank that serves the new request: ``rank`` when it names one, else the least
        loaded."""
        if rank is None:
            rank = least_loaded(self.loads, self._placed)
        self._placed[rank] += 1
        self._owner[request_id] = rank
        return rank

    def assign(self, request_id: str, rank: int) -> None:
        """Records that ``rank`` serves ``request_id`` already (a session it resumed at
        start-up: its report counts it)."""
        self._owner[request_id] = rank

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def forget(self, request_id: str) -> None:
        """The request has finished (or was aborted) on its rank."""
        self._owner.pop(request_id, None)

    def report(self, loads: list[RankLoad]) -> None:
        """Every rank's load after a step (placements before it are counted in it)."""
        self.loads = list(loads)
        self._placed = [0] * len(loads)

    @property
    def others_busy(self) -> bool:
        """Whether a rank other than 0 has work, or requests placed on it are not yet seen
        in its report."""
        return any(load.busy for load in self.loads[1:]) or any(self._placed[1:])

    @property
    def others_running(self) -> int:
        """Running requests of the ranks other than 0, as last reported."""
        return sum(load.running for load in self.loads[1:])

    @property
    def others_waiting(self) -> int:
        """Waiting requests of the ranks other than 0: reported, and placed since."""
        return sum(load.waiting for load in self.loads[1:]) + sum(self._placed[1:])

    @property
    def others_free_bytes(self) -> int:
        """The other ranks' free KV bytes, as they last reported them."""
        return sum(load.kv_free_bytes for load in self.loads[1:])

    @property
    def others_prefill_tokens(self) -> int:
        """Prompt tokens the other ranks have computed, as they last reported."""
        return sum(load.prefill_tokens for load in self.loads[1:])

    @property
    def others_sessions_resumed(self) -> int:
        """Durable sessions the other ranks have resumed, as they last reported."""
        return sum(load.sessions_resumed for load in self.loads[1:])

    @property
    def others_prefix(self) -> list[PrefixStats]:
        """The other ranks' prefix-reuse counts, as they last reported them."""
        return [load.prefix for load in self.loads[1:] if load.prefix is not None]

    def store_problems(self) -> list[str]:
        """Each other rank whose link to the node's host store was not ok at its last
        report, with why."""
        return [
            f"rank {r}: {load.store_problem}"
            for r, load in enumerate(self.loads)
            if r > 0 and load.store_problem
        ]
