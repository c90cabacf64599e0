"""Engines of a group's ranks stepping as one.

Every rank holds a whole engine — scheduler, KV hierarchy, sampler — over its part of the
model. Rank 0 is the only one the outside world talks to (gRPC, health): each mutation it
applies between two steps (a request added, one aborted) is recorded, and each step starts
with one broadcast of them, which the other ranks apply in the same order before they run the
same step. From identical inputs the ranks make identical choices (scheduling, residency, the
resolver's locations), and their logits are identical (gathered, not recomputed), so their
samples are too. A choice that rests on what one rank measured (the speculation width from
step times) is rank 0's, broadcast (``agree``).

Under data-parallel attention each rank serves its own requests: rank 0 places each new
request on one rank (``rank_group.placement``) and addresses its mutations to that rank alone
(``record_for``); after every step each rank's outputs and load go to rank 0 (``gather``).

The followers' loop is ``Engine.follow``; it ends when rank 0 broadcasts ``STOP``, and rank 0
waits until each follower has released what it holds at the node's store (a draining group's
sessions are adoptable by then, every rank's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.worker.parallel.comm import Comm

STOP = "stop"


@dataclass(frozen=True)
class Op:
    """One engine mutation: the method's name and its arguments (picklable)."""

    name: str
    args: tuple[Any, ...] = ()
    to: int | None = None  # the one rank that applies it (None: every rank but 0)


class StopFollowing(Exception):
    """Rank 0 has stopped the group."""


class Lockstep:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._pending: list[Op] = []
        self.steps = 0
        self._stopped = False

    @property
    def leader(self) -> bool:
        return self.comm.is_leader

    def record(self, name: str, *args: Any) -> None:
        """On rank 0: a mutation just applied, for the other ranks to apply before the next
        step."""
        if self.leader:
            self._pending.append(Op(name, args))

    def record_for(self, rank: int, name: str, *args: Any) -> None:
        """On rank 0: a mutation for rank ``rank`` (> 0) alone to apply before the next step."""
        if self.leader:
            self._pending.append(Op(name, args, rank))

    @property
    def pending(self) -> bool:
        """Whether rank 0 holds mutations the next step hands out."""
        return bool(self._pending)

    def exchange(self) -> list[Op]:
        """At the start of every step, on every rank: rank 0's mutations since the last step
        (rank 0 has applied them; the others apply those addressed to them now). Raises
        StopFollowing on the others once rank 0 has stopped."""
        ops, self._pending = self._pending, []
        ops = self.comm.broadcast_object(ops if self.leader else None)
        if not self.leader and any(op.name == STOP for op in ops):
            raise StopFollowing
        self.steps += 1
        me = self.comm.rank
        return [op for op in ops if op.to is None or op.to == me]

    def stop(self) -> None:
        """On rank 0: ends the other ranks' loops (one last broadcast), then waits until each
        has let go of what it holds (``released``). Once: later calls do nothing."""
        if self.leader and self.comm.size > 1 and not self._stopped:
            self._stopped = True
            self.comm.broadcast_object([Op(STOP)])
            self.comm.gather_objects(None)

    def released(self) -> None:
        """On a rank other than 0, once its loop has ended and it let go of what it holds (its
        store registration): what rank 0's ``stop`` waits for."""
        self.comm.gather_objects(None)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` in rank order on rank 0 (None on the others)."""
        return self.comm.gather_objects(value)

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a decision from what rank 0 measured)."""
        return self.comm.broadcast_object(value)
