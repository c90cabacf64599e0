"""When asynchronous copies are done.

Copies are issued where they belong in stream order the moment they are submitted; what this
module models is *when the runtime may rely on them*: a page may be published only after its
host-to-device copy completed, and retired only after its backup and every earlier reader
completed. On a GPU that is a CUDA event per ticket; on the CPU copies finish at once; tests
use ``ManualCompletions`` to deliver completions in any order they like."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch


class Completions(Protocol):
    def submit(self, work: Callable[[], None], overlap: bool = False) -> int:
        """Issues ``work`` (copies) now and returns a ticket that completes later. ``overlap``:
        the work may run beside work issued after it (it writes only what no reader may touch
        before the ticket completes), after everything issued before it."""

    def done(self) -> list[int]:
        """Tickets that completed since the last call."""


class ImmediateCompletions:
    """CPU execution: a copy is complete when issued."""

    def __init__(self) -> None:
        self._next = 0
        self._done: list[int] = []

    def submit(self, work: Callable[[], None], overlap: bool = False) -> int:
        work()
        self._next += 1
        self._done.append(self._next)
        return self._next

    def done(self) -> list[int]:
        out, self._done = self._done, []
        return out


class CudaCompletions:
    """A CUDA event recorded after each ticket's work on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._next = 0
        self._pending: dict[int, torch.cuda.Event] = {}
        self._side: torch.cuda.Stream | None = None  # for overlapping work, made when needed

    def submit(self, work: Callable[[], None], overlap: bool = False) -> int:
        """With ``overlap`` the work runs on a side stream that first waits for everything
        issued so far on the current one; later work on the current stream does not wait."""
        stream = torch.cuda.current_stream(self.device)
        if overlap:
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_stream(stream)
            stream = self._side
        with torch.cuda.stream(stream):
            work()
        event = torch.cuda.Event()
        event.record(stream)
        self._next += 1
        self._pending[self._next] = event
        return self._next

    def done(self) -> list[int]:
        ready = [t for t, e in self._pending.items() if e.query()]
        for t in ready:
            del self._pending[t]
        return ready


class ManualCompletions:
    """Tests decide when (and in which order) tickets complete."""

    def __init__(self) -> None:
        self._next = 0
        self.pending: list[int] = []
        self._done: list[int] = []

    def submit(self, work: Callable[[], None], overlap: bool = False) -> int:
        work()
        self._next += 1
        self.pending.append(self._next)
        return self._next

    def complete(self, ticket: int) -> None:
        self.pending.remove(ticket)
        self._done.append(ticket)

    def done(self) -> list[int]:
        out, self._done = self._done, []
        return out


T = TypeVar("T")


class InFlight(Generic[T]):
    """Copies in flight, each a ticket of ``completions`` and what it covers (a kind and the
    pages it moves), handed back once complete."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self._tickets: dict[int, tuple[str, T]] = {}

    def submit(self, kind: str, what: T, work: Callable[[], None], overlap: bool = False) -> None:
        self._tickets[self.completions.submit(work, overlap)] = (kind, what)

    def done(self) -> list[tuple[str, T]]:
        """(kind, what) of every copy completed since the last call, in completion order."""
        return [self._tickets.pop(t) for t in self.completions.done()]

    def __bool__(self) -> bool:
        return bool(self._tickets)
