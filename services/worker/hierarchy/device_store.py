"""The hierarchy's device store: the one owner of the state that its parts share.

One tensor of rows holds everything the hierarchy keeps on the device: rows ``[0, pages * p)``
are the page pool (hot caches, tails, optional history and the index keys all take pages from
it, so they compete for one budget, eq. 3), then each source's prefill scratch, then the
staging arenas of speculative verification (eq. 11). Beside the rows: the free list of pages,
each source's tables (``SourceGeometry``: hot-cache, tail and optional-history pages per slot)
and hot-cache metadata, the host backups, the copy operations between rows and the host arena,
and per slot the rows committed so far and its ring history.

The payload, the selections, the commit and adaptive residency all work on this store through
its public fields and methods; none of them holds another."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dhisparse.family.config import ModelConfig
from services.worker.hierarchy.backend import Backend
from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.host_backup import HostBackups
from services.worker.hierarchy.hot_cache import HotCache
from services.worker.hierarchy.plan import ChunkPlan
from services.worker.hierarchy.staging import StagingLayout, lay_out_staging
from services.worker.kv.paged import PagePool, SharedPages
from services.worker.kv.row_codec import RowCodec


@dataclass(frozen=True)
class StoreShape:
    """The sizes a device store is laid out from: ``page`` rows per page, B ``hot_cache_rows``
    and T ``tail_rows`` per slot and source, ``scratch_tokens`` of prefill scratch,
    ``num_pages`` in the pool and verification blocks of ``spec_block`` queries (staging)."""

    max_slots: int
    max_model_len: int
    page: int
    hot_cache_rows: int
    tail_rows: int
    scratch_tokens: int
    num_pages: int
    spec_block: int = 1
    optional_history: bool = False  # pages of imported history may stay (adaptive residency)

    def required_pages(self, num_sources: int) -> int:
        """Pages one admitted request holds whatever its length: hot cache and tail per source."""
        return num_sources * (self.hot_cache_rows + self.tail_rows) // self.page


@dataclass
class DeviceStore:
    rows: torch.Tensor  # [R, stored_width] pool pages, then scratch, then staging
    shape: StoreShape
    pages: PagePool
    geo: list[SourceGeometry]  # per source
    hot: list[HotCache]  # per source
    staging: StagingLayout
    host: HostBackups
    ops: Backend  # resolve, backup, restore
    codec: RowCodec  # how rows are stored (the serving dtype, or packed FP8 rows)
    committed: dict[int, list[int]] = field(default_factory=dict)  # slot -> rows per source
    tail_hi: dict[int, list[int]] = field(default_factory=dict)  # slot -> ring history
    held: dict[int, list[int]] = field(default_factory=dict)  # slot -> its hot and tail pages

    @staticmethod
    def build(
        cfg: ModelConfig,
        shape: StoreShape,
        host: HostBackups,
        ops: Backend,
        codec: RowCodec,
    ) -> DeviceStore:
        """Lays the store out on the host backups' device, rows as ``codec`` stores them."""
        device = host.device
        page = shape.page
        stored = [cfg.sources[s] for s in cfg.stored_sources]
        scratch = [shape.scratch_tokens // src.compress + shape.max_slots for src in stored]
        base = shape.num_pages * page
        staging = lay_out_staging(cfg, shape.max_slots, shape.spec_block, base + sum(scratch))
        total = base + sum(scratch) + staging.total_rows
        rows = torch.zeros(total, codec.stored_width, dtype=codec.storage, device=device)
        geo: list[SourceGeometry] = []
        hot: list[HotCache] = []
        for s, src in enumerate(stored):
            max_rows = shape.max_model_len // src.compress
            geo.append(SourceGeometry.create(
                shape.max_slots, page, shape.hot_cache_rows, shape.tail_rows, base, scratch[s],
                max_rows, device, staging.source_base[s], staging.rows_per_slot,
            ))  # fmt: skip
            geo[-1].optional = shape.optional_history
            hot.append(HotCache(shape.max_slots, shape.hot_cache_rows, max_rows, device))
            base += scratch[s]
        return DeviceStore(
            rows, shape, PagePool(shape.num_pages), geo, hot, staging, host, ops, codec
        )

    # ---- geometry ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def page(self) -> int:
        return self.shape.page

    @property
    def tail(self) -> int:
        """T, the tail ring's rows per slot and source."""
        return self.shape.tail_rows

    @property
    def num_sources(self) -> int:
        return len(self.geo)

    @property
    def row_elems(self) -> int:
        return self.rows.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.rows.element_size()

    @property
    def page_bytes(self) -> int:
        return self.page * self.row_bytes

    @property
    def required_pages(self) -> int:
        return self.shape.required_pages(self.num_sources)

    def shared_pages(self) -> SharedPages:
        """The page pool, lent to the index keys (they count as required pages)."""
        return SharedPages(self.rows[: self.pages.total * self.page], self.pages)

    def fixed_bytes(self) -> int:
        """Rows and metadata that do not grow with sessions: scratch, staging, hot-cache maps."""
        scratch = sum(g.scratch for g in self.geo)
        maps = sum(h.nbytes_per_slot * h.map.shape[0] for h in self.hot)
        return (scratch + self.staging.total_rows) * self.row_bytes + maps

    @property
    def nbytes(self) -> int:
        maps = sum(h.nbytes_per_slot * h.map.shape[0] for h in self.hot)
        return self.rows.numel() * self.rows.element_size() + maps

    # ---- slots ------------------------------------------------------------------------------
    def seat(self, slot: int, committed: list[int]) -> None:
        """Gives ``slot`` its hot-cache and tail pages (the caller checked that they are free)
        with empty tables, and ``committed[s]`` rows of each source already committed."""
        held = self.pages.take(self.required_pages)
        self.held[slot] = held
        it = iter(held)
        for geo, hot in zip(self.geo, self.hot, strict=True):
            geo.clear(slot)
            geo.hot_pages[slot] = torch.tensor([next(it) for _ in range(geo.hot_pages.shape[1])])
            geo.tail_pages[slot] = torch.tensor([next(it) for _ in range(geo.tail_pages.shape[1])])
            hot.reset(slot)
        self.committed[slot] = list(committed)
        self.tail_hi[slot] = list(committed)

    def unseat(self, slot: int) -> None:
        """Returns the slot's hot-cache and tail pages and clears its tables."""
        self.pages.give(self.held.pop(slot, []))
        for geo in self.geo:
            geo.clear(slot)
        self.committed.pop(slot, None)
        self.tail_hi.pop(slot, None)

    # ---- copies -----------------------------------------------------------------------------
    def backup(self, locs: torch.Tensor, dst: torch.Tensor, keep: torch.Tensor) -> None:
        """Rows ``rows[locs[i]]`` to host arena element ``dst[i]`` where ``keep[i]``, one launch
        (none where another process writes the host backups)."""
        if not self.host.writer:
            return
        self.ops.backup(self.rows, locs, dst, keep, self.host.arena)

    def restore(self, locs: torch.Tensor, src: torch.Tensor) -> None:
        """Host arena elements ``src[i]`` to rows ``rows[locs[i]]``, one launch."""
        self.ops.restore(self.rows, locs, src, self.host.arena)

    def resolve(
        self,
        source: int,
        selection: torch.Tensor,
        batch_cu: torch.Tensor,
        slots: torch.Tensor,
        plan: ChunkPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The resolver over one source's ``selection`` (see ``resolver.resolve_ref``):
        (locations, census [4])."""
        hot = self.hot[source]
        return self.ops.resolve(
            selection, batch_cu, slots, plan, self.geo[source], hot, hot.tick(), self.rows,
            self.host.arena, self.host.base[:, source],
        )  # fmt: skip
