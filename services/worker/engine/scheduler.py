"""Continuous batching with chunked prefill: requests join and leave between steps.

Policy only (what runs next); the engine executes it. Every step runs one decode token of each
running request that has sampled, and at most ``max_prefill_tokens`` prefill tokens in total:
first the next chunk of each request whose prefill is under way (in admission order), then the
first chunks of waiting requests, admitted FIFO while a slot and KV room exist. A long prompt
therefore runs in chunks interleaved with the other requests' decode steps; only its last chunk
samples a token. Budget goes to prefills in order, so only the last chunk of a step can leave
its request part-way, and that request's prefill comes first in the next step.

Running requests that cannot grow preempt the most recently admitted running request, which
returns to the head of the queue and is recomputed from its first token later.

Without ``chunked`` a prefill runs whole: waiting requests are admitted while their prompts fit
the budget (the first always)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from services.worker.kv.errors import HostStoreUnavailable
from services.worker.request.request import Request, Status
from services.worker.serving.cache import KVCache
from services.worker.serving.prefix_reuse import Prefixes


class Chunk(NamedTuple):
    """``tokens`` prefill tokens of ``req`` this step, from ``num_computed`` on."""

    req: Request
    tokens: int


@dataclass
class ScheduleOutput:
    prefill: list[Chunk] = field(default_factory=list)  # in pass order
    decode: list[Request] = field(default_factory=list)  # compute the last token
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # could not be set up: why
    memory_waits: int = 0  # requests left waiting because the head's admission found no room

    @property
    def prefill_tokens(self) -> int:
        return sum(c.tokens for c in self.prefill)


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_prefill_tokens: int,
        max_model_len: int,
        manifest_bytes: Callable[[Request], int] | None = None,
        chunked: bool = True,
        prefix: Prefixes | None = None,
    ) -> None:
        """``manifest_bytes``: the manifest half a durable session needs (durable KV only).
        ``kv.payload.prefill_room`` bounds each prefill pass's device footprint (see there).
        ``prefix``: prefix reuse (admissions import cached prefixes; requests leave theirs)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.kv = kv
        self.manifest_bytes = manifest_bytes
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked = chunked
        self.prefix = prefix
        # wall seconds so far (read by metrics and benchmarks): in ``schedule`` (admissions and
        # their prefix imports included), and in prefix reuse: admissions' lookups and imports,
        # requests leaving their pages (at their end, inside the step that ends them)
        self.schedule_s = 0.0
        self.import_s = 0.0
        self.leave_s = 0.0
        # running requests whose computed prompt ``_share_prefilled`` has considered
        self._shared: set[str] = set()
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
        self._shared.discard(req.request_id)
        if req.slot is not None:
            if self.prefix is not None:
                t0 = time.perf_counter()
                self.prefix.leave(req.slot, req)
                self.leave_s += time.perf_counter() - t0
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
        if victim in out.decode:
            out.decode.remove(victim)
        out.prefill = [c for c in out.prefill if c.req is not victim]

    def _room(self, req: Request, num_tokens: int, out: ScheduleOutput) -> bool:
        """KV room for ``req``'s first ``num_tokens`` tokens, preempting the most recently
        admitted running requests while it is short; False when ``req`` itself went."""
        assert req.slot is not None
        while not self.kv.ensure(req.slot, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def schedule(self) -> ScheduleOutput:
        t0 = time.perf_counter()
        try:
            return self._schedule()
        finally:
            self.schedule_s += time.perf_counter() - t0

    def _schedule(self) -> ScheduleOutput:
        out = ScheduleOutput()
        # 1. Decoding requests each add one token.
        for req in list(self.running):
            if req in self.running and not req.prefilling and self._room(req, req.num_tokens, out):
                out.decode.append(req)
        # 2. Prefills under way continue, oldest first, within the step's budget.
        budget = self.max_prefill_tokens
        room = self.kv.payload.prefill_room
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running or not req.prefilling:
                continue
            n = self._chunk(req, budget, room, bool(out.prefill))
            if n == 0 or not self._room(req, req.num_computed + n, out):
                continue
            out.prefill.append(Chunk(req, n))
            budget -= n
            room = None if room is None else room - self._footprint(req, n)
        # 3. Admit waiting requests FIFO while a slot, KV room and prefill budget remain; a
        # prompt computed since the last step is first shared with those that begin with it.
        self._share_prefilled()
        while budget > 0 and self.waiting and self.free_slots:
            req = self.waiting[0]
            n = self._chunk(req, budget, room, bool(out.prefill))
            if n == 0:
                break
            slot = self.free_slots[-1]
            manifest = 0 if self.manifest_bytes is None else self.manifest_bytes(req)
            try:
                imported = self._import(slot, req, manifest)
                admitted = bool(imported) or (
                    imported is None
                    and self.kv.admit(
                        slot, req.request_id, req.num_tokens, self._budget(req), manifest
                    )
                )
            except HostStoreUnavailable as e:  # fail fast; the engine reports it
                self.waiting.popleft()
                out.failed.append((req, str(e)))
                continue
            if not admitted:
                out.memory_waits = len(self.waiting)
                break
            self.free_slots.pop()
            self.waiting.popleft()
            req.slot, req.status, req.num_computed = slot, Status.RUNNING, imported or 0
            if req.admitted_time is None:
                req.admitted_time = time.monotonic()  # allocation wait ends
            self.running.append(req)
            if imported:  # its prefill starts past the prefix; the next step runs it if not now
                n = self._chunk(req, budget, room, bool(out.prefill))
                if n == 0:
                    continue
            out.prefill.append(Chunk(req, n))
            budget -= n
            room = None if room is None else room - self._footprint(req, n)
        # read in adaptive mode only
        self.kv.note_queue(self._budget(r) for r in self.waiting)
        self.kv.note_horizons(
            lambda: [(r.slot, self._budget(r) - r.num_tokens) for r in self.running]
        )
        return out

    def _share_prefilled(self) -> None:
        """Publishes the prompt of each running request that finished its prefill since the
        last step (``Prefixes.publish``) when a waiting request begins with its first page:
        concurrent requests sharing a system prompt compute it once, not once each."""
        done = [r for r in self.running if not r.prefilling and r.request_id not in self._shared]
        if self.prefix is None or not done:
            return
        self._shared.update(r.request_id for r in done)
        page = self.kv.cfg.page_size
        firsts = {tuple(r.prompt_ids[:page]) for r in self.waiting if len(r.prompt_ids) > page}
        for req in done:
            if len(req.prompt_ids) > page and tuple(req.prompt_ids[:page]) in firsts:
                assert req.slot is not None
                t0 = time.perf_counter()
                self.prefix.publish(req.slot, req)
                self.leave_s += time.perf_counter() - t0

    def _import(self, slot: int, req: Request, manifest: int) -> int | None:
        """``Prefixes.admit``: tokens imported, 0 (no room now) or None (no prefix)."""
        if self.prefix is None:
            return None
        t0 = time.perf_counter()
        try:
            return self.prefix.admit(slot, req, self._budget(req), manifest)
        finally:
            self.import_s += time.perf_counter() - t0

    def _footprint(self, req: Request, tokens: int) -> int:
        """What a chunk of ``tokens`` holds of ``kv.payload.prefill_room``: its tokens and the computed
        prefix of its request."""
        return req.num_computed + tokens

    def _chunk(self, req: Request, budget: int, room: int | None, shared: bool) -> int:
        """Tokens of ``req``'s next chunk with ``budget`` prefill tokens and ``room`` left this
        step (``shared``: other chunks already run in it); 0: none this step. Unchunked, a
        prefill runs whole, alone when it exceeds the budget."""
        left = req.num_tokens - req.num_computed
        if room is not None:
            room -= req.num_computed
        if not self.chunked:
            if (shared and left > budget) or (room is not None and left > room):
                return 0
            return left
        return max(0, min(left, budget, left if room is None else room))

    def _budget(self, req: Request) -> int:
        """The most tokens a request may ever hold: what its admission reserves for."""
        total = min(self.max_model_len, len(req.prompt_ids) + req.params.max_tokens)
        return max(req.num_tokens, total)
