"""Reports durable row ranges and releases to the host store off the engine thread, in order.

The engine must never wait on (or die with) the store: a call that fails is logged and dropped.
Marks are coalesced: after a mark arrives the reporter waits up to ``interval`` seconds while
more queue up (a release, a flush or closing ends the wait at once: a finished session must
not stay adoptable), then merges them per region, so a region costs one store call per
interval instead of one per forward pass (at C = 64 that was ~400 calls per verify round, and
their GIL time a quarter of the round). A durable mark lost or late costs nothing — a
session's manifest, not the store's marks, says which rows a successor may trust — and a
release lost that way is freed with the orphans once the worker is gone."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kv_host_store.intervals import add_range
from services.kv_host_store.records import RowRange
from services.worker.kv.errors import describe

if TYPE_CHECKING:
    from services.worker.kv.hierarchy.host import RegionStore

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
        self._t = threading.Thread(target=self._run, name="durability", daemon=True)
        self._t.start()

    def report(self, region_id: str, start: int, end: int) -> None:
        self._q.put(("durable", ((region_id, start, end),)))

    def report_many(self, marks: list[tuple[str, int, int]]) -> None:
        """Several (region, start, end) marks in one queue item (a decode step's)."""
        if marks:
            self._q.put(("durable", tuple(marks)))

    def release(self, region_id: str) -> None:
        self._q.put(("release", (region_id,)))

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=10)

    def flush(self) -> None:
        """Waits until everything queued so far reached the store (tests)."""
        done = threading.Event()
        self._q.put(("flush", (done,)))
        done.wait(timeout=10)

    def _run(self) -> None:
        while True:
            batch = [self._q.get()]
            if batch[0] is not None and batch[0][0] == "durable":
                # Let this interval's marks queue up and merge; anything else (a release, a
                # flush, closing) ends the wait: only marks may be late.
                deadline = time.monotonic() + self.interval
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        item = self._q.get(timeout=left)
                    except queue.Empty:
                        break
                    batch.append(item)
                    if item is None or item[0] != "durable":
                        break
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
