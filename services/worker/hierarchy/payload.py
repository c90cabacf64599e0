"""Serving over the KV hierarchy (modes ``hisparse`` and ``adaptive``).

Per admitted request and source: a tail ring and a fixed hot cache of B rows, both made of
pages from one device page pool, and a host backup of every committed row. In ``adaptive``
mode the same pool also holds *optional history*: pages of a request's imported history kept
on the device while memory is spare (``residency.py``). Selection still runs over the whole
history (index keys stay resident); the resolver supplies the selected rows."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from services.kv_host_store.errors import CapacityExhausted
from services.kv_host_store.records import Region
from services.worker.hierarchy.commit import commit_pass
from services.worker.hierarchy.host_backup import HostBackups
from services.worker.hierarchy.host_copy import backup_rows_ref, restore_rows_ref
from services.worker.hierarchy.layout import lay_out_store
from services.worker.hierarchy.plan import ChunkPlan, PlannedAhead, Planner
from services.worker.hierarchy.resolver import Census, resolve_ref
from services.worker.hierarchy.selection import Resolver, Selections
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.errors import HostStoreUnavailable, describe
from services.worker.kv.paged import PagePool, SharedPages
from services.worker.model.config import ModelConfig
from services.worker.residency.completions import CudaCompletions, ImmediateCompletions
from services.worker.residency.residency import Residency

Backup = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
Restore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class HierarchyPayload:
    def __init__(
        self,
        cfg: ModelConfig,
        host: HostBackups,
        max_slots: int,
        max_model_len: int,
        page: int,
        hot_cache_rows: int,
        ring_rows: int,
        scratch_tokens: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        resolver: Resolver = resolve_ref,
        backup: Backup = backup_rows_ref,
        restore: Restore = restore_rows_ref,
        mode: str = "hisparse",
        reserve_pages: int = 0,
        populate_pages: int = 256,
        populate_payback: float = 1.0,
        overlap_refills: bool = False,
        reclaim_order: str = "largest",
        spec_block: int = 1,
        durable: bool = False,
    ) -> None:
        if hot_cache_rows < cfg.index_topk:
            raise ValueError(
                f"the hot cache (B={hot_cache_rows}) must hold one selection (k={cfg.index_topk})"
            )
        self.mode = mode
        self.cfg = cfg
        self.host = host
        self.device = torch.device(device)
        self.backup = backup  # device rows -> host arena, one launch
        self.restore = restore  # host arena -> device rows, one launch
        self.page = page
        self.ring = ring_rows
        self.num_sources = len(cfg.sources)
        lay = lay_out_store(
            cfg, max_slots, max_model_len, page, hot_cache_rows, ring_rows, scratch_tokens,
            num_pages, spec_block, dtype, device,
        )  # fmt: skip
        self.store, self.geo, self.hot = lay.store, lay.geo, lay.hot
        self.chi, self.stage_rows_total = lay.chi, lay.stage_rows_total
        self.pages = PagePool(num_pages)
        self.planner = Planner(cfg, ring_rows, [g.scratch for g in self.geo], self.device)
        self.required_pages = self.num_sources * (hot_cache_rows + ring_rows) // page
        self.committed: dict[int, list[int]] = {}  # slot -> committed rows per source
        self.ring_hi_of: dict[int, list[int]] = {}  # slot -> one past the last ring row written
        self._held: dict[int, list[int]] = {}  # slot -> its hot-cache and tail pages
        self._batch: ForwardBatch | None = None
        self.plans: list[ChunkPlan] = []  # per source; sources with equal bounds share one
        self.plan_rows: torch.Tensor | None = None  # [U, 5, R]: the U distinct plans' rows
        self.plan_index: tuple[int, ...] = ()  # per source: its plan's row of plan_rows
        self._next: PlannedAhead | None = None  # the likely next decode pass's plans
        self._epoch = 0  # advances when a slot is seated or released
        # per source: (slots, rows, locations) this pass wrote, backed up at commit
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # slot -> its index in the current batch (filled when first read in a pass: a decode
        # pass never reads it)
        self._req_of_slot = torch.full((max_slots,), -1, dtype=torch.int64, device=device)
        self._req_of_slot_stale = False
        # a decode or verify pass whose rows are all committed backs up every row it wrote
        self.all_rows = torch.ones(
            max_slots * self.num_sources * spec_block, dtype=torch.bool, device=device
        )
        self.selections = Selections(self, resolver)
        self.residency: Residency | None = None
        if mode == "adaptive":
            done = (
                CudaCompletions(self.device)
                if self.device.type == "cuda"
                else ImmediateCompletions()
            )
            self.residency = Residency(
                self,
                done,
                reserve_pages,
                populate_pages,
                reclaim_order,
                write_through=durable,
                topk=cfg.index_topk,
                payback=populate_payback,
                overlap_refills=overlap_refills,
            )
        self.refusal: str | None = None  # why the last admission found the host store full

    # ---- admission ------------------------------------------------------------------------
    def rows_of_tokens(self, source: int, num_tokens: int) -> int:
        return self.cfg.rows_for_tokens(source, num_tokens)

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        return True  # a slot's hot cache and ring are fixed; they were taken at admission

    def ensure(self, slot: int, num_tokens: int) -> bool:
        return True

    def tokens_room(self, slot: int) -> int:
        return sys.maxsize  # the hot cache and ring are fixed, the host regions sized at admission

    def admit(
        self,
        slot: int,
        request_id: str,
        max_tokens: int,
        session: dict[int, tuple[int, int]] | None = None,
        extra_pages: int = 0,
    ) -> bool:
        """Takes the request's hot-cache and tail pages and its host regions (rows for
        ``max_tokens`` tokens, and the ``session`` regions), leaving ``extra_pages`` more free
        for its index keys; False (nothing taken) when either is short. In adaptive mode a
        shortfall starts reclaiming optional history (eq. 4) and the admission tries again.
        Raises ``HostStoreUnavailable`` when the store fails."""
        if not self._room(self.required_pages + extra_pages):
            return False
        rows = [self.rows_of_tokens(s, max_tokens) for s in range(self.num_sources)]
        try:
            self.host.admit(slot, request_id, rows, session)
        except CapacityExhausted as e:
            self.refusal = str(e)
            return False
        except Exception as e:
            raise HostStoreUnavailable(f"host KV store unavailable: {describe(e)}") from e
        self.refusal = None
        self._seat(slot, [0] * self.num_sources)
        return True

    def adopt(
        self,
        slot: int,
        request_id: str,
        regions: list[Region],
        committed: list[int],
        extra_pages: int = 0,
    ) -> bool:
        """Seats an adopted request whose first ``committed[s]`` rows of each source are in
        its host regions: takes hot-cache and tail pages (the hot cache starts empty; misses
        refill it) and refills the tail ring from the host, leaving ``extra_pages`` free for its
        index keys. False when pages are short."""
        if not self._room(self.required_pages + extra_pages):
            return False
        self.host.attach(slot, request_id, regions, committed)
        self._seat(slot, committed)
        for s, geo in enumerate(self.geo):
            rows = torch.arange(max(0, committed[s] - self.ring), committed[s], device=self.device)
            if len(rows):
                host = self.host.rows_view(slot, s, int(rows[0]), committed[s])
                self.store[geo.ring_loc(torch.full_like(rows, slot), rows)] = host.to(self.device)
        return True

    def _room(self, need: int) -> bool:
        if self.residency is not None:
            return self.residency.make_room(need)
        return self.pages.free >= need

    def shared_pages(self) -> SharedPages:
        """The page pool, lent to the index keys (they count as required pages)."""
        return SharedPages(self.store[: self.pages.total * self.page], self.pages)

    def _seat(self, slot: int, committed: list[int]) -> None:
        held = self.pages.take(self.required_pages)
        self._held[slot] = held
        it = iter(held)
        for geo, hot in zip(self.geo, self.hot, strict=True):
            geo.clear(slot)
            geo.hot_pages[slot] = torch.tensor([next(it) for _ in range(geo.hot_pages.shape[1])])
            geo.tail_pages[slot] = torch.tensor([next(it) for _ in range(geo.tail_pages.shape[1])])
            hot.reset(slot)
        self.committed[slot] = list(committed)
        self.ring_hi_of[slot] = list(committed)
        self._epoch += 1
        if self.residency is not None:
            self.residency.on_admit(slot, [0] * self.num_sources)

    def maintain(self) -> None:
        """Between steps: copy completions, reclaim and repopulation (adaptive mode)."""
        if self.residency is not None:
            self.residency.maintain()

    def check(self) -> None:
        if self.residency is not None:
            self.residency.check()

    def release(self, slot: int) -> None:
        if self.residency is not None:
            self.residency.release(slot)
        self.pages.give(self._held.pop(slot, []))
        for geo in self.geo:
            geo.clear(slot)
        self.host.release(slot)
        self.committed.pop(slot, None)
        self.ring_hi_of.pop(slot, None)
        self._epoch += 1

    # ---- a forward pass -------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self.selections.begin()
        self.written.clear()
        nxt, self._next = self._next, None
        if nxt is not None and nxt.matches(batch, self._epoch):
            self.ring_hi_of.update(nxt.host.ring_hi)
            self.plans, self.plan_rows, self.plan_index = nxt.plans, nxt.packed, nxt.host.index
        else:
            self.plans, self.plan_rows, self.plan_index = self.planner.plan(batch, self.ring_hi_of)
        self._req_of_slot_stale = True

    @property
    def req_of_slot(self) -> torch.Tensor:
        """[max_slots] each slot's index in the current pass's batch."""
        if self._req_of_slot_stale:
            assert self._batch is not None
            batch = self._batch
            self._req_of_slot[batch.slots] = torch.arange(batch.num_requests, device=self.device)
            self._req_of_slot_stale = False
        return self._req_of_slot

    @property
    def census(self) -> Census:
        """Selected rows resolved direct / hot / host, and rows copied (synchronises)."""
        return Census.of(self.selections.counts)

    def pool(self, source: int) -> torch.Tensor:
        return self.store

    def chunk_locations(self, source: int, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Where this pass's rows of ``source`` (in its chunk) live: the ring or scratch."""
        assert self._batch is not None, "begin() the pass first"
        plan = self.plans[source]
        if not any(plan.scratch):  # every chunk is in its ring (decode, verify)
            return self.geo[source].ring_loc(slots, rows)
        req = self.req_of_slot[slots]
        return self.geo[source].direct(rows, req, self._batch.slots, plan)[1]

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        locs = self.chunk_locations(source, slots, rows)
        self.store[locs] = values.to(self.store.dtype)
        self.written[source] = (slots, rows, locs)

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        self.selections.prefetch(layers, batch, selection)

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        return self.selections.resolve(layer, source, batch, selection)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """The first ``num_tokens[r]`` tokens of each request are final (see ``commit.py``)."""
        commit_pass(self, batch, num_tokens)
        if batch.is_decode and list(num_tokens) == batch.ends():
            # Most decode passes are followed by the same batch one token on: plan it now,
            # while the device runs this one, so the next launch does not wait for planning.
            self._next = self.planner.ahead(batch, self.ring_hi_of, self._epoch)

    def memory_classes(self) -> tuple[int, int, int, int]:
        """Page-pool bytes: (required, optional, reserve, free) with eq. 3's meaning."""
        page_bytes = self.page * self.store.shape[1] * self.store.element_size()
        total = self.pages.total
        if self.residency is None:
            required, optional, reserve = total - self.pages.free, 0, 0
        else:
            r = self.residency
            required, optional, reserve = r.required_pages, r.optional_pages, r.reserve
        free = total - required - optional - reserve
        return required * page_bytes, optional * page_bytes, reserve * page_bytes, free * page_bytes

    def memory_bytes(self, admitted: int) -> tuple[int, int]:
        """(bytes held by admitted requests' pages, fixed bytes: scratch, staging, metadata)."""
        row = self.store.shape[1] * self.store.element_size()
        held = (self.pages.total - self.pages.free) * self.page * row
        fixed = (sum(g.scratch for g in self.geo) + self.stage_rows_total) * row + sum(
            h.nbytes_per_slot * h.map.shape[0] for h in self.hot
        )
        return held, fixed

    @property
    def nbytes(self) -> int:
        maps = sum(h.nbytes_per_slot * h.map.shape[0] for h in self.hot)
        return self.store.numel() * self.store.element_size() + maps
