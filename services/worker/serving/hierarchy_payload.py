"""Serving over the KV hierarchy (modes ``hisparse`` and ``adaptive``).

Per admitted request and stored source (``ModelConfig.stored_sources``: a source that keeps no
history has its token ring alone): a tail ring and a fixed hot cache of B rows, both made of
pages from one device page pool (``device_store.py``), and a host backup of every committed
row. In ``adaptive`` mode the same pool also holds *optional history*: pages of a request's
imported history kept on the device while memory is spare (``services.worker.residency``).
Selection still runs over the whole history (index keys stay resident); the resolver supplies
the selected rows."""

from __future__ import annotations

import sys

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.errors import CapacityExhausted
from services.kv_host_store.records import Region
from services.worker.hierarchy import tail
from services.worker.hierarchy.device_store import DeviceStore
from services.worker.hierarchy.plan import PlannedAhead, Planner
from services.worker.hierarchy.prefill import Prefixes
from services.worker.hierarchy.selection import Selections
from services.worker.kv.backend import FixedResidency, ResidencyControl
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import FollowerPrefetch, ResidencyConfig
from services.worker.kv.errors import HostStoreUnavailable, describe
from services.worker.kv.pass_rows import source_rates
from services.worker.kv.pass_state import PassState
from services.worker.kv.reports import Census
from services.worker.residency.completions import CudaCompletions, ImmediateCompletions
from services.worker.residency.residency import Residency
from services.worker.serving.hierarchy_commit import commit_pass


class HierarchyPayload:
    def __init__(
        self,
        cfg: ModelConfig,
        store: DeviceStore,
        residency: ResidencyConfig | None = None,
        durable: bool = False,
        prefetch: FollowerPrefetch = FollowerPrefetch(),
    ) -> None:
        """``residency``: adaptive residency's settings (mode ``adaptive``); None: ``hisparse``.
        ``durable``: sessions survive this process, so imported history is written through.
        ``prefetch``: when an index producer's followers resolve."""
        shape = store.shape
        if shape.hot_cache_rows < cfg.index_topk:
            raise ValueError(
                f"the hot cache (B={shape.hot_cache_rows}) must hold one selection "
                f"(k={cfg.index_topk})"
            )
        self.mode = "hisparse" if residency is None else "adaptive"
        self.cfg = cfg
        self.store = store
        self.device = store.device
        self.planner = Planner(cfg, store.tail, [g.scratch for g in store.geo], self.device)
        self.prefixes = Prefixes(cfg, store)
        slot_index = torch.full((shape.max_slots,), -1, dtype=torch.int64, device=self.device)
        self.pass_state = PassState(slot_index=slot_index, sources=source_rates(cfg))
        self.selections = Selections(store, self.pass_state, prefetch)
        self._next: PlannedAhead | None = None  # the likely next decode pass's plans
        self._epoch = 0  # advances when a slot is seated or released
        # a decode or verify pass whose rows are all committed backs up every row it wrote
        self.all_rows = torch.ones(
            shape.max_slots * store.num_sources * shape.spec_block,
            dtype=torch.bool, device=self.device,
        )  # fmt: skip
        self._adaptive: Residency | None = None  # mode ``adaptive``
        if residency is not None:
            done = (
                CudaCompletions(self.device)
                if self.device.type == "cuda"
                else ImmediateCompletions()
            )
            self._adaptive = Residency(
                store, done, residency, topk=cfg.index_topk, write_through=durable
            )
        # what moves optional history between steps (hisparse: nothing)
        self.residency: ResidencyControl = self._adaptive or FixedResidency()
        self._refusal: str | None = None

    # ---- admission ------------------------------------------------------------------------
    @property
    def required_pages(self) -> int:
        return self.store.required_pages

    @property
    def refusal(self) -> str | None:
        return self._refusal

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
        n = self.store.num_sources
        rows = [self.cfg.rows_for_tokens(s, max_tokens) for s in range(n)]
        try:
            self.store.host.admit(slot, request_id, rows, session)
        except CapacityExhausted as e:
            self._refusal = str(e)
            return False
        except Exception as e:
            raise HostStoreUnavailable(f"host KV store unavailable: {describe(e)}") from e
        self._refusal = None
        self._seat(slot, [0] * n)
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
        self.store.host.attach(slot, request_id, regions, committed)
        self._seat(slot, committed)
        for s, geo in enumerate(self.store.geo):
            tail.refill(self.store.rows, geo, self.store.host, slot, s, committed[s])
        return True

    def _room(self, need: int) -> bool:
        if self._adaptive is not None:
            return self._adaptive.make_room(need)
        return self.store.pages.available >= need

    def _seat(self, slot: int, committed: list[int]) -> None:
        self.store.seat(slot, committed)
        self.prefixes.forget(slot)
        self._epoch += 1
        if self._adaptive is not None:
            self._adaptive.on_admit(slot, committed)

    def release(self, slot: int) -> None:
        if self._adaptive is not None:
            self._adaptive.release(slot)
        self.store.unseat(slot)
        self.store.host.release(slot)
        self.prefixes.forget(slot)
        self._epoch += 1

    # ---- a forward pass -------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> None:
        self.selections.begin()
        nxt = self._next
        if nxt is not None and not batch.prefill and nxt.matches(batch, self._epoch):
            self._next = None
            self.store.tail_hi.update(nxt.host.ring_hi)
            self.pass_state.begin(batch, nxt.plans, nxt.packed, nxt.host.index)
            return
        if nxt is not None and not set(nxt.slots).isdisjoint(batch.slot_ids):
            self._next = None  # a pass of other slots (a prefill) leaves it valid
        if batch.prefill:
            self.pass_state.begin(batch, *self.prefixes.plan(batch))
        else:
            self.pass_state.begin(batch, *self.planner.plan(batch, self.store.tail_hi))

    @property
    def prefill_room(self) -> int:
        return self.prefixes.room

    def pool(self, source: int) -> torch.Tensor:
        return self.store.rows

    def chunk_locations(self, source: int, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Where this pass's rows of ``source`` (in its chunk) live: the ring or scratch."""
        state = self.pass_state
        assert state.batch is not None, "begin() the pass first"
        plan, geo = state.plans[source], self.store.geo[source]
        if not any(plan.scratch):  # every chunk is in its ring (decode, verify)
            return geo.ring_loc(slots, rows)
        req = state.req_of_slot()[slots]
        return geo.direct(rows, req, state.batch.slots, plan)[1]

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        locs = self.chunk_locations(source, slots, rows)
        self.store.codec.store(self.store.rows, locs, values)
        self.pass_state.written[source] = (slots, rows, locs)

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
        commit_pass(
            self.cfg, self.store, self.pass_state, self._adaptive, num_tokens, self.all_rows
        )
        if batch.prefill:
            self.prefixes.committed(batch)
        elif batch.is_decode and list(num_tokens) == batch.ends():
            # Most decode passes are followed by the same batch one token on: plan it now,
            # while the device runs this one, so the next launch does not wait for planning.
            self._next = self.planner.ahead(batch, self.store.tail_hi, self._epoch)

    def reserve_graph_workspace(self, stream: int, tokens: int, max_batch: int) -> None:
        """The resolver's workspaces at their largest on ``stream`` and on the stream the
        followers resolve on (a parallel branch of the captured graph)."""
        k = self.cfg.index_topk
        if any(m > 1 for m, _ in self.pass_state.sources):
            # a compressed source's layer may resolve every visible row, a hot cache's worth
            # of columns at a time (DeepSeek-V4's HCA layers): room for the widest
            k = max(k, *(h.entries for h in self.store.hot))
        side = self.selections.side_stream
        for s in (stream,) if side is None else (stream, side):
            for entries in {h.entries for h in self.store.hot}:
                self.store.ops.reserve(self.device, s, tokens, k, max_batch, entries)

    # ---- accounting -------------------------------------------------------------------------
    def memory(self, admitted: int) -> tuple[int, int, int]:
        """Page-pool bytes by class of eq. 3, the fixed allocations counted as required."""
        page_bytes, pages = self.store.page_bytes, self.store.pages
        cached = pages.reclaimable  # only cached index keys hold them: optional
        if self._adaptive is None:
            required, optional, reserve = pages.total - pages.available, cached, 0
        else:
            r = self._adaptive
            required, optional, reserve = r.required_pages, r.optional_pages + cached, r.reserve
        fixed = self.fixed_bytes()
        return required * page_bytes + fixed, optional * page_bytes, reserve * page_bytes

    def fixed_bytes(self) -> int:
        return self.store.fixed_bytes()

    def layout(self) -> dict[str, int | None]:
        return {"hot_cache_rows": self.store.shape.hot_cache_rows, "tail_rows": self.store.tail}

    @property
    def census(self) -> Census:
        return self.selections.census

    @property
    def nbytes(self) -> int:
        return self.store.nbytes
