"""Prefill passes over the hierarchy, and the prefixes of prefills that run in chunks.

A prefill chunk's queries select among all their request's rows so far, and a long prompt's
rows are nowhere on the device but in its chunks (the hot cache holds B rows; host reads are
for decoding). So every chunk of a prefill pass is planned as spanning its request's rows from
0 (``plan``): in the tail ring while they fit it, else in the pass's scratch, where a chunk that
continues a prefill finds its request's computed prefix before it writes its own rows, and
every selection resolves directly, as in a prefill that runs whole.

Between a request's chunks its prefix stays in scratch where its last pass put it: only
prefill passes write scratch, and the request's next chunk runs in the next prefill pass (the
scheduler's order), so the prefix is moved only when its offset changes. Where it was not
carried (a session adopted part-way through its prefill) it is rebuilt from where the residency
invariant keeps every committed row: the tail ring, a ready optional page or the host backup.
A pass's footprint in scratch, its chunks and their prefixes, is bounded by ``room``."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.worker.hierarchy.device_store import DeviceStore
from services.worker.hierarchy.plan import ChunkPlan, PassPlans, host_plans, upload_plans
from services.worker.kv.batch import ForwardBatch


class Prefixes:
    def __init__(self, cfg: ModelConfig, store: DeviceStore) -> None:
        self.cfg = cfg
        self.store = store
        self.scratch = [g.scratch for g in store.geo]
        # slot -> per source the scratch offset of its rows [0, committed) after its last
        # prefill pass (None: they went to the tail ring); valid until the next prefill pass
        self.carried: dict[int, list[int | None]] = {}
        self._host: PassPlans | None = None  # the current prefill pass's plans, on the host

    @property
    def room(self) -> int:
        """The most tokens one prefill pass holds in scratch: its chunks and the computed
        prefixes of the requests they continue."""
        return self.store.shape.scratch_tokens

    def forget(self, slot: int) -> None:
        self.carried.pop(slot, None)

    def plan(self, batch: ForwardBatch) -> tuple[list[ChunkPlan], torch.Tensor, tuple[int, ...]]:
        """The plans of prefill pass ``batch`` (as ``Planner.plan`` returns them), each chunk
        spanning its request's rows from 0, with every continued prefix put in place; advances
        the ring history of chunks that go to the ring."""
        store, n = self.store, self.store.num_sources
        history = {slot: [0] * n for slot in batch.slot_ids}
        zeros = (0,) * batch.num_requests
        hp = host_plans(
            batch.slot_ids, zeros, batch.ends(), self.cfg, store.tail, self.scratch, history
        )
        for slot, after in hp.ring_hi.items():
            store.tail_hi[slot] = [
                max(a, b) for a, b in zip(store.tail_hi[slot], after, strict=True)
            ]
        plans, packed = upload_plans(hp, store.device)
        self._place(batch, hp, plans)
        self._host, self.carried = hp, {}
        return plans, packed, hp.index

    def committed(self, batch: ForwardBatch) -> None:
        """After prefill pass ``batch`` committed every chunk: where each request's rows now
        lie, for its next chunk."""
        assert self._host is not None, "plan() the pass first"
        for r, slot in enumerate(batch.slot_ids):
            self.carried[slot] = [self._offset(self._host, r, s) for s in range(len(self.scratch))]
        self._host = None

    @staticmethod
    def _offset(hp: PassPlans, r: int, s: int) -> int | None:
        """Request r's scratch offset in source s's plan, None where its chunk goes to the ring."""
        rows, in_scratch, _ = hp.distinct[hp.index[s]]
        return rows[4][r] if in_scratch[r] else None

    def _place(self, batch: ForwardBatch, hp: PassPlans, plans: list[ChunkPlan]) -> None:
        """Puts the computed prefix of every request this pass continues where its plan wants
        it. A chunk in the ring finds its prefix there (the prefix is shorter than the ring);
        one in scratch gets it from its carried offset, or rebuilt. Every source row is read
        before any is written."""
        store = self.store
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []  # (store rows, values)
        rebuilds: list[tuple[int, int, int, torch.Tensor]] = []  # (slot, source, rows, dst)
        for r, (slot, start) in enumerate(zip(batch.slot_ids, batch.starts, strict=True)):
            for s, geo in enumerate(store.geo):
                lo = self.cfg.rows_for_tokens(s, start)
                off = self._offset(hp, r, s)
                if lo == 0 or off is None:
                    continue
                rows = torch.arange(lo, device=store.device)
                dst = geo.scratch_base + off + rows
                was = self.carried.get(slot, [None] * len(store.geo))[s]
                if was is None:
                    rebuilds.append((slot, s, lo, dst))
                elif was != off:
                    moves.append((dst, store.rows[geo.scratch_base + was + rows]))
        for slot, s, lo, dst in rebuilds:
            self._rebuild(slot, s, lo, dst)
        for dst, values in moves:
            store.rows[dst] = values

    def _rebuild(self, slot: int, s: int, lo: int, dst: torch.Tensor) -> None:
        """Rows [0, lo) of ``slot``'s source ``s`` into store rows ``dst`` from where the
        residency invariant keeps them: the newest (at most T) from the tail ring, older ones
        from a ready optional page where there is one, else from the host backup."""
        store, geo = self.store, self.store.geo[s]
        a = max(0, lo - store.tail)
        slots = torch.full((lo,), slot, dtype=torch.int64, device=store.device)
        rows = torch.arange(lo, device=store.device)
        ring = store.rows[geo.ring_loc(slots[a:], rows[a:])]
        if a:
            host = store.host.base[slot, s] + rows[:a] * store.row_elems
            store.restore(dst[:a], host)
            opt = geo.opt_page(slots[:a], rows[:a])
            src = torch.where(opt >= 0, opt * store.page + rows[:a] % store.page, dst[:a])
            store.rows[dst[:a]] = store.rows[src]
        store.rows[dst[a:]] = ring
