"""Reports durable row ranges and releases to the host store off the engine thread, in order.

The engine must never wait on (or die with) the store: a call that fails is logged and dropped.
Marks are coalesced: after a mark arrives the reporter sleeps ``interval`` seconds while more
queue up (a release, a flush or closing wakes it at once: a finished session must not stay
adoptable), then merges them per region, so a region costs one store call per interval instead
of one per forward pass (at C = 64 that was ~400 calls per verify round, and their GIL time a
quarter of the round). Marks queued meanwhile do not wake it: the thread takes the GIL once per
interval, not once per step (each wake-up delayed the engine's next launch). A decode step
reports each region's whole durable state (``report_state``), which supersedes what is pending
for it, so merging costs the reporter nothing per mark. A durable mark lost or late costs
nothing — a session's manifest, not the store's marks, says which rows a successor may trust —
and a release lost that way is freed with the orphans once the worker is gone."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kv_host_store.intervals import add_range
from services.kv_host_store.records import RowRange
from services.worker.kv.errors import describe

if TYPE_CHECKING:
    from services.worker.hierarchy.region_store import RegionStore

log = logging.getLogger(__name__)


@dataclass
class OwnerId:
    """The worker process the store knows: its worker id and current generation (shared by
    everything that calls the store for this engine, and changed when it re-registers)."""

    owner: str
    generation: int = 0


class DurabilityReporter:
    def __init__(self, store: RegionStore, who: OwnerId, interval: float = 0.05) -> None:
        self.store = store
        self.who = who
        self.interval = interval
        self._q: queue.SimpleQueue[tuple[str, tuple] | None] = queue.SimpleQueue()
        self._failing = False  # the last call failed: log once per outage, not per call
        self._urgent = threading.Event()  # set with anything that must not wait out the interval
        self._t = threading.Thread(target=self._run, name="durability", daemon=True)
        self._t.start()

    def report(self, region_id: str, start: int, end: int) -> None:
        self._q.put(("durable", ((region_id, start, end),)))

    def report_state(self, states: list[tuple[str, tuple[RowRange, ...]]]) -> None:
        """Each (region, ranges): every durable range of the region so far, a superset of what
        was reported for it before (one queue item for a decode step's regions)."""
        if states:
            self._q.put(("state", tuple(states)))

    def release(self, region_id: str) -> None:
        self._urgent_put(("release", (region_id,)))

    def close(self) -> None:
        self._urgent_put(None)
        self._t.join(timeout=10)

    def flush(self) -> None:
        """Waits until everything queued so far reached the store (tests)."""
        done = threading.Event()
        self._urgent_put(("flush", (done,)))
        done.wait(timeout=10)

    def _urgent_put(self, item: tuple[str, tuple] | None) -> None:
        self._q.put(item)
        self._urgent.set()  # after the put: the wait ends with the item already queued

    def _run(self) -> None:
        while True:
            batch = [self._q.get()]
            if batch[0] is not None and batch[0][0] in ("durable", "state"):
                # Let this interval's marks queue up and merge; anything else (a release, a
                # flush, closing) ends the wait: only marks may be late.
                self._urgent.wait(self.interval)
            self._urgent.clear()
            while True:  # drain what queued up meanwhile, so ranges of a region merge
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            pending: dict[str, tuple[RowRange, ...]] = {}
            for item in batch:
                if item is None:
                    self._flush(pending)
                    return
                op, args = item
                if op == "state":
                    pending.update(args)
                    continue
                if op == "durable":
                    for region_id, start, end in args:
                        pending[region_id] = add_range(pending.get(region_id, ()), start, end)
                    continue
                if op == "release":  # its durable rows no longer matter
                    pending.pop(args[0], None)
                self._flush(pending)
                pending = {}
                self._call(op, args)
            self._flush(pending)

    def _flush(self, pending: dict[str, tuple[RowRange, ...]]) -> None:
        for region_id, ranges in pending.items():
            for r in ranges:
                self._call("durable", (region_id, r.start, r.end))

    def _call(self, op: str, args: tuple) -> None:
        owner, gen = self.who.owner, self.who.generation
        try:
            if op == "durable":
                self.store.mark_durable(args[0], owner, args[1], args[2], generation=gen)
            elif op == "release":
                self.store.release_region(owner, args[0], generation=gen)
            else:
                args[0].set()
                return
        except Exception as e:  # the store being down must not take the engine with it
            if not self._failing:
                log.warning(
                    "host store call %s failed (further failures not logged): %s", op, describe(e)
                )
            self._failing = True
            return
        if self._failing:
            log.info("host store calls succeed again")
            self._failing = False
