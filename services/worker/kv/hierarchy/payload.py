"""HiSparse serving: per request and source a tail ring and a fixed hot cache of B rows on the
device, and a host backup of every committed row. Selection still runs over the whole history
(index keys stay resident); the resolver supplies the selected rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.kv_host_store.errors import CapacityExhausted
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.hierarchy.host import HostBackups
from services.worker.kv.hierarchy.hot_cache import HotCache
from services.worker.kv.hierarchy.plan import ChunkPlan, PoolLayout
from services.worker.kv.hierarchy.resolver_ref import Census, resolve_ref
from services.worker.model.config import ModelConfig

Resolver = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class HiSparsePayload:
    mode = "hisparse"

    def __init__(
        self,
        cfg: ModelConfig,
        host: HostBackups,
        max_slots: int,
        max_model_len: int,
        hot_cache_rows: int,
        ring_rows: int,
        scratch_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        resolver: Resolver = resolve_ref,
    ) -> None:
        if hot_cache_rows < cfg.index_topk:
            raise ValueError(
                f"the hot cache (B={hot_cache_rows}) must hold one selection (k={cfg.index_topk})"
            )
        self.cfg = cfg
        self.host = host
        self.device = torch.device(device)
        self.resolver = resolver
        self.ring = ring_rows
        self.layouts: list[PoolLayout] = []
        self.pools: list[torch.Tensor] = []
        self.hot: list[HotCache] = []
        for src in cfg.sources:
            m = src.compress
            layout = PoolLayout(
                max_slots, hot_cache_rows, ring_rows, scratch_tokens // m + max_slots
            )
            self.layouts.append(layout)
            self.pools.append(torch.zeros(layout.rows, cfg.d_kv, dtype=dtype, device=device))
            self.hot.append(HotCache(max_slots, hot_cache_rows, max_model_len // m, device))
        self.committed: dict[int, list[int]] = {}  # slot -> committed rows per source
        self._census = torch.zeros(4, dtype=torch.int64, device=device)
        self._batch: ForwardBatch | None = None
        self._plans: list[ChunkPlan] = []
        self._req_of_slot = torch.full((max_slots,), -1, dtype=torch.int64, device=device)
        # Follower resolutions started early, on a side stream on a GPU: layer -> (locs, event)
        self._prefetched: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- admission ------------------------------------------------------------------------
    def _rows(self, source: int, num_tokens: int) -> int:
        return self.cfg.rows_for_tokens(source, num_tokens)

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        return True  # hot cache and ring are fixed per slot

    def ensure(self, slot: int, num_tokens: int) -> bool:
        return True

    def admit(self, slot: int, request_id: str, max_tokens: int) -> bool:
        """Allocates the request's host regions (rows for ``max_tokens`` tokens)."""
        try:
            self.host.admit(
                slot, request_id, [self._rows(s, max_tokens) for s in range(len(self.pools))]
            )
        except CapacityExhausted:
            return False
        for hot in self.hot:
            hot.reset(slot)
        self.committed[slot] = [0] * len(self.pools)
        return True

    def release(self, slot: int) -> None:
        self.host.release(slot)
        self.committed.pop(slot, None)

    # ---- a forward pass -------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._prefetched.clear()
        self._plans = []
        ends = batch.ends()
        for s, layout in enumerate(self.layouts):
            lo = [self._rows(s, a) for a in batch.starts]
            hi = [self._rows(s, e) for e in ends]
            plan = ChunkPlan.build(lo, hi, self.ring, self.device)
            if plan.scratch_rows > layout.scratch:
                raise ValueError(
                    f"a pass of {plan.scratch_rows} rows exceeds the prefill scratch "
                    f"({layout.scratch} rows)"
                )
            self._plans.append(plan)
        self._req_of_slot[batch.slots] = torch.arange(batch.num_requests, device=self.device)

    @property
    def census(self) -> Census:
        """Selected rows resolved direct / hot / host, and rows copied (synchronises)."""
        return Census.of(self._census)

    def pool(self, source: int) -> torch.Tensor:
        return self.pools[source]

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        assert self._batch is not None, "begin() the pass first"
        req = self._req_of_slot[slots]
        locs = self.layouts[source].direct_locations(
            rows, req, self._batch.slots, self._plans[source]
        )
        self.pools[source][locs] = values.to(self.pools[source].dtype)

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        """Starts resolving ``(layer, source)`` pairs that share ``selection`` (the followers of
        an index producer) so their host reads overlap the layers computed in between. On a
        GPU they run on a side stream that first waits for everything issued so far: earlier
        readers of those sources are done, and the selection is complete."""
        if self._side is None:
            for layer, source in layers:
                self._prefetched[layer] = (self._resolve(source, batch, selection), None)
            return
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            for layer, source in layers:
                locs = self._resolve(source, batch, selection)
                locs.record_stream(main)
                event = torch.cuda.Event()
                event.record(self._side)
                self._prefetched[layer] = (locs, event)

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        done = self._prefetched.pop(layer, None)
        if done is not None:
            locs, event = done
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            return locs
        return self._resolve(source, batch, selection)

    def _resolve(self, source: int, batch: ForwardBatch, selection: torch.Tensor) -> torch.Tensor:
        plan = self._plans[source]
        if plan.all_direct:  # nothing older than the ring: no hot scan, no host reads
            valid = selection >= 0
            req = batch.token_req.unsqueeze(1).expand_as(selection)
            locs = self.layouts[source].direct_locations(selection, req, batch.slots, plan)
            self._census[0] += valid.sum()
            return torch.where(valid, locs, -1)
        hot = self.hot[source]
        locs, census = self.resolver(
            selection,
            batch.cu_lens,
            batch.slots,
            plan,
            self.layouts[source],
            hot,
            hot.tick(),
            self.pools[source],
            self.host.arena,
            self.host.base[:, source],
        )
        self._census += census
        return locs

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """The first ``num_tokens[r]`` tokens of each request are final: back up their complete
        rows written by this pass to the host, then keep the newest rows in the tail ring."""
        slots = batch.slots.tolist()
        for s, (layout, plan) in enumerate(zip(self.layouts, self._plans, strict=True)):
            pool = self.pools[s]
            for r, slot in enumerate(slots):
                lo, new = plan.lo[r], self._rows(s, num_tokens[r])
                if new <= lo:
                    continue
                rows = torch.arange(lo, new, device=self.device)
                req = torch.full_like(rows, r)
                values = pool[layout.direct_locations(rows, req, batch.slots, plan)]
                self.host.write(slot, s, lo, values)
                self.host.mark_durable(slot, s, new)
                self.committed[slot][s] = new
                if plan.scratch[r]:  # the ring takes the chunk's newest rows
                    keep = rows[rows >= new - self.ring]
                    ring_locs = layout.ring_base + slot * self.ring + keep % self.ring
                    pool[ring_locs] = values[-len(keep) :]

    def memory_bytes(self, admitted: int) -> tuple[int, int]:
        """(bytes held for ``admitted`` slots, fixed bytes: scratch)."""
        per_slot = fixed = 0
        for layout, pool, hot in zip(self.layouts, self.pools, self.hot, strict=True):
            row = pool.shape[1] * pool.element_size()
            per_slot += (layout.hot_entries + layout.ring) * row + hot.nbytes_per_slot
            fixed += layout.scratch * row
        return admitted * per_slot, fixed

    @property
    def nbytes(self) -> int:
        pools = sum(p.numel() * p.element_size() for p in self.pools)
        maps = sum(h.nbytes_per_slot * h.map.shape[0] for h in self.hot)
        return pools + maps
