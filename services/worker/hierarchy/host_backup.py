"""Host backups: every committed row of every request, in the node's kv_host_store arena.

One request's rows of one source are one contiguous region (DESIGN §3), so a step's misses
fall in a few windows of the arena. The worker maps the arena file and moves bytes itself; the
store only hands out regions and records which rows are durable. Besides its KV sources a
request may hold *session regions* (negative source ids): backed-up index keys and its manifest
(``services.worker.durable``), which let a successor resume it after this process died."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.kv_host_store.arena import ArenaMapping
from services.kv_host_store.intervals import add_range, contains
from services.kv_host_store.records import Region, RegionSpec, RowRange
from services.worker.hierarchy.region_store import RegionStore
from services.worker.hierarchy.reporter import DurabilityReporter, OwnerId


class HostPointer:
    """A host tensor as a Triton kernel argument: under UVA a pinned (registered) host pointer
    is valid on the device, but Triton refuses CPU tensors, so pass pointer and dtype only."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


@dataclass
class _Backed:
    region: Region
    base: int  # element offset of row 0 in the typed arena view
    durable: tuple[RowRange, ...] = ()  # rows holding committed bytes (merged)


class HostBackups:
    """Per slot and source: a region and its element base in ``arena`` (the typed view); per
    slot, its session regions by (negative) source id."""

    def __init__(
        self,
        store: RegionStore,
        mapping: ArenaMapping,
        owner: str,
        num_sources: int,
        row_elems: int,
        dtype: torch.dtype,
        max_slots: int,
        device: torch.device | str,
        writer: bool = True,
    ) -> None:
        """``writer``: whether this process copies rows into the arena (False: another
        process writes the same rows into the same regions, ``rank_group.region_group``)."""
        self.store = store
        self.writer = writer
        self.who = OwnerId(owner)
        self.num_sources = num_sources
        self.row_elems = row_elems
        self.dtype = dtype
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = row_elems * self.esize
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self._map(mapping)
        # [max_slots, num_sources] element base of each region (-1: none), for kernels
        self.base = torch.full((max_slots, num_sources), -1, dtype=torch.int64, device=device)
        self._backed: dict[int, list[_Backed]] = {}
        self._session: dict[int, dict[int, Region]] = {}
        self._request_of: dict[int, str] = {}
        self._durability = DurabilityReporter(store, self.who)

    def _map(self, mapping: ArenaMapping) -> None:
        self.mapping = mapping
        usable = mapping.capacity - mapping.capacity % self.esize
        self.arena = mapping.tensor[:usable].view(self.dtype)  # [capacity / esize] elements
        if self.on_gpu:
            mapping.pin()

    @property
    def owner(self) -> str:
        return self.who.owner

    @property
    def generation(self) -> int:
        return self.who.generation

    def remap(self, mapping: ArenaMapping, generation: int) -> None:
        """Moves to another arena (the store restarted) under a new generation. Only while no
        slot holds regions: their bytes live in the old arena."""
        if self._backed:
            raise RuntimeError(f"{len(self._backed)} slots still hold regions of the old arena")
        self._map(mapping)
        self.who.generation = generation

    def admit(
        self,
        slot: int,
        request_id: str,
        rows_per_source: list[int],
        session: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        """Allocates one contiguous region per source, and the session regions ``{source id:
        (rows, row bytes)}``. Raises what the store raises (``CapacityExhausted``, or a
        transport error when it is down), with nothing left allocated."""
        regions = self.allocate_regions(request_id, rows_per_source, session)
        self._seat(slot, request_id, regions, [0] * self.num_sources)

    def allocate_regions(
        self,
        request_id: str,
        rows_per_source: list[int],
        session: dict[int, tuple[int, int]] | None = None,
        store: RegionStore | None = None,
    ) -> list[Region]:
        """``admit``'s regions, seated nowhere (for ``attach``, or to hand to the store as a
        cached prefix); raises as ``admit`` does, with nothing left allocated. ``store``: the
        store to ask instead of this rank's (``RankGroup.own_store``: a call the other ranks of
        a tensor-parallel group do not make)."""
        specs = [
            RegionSpec(s, max(1, rows), self.row_bytes) for s, rows in enumerate(rows_per_source)
        ]
        specs += [
            RegionSpec(s, rows, row_bytes) for s, (rows, row_bytes) in (session or {}).items()
        ]
        w = self.who
        store = self.store if store is None else store
        # one call, all or none: the store keeps nothing of a refused admission
        return store.allocate_many(request_id, w.owner, specs, w.generation)

    def release_regions(self, regions: list[Region]) -> None:
        """Frees regions that no slot holds (queued to the store, as every release is)."""
        for r in regions:
            self._durability.release(r.region_id)

    def regions(self, slot: int) -> list[Region]:
        """The slot's regions: one per source, then its session regions."""
        return [b.region for b in self._backed[slot]] + list(self._session[slot].values())

    def attach(
        self, slot: int, request_id: str, regions: list[Region], committed: list[int]
    ) -> None:
        """Seats an adopted request's regions (no allocation, no copy): rows ``[0,
        committed[s])`` of source s are durable (its manifest says so)."""
        self._seat(slot, request_id, regions, committed)
        for s, n in enumerate(committed):
            if n:
                self._durability.report(self._backed[slot][s].region.region_id, 0, n)

    def _seat(
        self, slot: int, request_id: str, regions: list[Region], committed: list[int]
    ) -> None:
        by_source = {r.source: r for r in regions}
        missing = [s for s in range(self.num_sources) if s not in by_source]
        if missing:
            raise ValueError(f"request {request_id!r} has no host region for sources {missing}")
        backed = []
        for s in range(self.num_sources):
            region = by_source[s]
            assert region.offset % self.esize == 0 and region.row_bytes == self.row_bytes
            durable = (RowRange(0, committed[s]),) if committed[s] else ()
            backed.append(_Backed(region, region.offset // self.esize, durable))
        self._backed[slot] = backed
        self._session[slot] = {s: r for s, r in by_source.items() if s < 0}
        self._request_of[slot] = request_id
        self.base[slot] = torch.tensor([b.base for b in backed], dtype=torch.int64)

    def release(self, slot: int) -> None:
        """Frees the slot's regions (by region, not by request id: a client may reuse a finished
        request's id before this release reaches the store)."""
        self._request_of.pop(slot, None)
        backed = self._backed.pop(slot, [])
        session = self._session.pop(slot, {})
        self.base[slot] = -1
        for region in [b.region for b in backed] + list(session.values()):
            self._durability.release(region.region_id)

    def rows_view(self, slot: int, source: int, start: int, end: int) -> torch.Tensor:
        """[end - start, row_elems] host view of rows of one slot's source."""
        b = self._backed[slot][source].base
        return self.arena[b + start * self.row_elems : b + end * self.row_elems].view(
            -1, self.row_elems
        )

    def session_rows(
        self, slot: int, source: int, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """[end - start, row_bytes / itemsize] typed host view of rows of a session region."""
        region = self._session[slot][source]
        a, b = region.offset + start * region.row_bytes, region.offset + end * region.row_bytes
        return self.mapping.tensor[a:b].view(dtype).view(end - start, -1)

    def write(self, slot: int, source: int, start: int, values: torch.Tensor) -> None:
        """Backs up rows ``start ..`` of a slot's source (values [n, row_elems]). From a GPU the
        copy is asynchronous into the registered arena: it is ordered before every later
        kernel, including the resolver's host reads, so nothing waits for it."""
        if not self.writer:
            return
        n = values.shape[0]
        self.rows_view(slot, source, start, start + n).copy_(values, non_blocking=self.on_gpu)

    def mark_durable(self, slot: int, source: int, start: int, end: int) -> None:
        """Rows [start, end) of the slot's source now hold committed bytes on the host."""
        self.mark_durable_many([(slot, source, start, end)])

    def mark_durable_many(self, marks: list[tuple[int, int, int, int]]) -> None:
        """``mark_durable`` for each (slot, source, start, end), reported to the store as one
        batch (a decode step marks every request's and source's new row)."""
        report = []
        for slot, source, start, end in marks:
            if end <= start:
                continue
            b = self._backed[slot][source]
            b.durable = add_range(b.durable, start, end)
            report.append((b.region.region_id, b.durable))
        self._durability.report_state(report)

    def durable(self, slot: int, source: int, start: int, end: int) -> bool:
        """Whether rows [start, end) of the slot's source all have host copies."""
        return end <= start or contains(self._backed[slot][source].durable, start, end)

    @property
    def slots(self) -> int:
        """Slots holding regions."""
        return len(self._backed)

    def flush(self) -> None:
        """Waits until every durable mark and release queued so far reached the store."""
        self._durability.flush()

    def close(self) -> None:
        self._durability.close()
