"""A worker's accounts in the capacity ledger: what one lease holds room in.

A worker that serves one batch (one GPU, or a tensor-parallel group) is one account: its whole
KV capacity and seats. A data-parallel-attention group is one account per serving rank, each
with that rank's share of the capacity and seats (every rank has its own pool and batch): a
request runs on one rank, so its lease must hold room on that rank — against the group's sum,
a group whose ranks fill unevenly would admit a request into a full rank's queue while another
rank has room. Admission offers a group's ranks to the ledger as one choice, which takes the
least admitted rank with room atomically (``ledger.Candidate.group``: concurrent admissions,
of this gateway or another replica, spread over the ranks). The lease names its account's
rank, and the worker runs the request there (``GenerateRequest.dp_rank``). Pure policy, no
I/O."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.routing import WorkerStatus


@dataclass(frozen=True)
class Account:
    """One account: ``worker``'s whole capacity (``rank`` None) or rank ``rank``'s share."""

    worker: str  # the worker's address
    rank: int | None = None
    capacity_bytes: int = 0
    max_sessions: int = 0  # 0: no session limit

    @property
    def key(self) -> str:
        """The account's name in the ledger (the worker's address for a whole worker)."""
        return self.worker if self.rank is None else f"{self.worker}/dp{self.rank}"


def accounts(w: WorkerStatus) -> list[Account]:
    """``w``'s accounts, by rank (a worker reports its group's sums and its serving ranks)."""
    n = max(1, w.serving_ranks)
    if n == 1:
        return [Account(w.address, None, w.kv_capacity_bytes, w.max_num_seqs)]
    return [Account(w.address, r, w.kv_capacity_bytes // n, w.max_num_seqs // n) for r in range(n)]
