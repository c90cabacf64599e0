"""The KV state of a worker: payload (where rows live: the serving mode), index keys (always
resident) and token rings (local windows and incomplete compression groups)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.arena import ArenaMapping
from services.kv_host_store.records import Region
from services.worker.kv.backend import PayloadBackend
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import MODES, KVCacheConfig, MemoryUsage, bytes_per_token
from services.worker.kv.index_keys import IndexKeys
from services.worker.kv.page_end_carry import PageEndCarry
from services.worker.kv.row_codec import kv_codecs
from services.worker.kv.token_ring import ExtendedRows, TokenRing
from services.worker.kv.workspace import attention_block_tokens, workspace_bytes
from services.worker.serving.resident import ResidentPayload

if TYPE_CHECKING:
    from services.worker.hierarchy.host_backup import HostBackups
    from services.worker.hierarchy.local_store import LocalHostStore
    from services.worker.hierarchy.region_store import RegionStore
    from services.worker.hierarchy.session import SessionBackup

__all__ = ["CARRY", "STATE_RINGS", "KVCache"]

CARRY = -1  # the carry's key among the token rings a durable session snapshots
STATE_RINGS = -2  # the first key of a model's state rings among them (then -3, -4, ...)


class KVCache:
    """Everything a worker keeps per slot for attention: ``payload`` (the mode), ``index_keys``
    and one ``TokenRing`` per source that has a local window or compression. A model with a
    lagged source (the MTP layer's, docs/mtp.md) also has a ``carry``: a ring of the target's
    final hidden states at each slot's last positions, which the next pass's first lagged row
    needs.

    ``host`` (hierarchy modes) is the host store: ``(RegionStore, ArenaMapping)``; without one a
    private arena is created in this process.

    ``codecs`` say how payload rows and index keys are stored (``cfg.kv_cache_dtype``); token
    rings and the carry always hold the serving dtype. In fp8, attention reads the selected
    rows dequantized into a fixed workspace (``attention_rows``)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: KVCacheConfig,
        host: tuple[RegionStore, ArenaMapping] | None = None,
    ) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"unknown serving mode {cfg.mode!r}; choose from {MODES}")
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.codecs = kv_codecs(model_cfg, cfg.kv_cache_dtype, cfg.dtype)
        esize = torch.empty((), dtype=cfg.dtype).element_size()
        self.rings: dict[int, TokenRing] = {}
        for s, src in enumerate(model_cfg.sources):
            if src.window > 0 or src.compress > 1:
                ring = max(src.window, src.compress) + cfg.token_ring_extra
                self.rings[s] = TokenRing(
                    cfg.max_slots, ring, model_cfg.d_kv, cfg.dtype, cfg.device
                )
        self.carry: TokenRing | None = None
        if any(src.lag for src in model_cfg.sources):
            # a verify round of K tokens may commit only its first: the ring keeps all K
            # what the lagged rows read of the target: its final hidden state, or a model's own
            # width (``extra["carry_width"]``: DeepSeek-V4's hyper-connection streams)
            width = model_cfg.extra.get("carry_width", model_cfg.d_model)
            self.carry = TokenRing(
                cfg.max_slots, max(1, cfg.spec_block), width, cfg.dtype, cfg.device
            )
        # what a durable session's manifest snapshots: the source rings and the carry
        self.snapshot_rings = dict(self.rings)
        if self.carry is not None:
            self.snapshot_rings[CARRY] = self.carry
        # a model's own per-slot state, ``extra["state_rings"]`` [(rows, width), ...] of its
        # topology (DeepSeek-V4's compressors): ring j at key STATE_RINGS - j, with a verify
        # block's and a page's rows beyond (``token_ring_extra``) like the source rings, so a
        # verify pass's rejected positions overwrite none the next pass reads
        for j, (rows, width) in enumerate(model_cfg.extra.get("state_rings", ())):
            self.snapshot_rings[STATE_RINGS - j] = TokenRing(
                cfg.max_slots, rows + cfg.token_ring_extra, width, cfg.dtype, cfg.device
            )
        self._local_store: LocalHostStore | None = None
        self.resident: ResidentPayload | None = None  # the payload, in resident mode
        self.host_backups: HostBackups | None = None
        # durable sessions: keys, manifest and ring snapshots (hierarchy)
        self.sessions: SessionBackup | None = None
        rings = self.ring_bytes
        # held for the passes' index scoring and fp8 attention (on a GPU): ``kv/workspace.py``
        self.workspace = workspace_bytes(model_cfg, cfg)
        # fp8: query tokens whose rows ``attention_rows`` dequantizes at once (None: no limit)
        self.attention_block: int | None = None
        self._attention_ws: torch.Tensor | None = None  # [block * k, d_kv] fp8 only
        if self.codecs.fp8:
            self.attention_block = attention_block_tokens(cfg)
            self._attention_ws = torch.empty(
                self.attention_block * model_cfg.index_topk, model_cfg.d_kv, dtype=cfg.dtype,
                device=cfg.device,
            )  # fmt: skip
        fixed = rings + self.workspace
        args = (cfg.page_size, cfg.max_slots, cfg.max_model_len, cfg.dtype, cfg.device)
        if cfg.mode == "resident":
            per_token = bytes_per_token(
                model_cfg, esize, True, self.codecs.rows.row_bytes, self.codecs.keys.row_bytes
            )
            if fixed >= cfg.kv_pool_bytes:
                raise ValueError(
                    f"a KV pool of {cfg.kv_pool_bytes} B cannot hold the token rings and the "
                    f"index-score workspace ({fixed} B): enlarge the pool or lower "
                    "max_num_seqs, max_model_len or max_prefill_tokens"
                )
            self.tokens_capacity = int((cfg.kv_pool_bytes - fixed) // per_token)
            self.index_keys = IndexKeys(
                model_cfg, self.tokens_capacity, *args, codec=self.codecs.keys
            )
            self.resident = ResidentPayload(
                model_cfg, self.tokens_capacity, *args, codec=self.codecs.rows
            )
            self.payload: PayloadBackend = self.resident
        else:
            # Index keys borrow pages of the payload's pool: one budget for everything (eq. 3).
            self.payload = self._hierarchy(host, fixed, args)
        self._admitted: set[int] = set()
        self._fresh_pages: dict[int, int] = {}  # token budget -> pages its admission takes
        self._ensured: dict[int, int] = {}  # slot -> tokens it holds without new pages
        # frees the pages of one cached prefix, least recently used first; False when none is
        # left (``serving.device_prefix``: resident mode); None: nothing is cached on the device
        self.reclaim: Callable[[], bool] | None = None
        # the carry at each slot's last page end, kept while device pages are shared
        self.page_ends: PageEndCarry | None = None

    def _hierarchy(
        self, host: tuple[RegionStore, ArenaMapping] | None, fixed: int, args: tuple
    ) -> PayloadBackend:
        from services.worker.hierarchy.session import SessionBackup
        from services.worker.serving.hierarchy_build import build_hierarchy

        payload, self.host_backups, self._local_store = build_hierarchy(
            self.model_cfg, self.cfg, host, fixed
        )
        shared = payload.store.shared_pages()
        self.index_keys = IndexKeys(self.model_cfg, 0, *args, shared=shared, codec=self.codecs.keys)
        # the longest prompt one request can bring into an empty pool: its hot cache, tail and
        # index keys fit the pages
        self.tokens_capacity = self._longest_admissible(shared.pages.total - payload.required_pages)
        # A private arena dies with this process: nothing to resume from, nothing to keep.
        if self.cfg.durable and self._local_store is None:
            self.sessions = SessionBackup(
                self.model_cfg, self.host_backups, self.index_keys, self.snapshot_rings,
                self.carry, self.cfg.page_size,
            )  # fmt: skip
        return payload

    def _longest_admissible(self, pages: int) -> int:
        """The most tokens whose index keys fit ``pages`` pages."""
        lo, hi = 0, self.cfg.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.index_keys.pages_for(mid) <= pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- slots ------------------------------------------------------------------------------
    @property
    def keys_shared(self) -> bool:
        """Index keys take pages of the payload's pool (the hierarchy modes)."""
        return self.index_keys.shared is not None

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        """Whether a slot's first ``num_tokens`` tokens fit; cached prefixes on the device give
        their pages up first (``reclaim``)."""
        while not (
            self.payload.can_ensure(slot, num_tokens)
            and self.index_keys.can_ensure(slot, num_tokens)
        ):
            if self.reclaim is None or not self.reclaim():
                return False
        return True

    def ensure(self, slot: int, num_tokens: int) -> bool:
        """Room for a slot's first ``num_tokens`` tokens in every pool, or no change at all."""
        if num_tokens <= self._ensured.get(slot, 0):  # every decode step and verify round asks
            return True
        if not self.can_ensure(slot, num_tokens):
            return False
        ok = self.payload.ensure(slot, num_tokens) and self.index_keys.ensure(slot, num_tokens)
        assert ok
        # a slot's pages stay until it is released: later asks within them need no look
        self._ensured[slot] = min(self.payload.tokens_room(slot), self.index_keys.tokens_room(slot))
        return True

    def _keys_reserved(self, num_tokens: int, max_tokens: int) -> int:
        """Tokens whose index keys an admission takes at once: all it may ever hold (and a
        verification block) when keys share the payload's pool, so that a running request
        never waits for key pages — but no more than one request can hold in the pool, so a
        huge ``max_tokens`` is admitted and ends where the pool does, as in resident serving;
        otherwise only what it holds now."""
        if not self.keys_shared:
            return num_tokens
        budget = min(max_tokens + self.cfg.spec_block, self.tokens_capacity)
        return max(num_tokens, budget)

    def _key_pages(self, slot: int | None, tokens: int) -> int:
        """Pool pages the index keys of ``tokens`` tokens still need in ``slot`` (a fresh slot
        when None); none when the keys have their own pools."""
        if not self.keys_shared:
            return 0
        if slot is None:
            return self.index_keys.pages_for(tokens)
        return self.index_keys.pages_needed(slot, tokens)

    def admission_pages(self, slot: int | None, num_tokens: int, max_tokens: int) -> int:
        """Pages of the payload's pool that admitting a request takes (hierarchy modes): its
        hot cache and tail, and its index keys (into ``slot``, or a fresh one when None)."""
        keys = self._key_pages(slot, self._keys_reserved(num_tokens, max_tokens))
        return self.payload.required_pages + keys

    def admit(
        self,
        slot: int,
        request_id: str,
        num_tokens: int,
        max_tokens: int,
        manifest_bytes: int = 0,
    ) -> bool:
        """Sets up a new request in a free slot with room for ``num_tokens`` now and at most
        ``max_tokens`` ever (and a manifest half of ``manifest_bytes`` for a durable session);
        False changes nothing. Raises ``HostStoreUnavailable`` when the host store fails."""
        keys_to = self._keys_reserved(num_tokens, max_tokens)
        if not self.keys_shared and not self.can_ensure(slot, num_tokens):
            return False
        session = None
        if self.sessions is not None:
            session = self.sessions.regions(max_tokens, manifest_bytes)
        key_pages = self._key_pages(slot, keys_to)
        if not self.payload.admit(slot, request_id, max_tokens, session, key_pages):
            return False
        if self.sessions is not None:
            self.sessions.clear_manifest(slot)
        ok = self.index_keys.ensure(slot, keys_to) and self.ensure(slot, num_tokens)
        assert ok
        self._admitted.add(slot)
        return True

    def adopt(
        self,
        slot: int,
        request_id: str,
        regions: list[Region],
        num_tokens: int,
        rings: dict[int, bytes],
        max_tokens: int | None = None,
        shared_keys: dict[int, list[int]] | None = None,
    ) -> bool:
        """Seats an adopted durable session (or a request importing a cached prefix) whose
        first ``num_tokens`` tokens are committed in its host ``regions``: rows stay where
        they are, index keys and token rings are rebuilt, the hot cache starts empty; index
        keys are reserved for ``max_tokens`` tokens (as ``admit`` does; None: ``num_tokens``).
        ``shared_keys``: by producer layer, cached key pages (``serving.key_records``) that
        hold the first keys, seated shared; the keys after them come from the host. False
        (nothing taken) when the device has no room."""
        if self.sessions is None:
            raise RuntimeError("adoption needs a hierarchy mode with durable sessions")
        cfg = self.model_cfg
        committed = [cfg.rows_for_tokens(s, num_tokens) for s in cfg.stored_sources]
        if shared_keys:
            self.index_keys.seat(slot, shared_keys)
        keys_to = self._keys_reserved(num_tokens, max_tokens or num_tokens)
        key_pages = self._key_pages(slot, keys_to)
        if not self.payload.adopt(slot, request_id, regions, committed, key_pages):
            if shared_keys:
                self.index_keys.release(slot)
            return False
        ok = self.index_keys.ensure(slot, keys_to) and self.ensure(slot, num_tokens)
        assert ok
        shared_rows = {
            layer: len(pages) * self.index_keys.pools[layer].page_size
            for layer, pages in (shared_keys or {}).items()
        }
        self.sessions.restore(slot, num_tokens, rings, shared_rows)
        self._admitted.add(slot)
        return True

    # ---- a prefix shared on the device (resident mode: ``serving.device_prefix``) -----------
    def seat_prefix(
        self, slot: int, shared: DevicePages, copied: DevicePages, num_tokens: int
    ) -> bool:
        """Sets up a new request in free ``slot`` whose first pages are the cached ``shared``
        pages, then copies of the ``copied`` ones (the page a lagged source's next row goes
        to), with room for ``num_tokens`` tokens; False (nothing taken) when there is none."""
        if self.resident is None:
            raise RuntimeError("device pages are shared in resident mode only")
        self.resident.seat(slot, shared.rows)
        self.index_keys.seat(slot, shared.keys)
        if not self.ensure(slot, num_tokens):
            self.resident.release(slot)
            self.index_keys.release(slot)
            return False
        # the copies' pages are taken now (a record reclaimed meanwhile leaves its bytes: no
        # pass ran since)
        self.resident.copy_pages(slot, copied.rows, shared.rows)
        self.index_keys.copy_pages(slot, copied.keys, shared.keys)
        self._admitted.add(slot)
        return True

    def release(self, slot: int) -> None:
        self._admitted.discard(slot)
        self._ensured.pop(slot, None)
        self.payload.release(slot)
        self.index_keys.release(slot)
        for r in self.snapshot_rings.values():
            r.clear(slot)

    # ---- a forward pass ---------------------------------------------------------------------
    def follow_carry(self, batch: ForwardBatch, hidden: torch.Tensor) -> ExtendedRows:
        """Records the target's final hidden states [N, d] of the pass over ``batch`` in the
        carry (``TokenRing.extend``: the buffer the pass's lagged rows read). For durable
        sessions, a pass with a chunk longer than the carry's ring (a prefill) notes them
        here (``SessionBackup.note_hidden``); the others' are noted from the carry at their
        commit, so a pass replayed from a CUDA graph notes nothing of its own."""
        assert self.carry is not None, "a KV cache built for a topology with a lagged source"
        if max(batch.lens) > self.carry.ring:
            if self.sessions is not None:
                self.sessions.note_hidden(batch, hidden)
            if self.page_ends is not None:
                self.page_ends.note(batch, hidden)
        return self.carry.extend(batch, hidden)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """Publishes the first ``num_tokens[r]`` tokens of each request of the pass over
        ``batch`` (the payload's rows; for durable sessions their host backups). A pass whose
        every chunk fits the carry's ring has its hidden states there, noted now."""
        self.payload.commit(batch, num_tokens)
        if self.page_ends is not None:
            self.page_ends.commit(batch, num_tokens)
        if self.sessions is not None:
            if self.carry is not None and max(batch.lens) <= self.carry.ring:
                carried = self.carry.rows_at(batch.token_slot, batch.positions)
                self.sessions.note_hidden(batch, carried)
            self.sessions.commit(batch, num_tokens)

    def attention_rows(self, source: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [S, d_kv], locations [N, k] into them) that attention reads for the selected
        locations ``locs`` [N, k] of ``payload.pool(source)`` (``-1`` pads): the pool itself
        when rows are stored as computed; in fp8 the selected rows dequantized into the fixed
        workspace, in selection order (N at most ``attention_block``; the next call reuses it).
        Either way ``rows[loc[j, i]]`` is the selected row in the serving dtype (eq. 12)."""
        pool = self.payload.pool(source)
        if self._attention_ws is None:
            return pool, locs
        n = locs.numel()
        rows = self.codecs.rows.gather(pool, locs, out=self._attention_ws)
        at = torch.arange(n, device=locs.device).view_as(locs)
        flat = rows.view(n, self.model_cfg.d_kv)
        return flat, torch.where(locs >= 0, at, torch.full_like(at, -1))

    # ---- accounting -------------------------------------------------------------------------
    def note_queue(self, budgets: Iterable[int]) -> None:
        """The token budgets (``max_tokens`` of ``admit``) of the requests still waiting after
        this step's admissions: adaptive residency keeps the pages their admissions will take
        (hot cache, tail and index keys) out of optional history. A long queue shares a few
        budgets: each is priced once (a fresh slot's pages depend only on its budget)."""
        fresh = self._fresh_pages
        pages = 0
        for budget, n in Counter(budgets).items():
            if budget not in fresh:
                fresh[budget] = self.admission_pages(None, budget, budget)
            pages += n * fresh[budget]
        self.payload.residency.note_queue(pages)

    def note_horizons(self, horizons: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """``horizons()``: (slot, decode steps it may still take) of the running requests;
        adaptive residency refills only the history of requests that will run long enough to
        pay for the copy, and asks only when it has pages to refill."""
        self.payload.residency.note_horizons(functools.cache(lambda: dict(horizons())))

    def memory(self) -> MemoryUsage:
        """The pool by class (eq. 3). Fixed allocations (rings, the index-score workspace,
        prefill scratch, metadata) and index keys in use count as required (in the hierarchy
        modes, as pages of the pool)."""
        required, optional, reserve = self.payload.memory(len(self._admitted))
        if not self.keys_shared:  # else in the page pool; cached keys are optional
            required += self.index_keys.used_bytes
            optional += self.index_keys.cached_bytes
        required += self.ring_bytes + self.workspace
        capacity = self.cfg.kv_pool_bytes
        free = max(0, capacity - required - optional - reserve)
        return MemoryUsage(capacity, required, optional, reserve, free)

    def fixed_bytes(self) -> int:
        """Allocations that do not grow with sessions (rings, the index-score workspace,
        scratch, metadata, staging)."""
        return self.ring_bytes + self.workspace + self.payload.fixed_bytes()

    def layout(self) -> dict:
        """The KV geometry, for exact admission sizing at the gateway."""
        return {
            "kv_dtype_bytes": torch.empty((), dtype=self.cfg.dtype).element_size(),
            "kv_cache_dtype": self.cfg.kv_cache_dtype,
            "row_bytes": self.codecs.rows.row_bytes,
            "index_key_bytes": self.index_keys.pools[next(iter(self.index_keys.pools))].row_bytes
            if self.index_keys.pools
            else None,
            "page_size": self.cfg.page_size,
            **self.payload.layout(),
            "spec_block": self.cfg.spec_block,
            "index_key_page_rows": next(iter(self.index_keys.pools.values())).page_size
            if self.index_keys.pools
            else None,
        }

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (what a host read moves)."""
        return self.codecs.rows.row_bytes

    @property
    def ring_bytes(self) -> int:
        """The token rings and the carry."""
        return sum(r.nbytes for r in self.snapshot_rings.values())

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes + self.index_keys.nbytes + self.ring_bytes

    def close(self) -> None:
        if self.host_backups is not None:
            self.host_backups.close()
        if self._local_store is not None:
            self._local_store.close()
            self._local_store = None


@dataclass(frozen=True)
class DevicePages:
    """The device pages of a prefix, by pool: its rows' (by source) and its index keys' (by
    producer layer)."""

    rows: dict[int, list[int]]
    keys: dict[int, list[int]]

    def first(self, pages: int) -> DevicePages:
        """The first ``pages`` pages of every pool (rows one per token: the same count)."""
        return DevicePages(
            {k: v[:pages] for k, v in self.rows.items()},
            {k: v[:pages] for k, v in self.keys.items()},
        )

    def split(self, rows: set[int], keys: set[int]) -> tuple[DevicePages, DevicePages]:
        """(these pages less the last page of the pools ``rows`` and ``keys`` name, those last
        pages): what a request shares, and what it copies."""
        lead = DevicePages(
            {k: v[:-1] if k in rows else v for k, v in self.rows.items()},
            {k: v[:-1] if k in keys else v for k, v in self.keys.items()},
        )
        last = DevicePages(
            {k: v[-1:] if k in rows else [] for k, v in self.rows.items()},
            {k: v[-1:] if k in keys else [] for k, v in self.keys.items()},
        )
        return lead, last
