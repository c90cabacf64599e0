"""Continuous batching: requests join and leave between steps.

Policy only (what runs next); the engine executes it. Waiting requests are admitted FIFO while a
slot and KV room exist; running requests that cannot grow by one token preempt the most recently
admitted running request, which returns to the head of the queue and is recomputed later."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.worker.engine.request import Request, Status
from services.worker.kv.cache import KVCache
from services.worker.kv.errors import HostStoreUnavailable


@dataclass
class ScheduleOutput:
    prefill: list[Request] = field(default_factory=list)  # compute all_ids[num_computed:]
    decode: list[Request] = field(default_factory=list)  # compute the last token
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # could not be set up: why


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_prefill_tokens: int,
        max_model_len: int,
        manifest_bytes: Callable[[Request], int] | None = None,
    ) -> None:
        """``manifest_bytes``: the manifest half a durable session needs (durable KV only)."""
        self.kv = kv
        self.manifest_bytes = manifest_bytes
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drops a request wherever it is and frees its slot and KV."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._free(req)

    def seat_running(self, req: Request, seat: Callable[[int], bool]) -> bool:
        """Puts an already-running request (a resumed session) in a free slot, if ``seat(slot)``
        sets its KV state up there; False (nothing changed) when no slot or room is free."""
        if not self.free_slots or not seat(self.free_slots[-1]):
            return False
        req.slot, req.status = self.free_slots.pop(), Status.RUNNING
        self.running.append(req)
        return True

    def _free(self, req: Request) -> None:
        if req.slot is not None:
            self.kv.release(req.slot)
            self.free_slots.append(req.slot)
            req.slot = None
        req.num_computed = 0

    def _preempt(self, victim: Request, out: ScheduleOutput) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> ScheduleOutput:
        out = ScheduleOutput()
        # 1. Running requests each add one token this step.
        preempted: set[Request] = set()
        for req in list(self.running):
            if req in preempted:
                continue  # preempted below for an earlier request
            assert req.slot is not None
            while not self.kv.ensure(req.slot, req.num_tokens):
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted.add(victim)
                if victim is req:
                    break
            if req not in preempted:
                out.decode.append(req)
        # 2. Admit waiting requests FIFO while a slot, KV room and prefill budget remain.
        budget = self.max_prefill_tokens
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            n = req.num_tokens
            if out.prefill and n > budget:
                break
            slot = self.free_slots[-1]
            manifest = 0 if self.manifest_bytes is None else self.manifest_bytes(req)
            try:
                admitted = self.kv.admit(slot, req.request_id, n, self._budget(req), manifest)
            except HostStoreUnavailable as e:  # fail fast; the engine reports it
                self.waiting.popleft()
                out.failed.append((req, str(e)))
                continue
            if not admitted:
                break
            self.free_slots.pop()
            self.waiting.popleft()
            req.slot, req.status, req.num_computed = slot, Status.RUNNING, 0
            if req.admitted_time is None:
                req.admitted_time = time.monotonic()  # allocation wait ends
            self.running.append(req)
            out.prefill.append(req)
            budget -= n
        # read in adaptive mode only
        self.kv.note_queue(self._budget(r) for r in self.waiting)
        self.kv.note_horizons(
            lambda: [(r.slot, self._budget(r) - r.num_tokens) for r in self.running]
        )
        return out

    def _budget(self, req: Request) -> int:
        """The most tokens a request may ever hold: what its admission reserves for."""
        total = min(self.max_model_len, len(req.prompt_ids) + req.params.max_tokens)
        return max(req.num_tokens, total)
