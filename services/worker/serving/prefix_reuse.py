"""Prefix reuse over the hierarchy (DESIGN §9): a request whose tokens begin with pages another
request left in the node's host store computes only the rest.

*Leaving pages behind.* When a request gives up its slot (it finished, or was preempted), the
complete pages of its committed tokens — every source's rows and every index producer's keys,
all already in its host regions — are copied into fresh regions of the arena and handed to the
store as a cached prefix, named by the pages' chained hashes (``kv_host_store.prefix_index``).
The store owns them from then on (``kv_host_store.prefix_cache``): no worker's death touches
them, and they are evicted least-recently-used under arena pressure, never while leased.

*Admission.* A waiting request looks up the longest cached run of its leading pages, leaving at
least one token to compute (the pass that samples needs its logits). On a hit its host regions
are allocated as for any admission, the matched rows and keys are copied into them under a
lease, and the request is seated exactly as a resumed durable session is (``KVCache.adopt``):
rows stay on the host and the resolver reads them on demand, index keys come back to the GPU,
the tail ring is refilled; its first ``tokens`` tokens count as computed and its prefill runs
from there. The copy is a host memcpy; no row or key is computed.

Exactness: rows are shared only between requests whose salt (model and weights' identity,
numerics, KV dtype, page size) and leading tokens are equal, so the imported rows are the rows
this worker would compute for those tokens, up to the rounding of the pass that computed them.

With the MTP layer (a lagged source, ``--drafter mtp``) a cached prefix also holds the MTP
layer's rows and keys of its tokens (DeepSeek-V4's keeps no history: only its window's ring,
below), and its page carries (``hierarchy.session``): the target's final hidden state at each
page's last position. An importer of ``T`` tokens seats the carry of position ``T - 1`` in its
carry ring, from which its first pass writes MTP row ``T - 1`` as the uninterrupted request did;
the MTP drafter's context is the KV cache's, so it is whole.

A drafter with a context of its own (DFlash, DSpark, DFlash2: a draft ring of the target's
features at the last W positions) gets it whole by computation: an importer leaves its last W
tokens (and the page they begin in) to the prefill, whose features the ring takes as the
uncached request's did, from a fresh ring; so a turn that adds W tokens or more imports every
cached page, and a shorter one computes up to W + page - 1 tokens.

A worker of several ranks reuses prefixes too. Each data-parallel rank is an owner of its own:
it looks up, imports and leaves pages as a worker alone does. The ranks of a tensor-parallel
group hold one set of regions (``rank_group.region_group``): every rank looks a prefix up at
the same admission and gets rank 0's answer, rank 0 alone copies the cached rows and the
others wait until it has (``HostRanks.host_written``) before they read them; rank 0 alone
leaves pages behind.

A model with token rings (DeepSeek-V4: sliding-window and compressed sources, its compressors'
state) keeps no ring on the host, row by row; a cached prefix of ``T`` tokens holds, in one
region, the rows of each ring that a reader at position ``T`` may need (a window's, an open
group's, by position). The leaver's rings still hold them when it leaves: a ring keeps a verify
block's and a page's rows beyond what readers need (``KVCacheConfig.token_ring_extra``), and a
request leaves the pages before its position, less than a page back. The importer lays them out
at their places in its own rings. So such a model imports a cached prefix whole or not at all:
a request whose tokens match fewer of a record's pages (a shared system prompt of a longer
conversation, the same prompt sent again) computes its prompt.

The index keys stay on the device too (``serving.key_records``; not in a tensor-parallel group):
an importer on the worker that left them seats the cached pages holding its first keys, shared,
and brings only the rest back from the host; its rows are on the host either way.

Not (yet) here: requests that ask for prompt logprobs (every prompt position must be scored).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from services.kv_host_store.errors import CapacityExhausted
from services.kv_host_store.prefix_index import PrefixSalt, page_hashes
from services.kv_host_store.records import PrefixHit, Region
from services.worker.hierarchy.region_store import RegionStore
from services.worker.hierarchy.session import (
    MANIFEST_SOURCE,
    carry_source,
    key_source,
    rings_source,
)
from services.worker.kv.errors import HostStoreUnavailable, describe
from services.worker.request.request import Request
from services.worker.serving.cache import CARRY, KVCache
from services.worker.serving.key_records import KeyPages, KeyRecords, keys_unshareable

log = logging.getLogger(__name__)


@dataclass
class PrefixStats:
    """Cumulative counters, read by metrics and tests."""

    queries: int = 0  # admissions that looked up a prefix of at least one page
    hits: int = 0  # admissions that imported a cached prefix
    hit_tokens: int = 0  # tokens they imported instead of computing
    left: int = 0  # requests whose pages the store kept as a cached prefix (some were new)
    published: int = 0  # live requests' computed prompts kept early for waiting requests
    not_left: int = 0  # requests whose pages could not be (the store full or down, rows missing)
    keys_shared: int = 0  # hits that seated cached index-key pages on the device (key_records)

    def plus(self, others: list[PrefixStats]) -> PrefixStats:
        """These counts and ``others``' added up (a worker's ranks)."""
        return PrefixStats(
            *(sum(getattr(s, f.name) for s in [self, *others]) for f in fields(PrefixStats))
        )


def prefix_query(
    req: Request, salt: PrefixSalt, context: int
) -> tuple[list[int], list[str]] | None:
    """The token ids a waiting request looks a cached prefix up by, and their complete pages'
    hashes: all but its last ``max(1, context)`` tokens — at least one is left to compute (its
    logits are sampled), and a drafter's own context of W positions, whose features only a
    pass of the target gives. None: it asks for prompt logprobs (every position is scored), or
    holds no complete page before those."""
    if req.params.prompt_logprobs is not None:
        return None
    ids = req.ids_from(0, max(0, req.num_tokens - max(1, context)))
    hashes = page_hashes(salt, ids)
    return (ids, hashes) if hashes else None


class Prefixes(Protocol):
    """What the scheduler asks of prefix reuse: ``PrefixReuse`` (through the node's host
    store) or ``serving.device_prefix.DevicePrefixReuse`` (device pages, resident mode)."""

    stats: PrefixStats

    def admit(self, slot: int, req: Request, budget: int, manifest_bytes: int) -> int | None:
        """Tokens of a cached prefix ``req`` was admitted into ``slot`` with, 0 (a prefix is
        cached but there is no room now: nothing taken) or None (no usable prefix)."""
        ...

    def leave(self, slot: int, req: Request) -> None:
        """Keeps the complete pages of ``req``'s committed tokens before ``slot`` is freed."""
        ...

    def publish(self, slot: int, req: Request) -> None:
        """Keeps the complete pages of live ``req``'s computed prompt now, for waiting requests
        that begin with the same tokens."""
        ...


class HostRanks(Protocol):
    """How this rank shares the node's host arena with the other ranks of its worker
    (``rank_group.role.RankGroup``)."""

    @property
    def own_store(self) -> RegionStore | None:
        """The store this rank calls alone to leave a prefix; None: another rank leaves them."""
        ...

    def host_written(self, error: BaseException | None) -> None:
        """Returns once the rank that writes the arena for this one has written (raising what
        writing raised there, or ``error``)."""
        ...

    @property
    def replicated(self) -> bool:
        """The ranks mirror rank 0's admissions (tensor parallel): only rank 0 decides."""
        ...


class AloneOnHost:
    """``HostRanks`` of a worker of one rank: it writes and leaves its own pages."""

    replicated = False

    def __init__(self, store: RegionStore) -> None:
        self.own_store: RegionStore | None = store

    def host_written(self, error: BaseException | None) -> None:
        if error is not None:
            raise error


def copy_rows(arena: torch.Tensor, src: Region, dst: Region, rows: int) -> None:
    """The first ``rows`` rows of region ``src`` into region ``dst`` (``arena``: the whole
    arena as uint8)."""
    if src.row_bytes != dst.row_bytes or rows > min(src.num_rows, dst.num_rows):
        raise ValueError(
            f"cannot copy {rows} rows of {src.row_bytes} B from a region of {src.num_rows} rows "
            f"into one of {dst.num_rows} rows of {dst.row_bytes} B"
        )
    n = rows * src.row_bytes
    arena[dst.offset : dst.offset + n].copy_(arena[src.offset : src.offset + n])


class PrefixReuse:
    def __init__(
        self, kv: KVCache, salt: PrefixSalt, context: int = 0, ranks: HostRanks | None = None
    ) -> None:
        """``kv``: a hierarchy mode's KV state with durable sessions (host rows and keys);
        ``salt``: what this worker's rows depend on besides their tokens; ``context``: the
        last positions before a request's first sampled token that its drafter keeps a
        context of its own over (a draft ring's window W; 0 for none or the MTP layer's);
        ``ranks``: the worker's ranks sharing the arena (None: this rank alone)."""
        if kv.sessions is None or kv.host_backups is None:
            raise ValueError("prefix reuse needs a hierarchy mode with durable sessions")
        if salt.page_size != kv.cfg.page_size:
            raise ValueError(f"salt of page size {salt.page_size}, KV pages of {kv.cfg.page_size}")
        self.kv = kv
        self.host = kv.host_backups
        self.salt = salt
        self.page = salt.page_size
        cfg = kv.model_cfg
        # region source id -> the KV source whose rows it counts: sources, then index keys
        self._source_of = {s: s for s in cfg.stored_sources} | {
            key_source(layer): s for layer, s in kv.sessions.producers.items()
        }
        self._carry = carry_source(cfg) if kv.carry is not None else None
        # token rings (windowed and compressed sources, a model's state): the rows a reader
        # at a page boundary may need, by ring (its rows beyond them are a verify block's and
        # a page's: ``KVCacheConfig.token_ring_extra``), kept as one region of a prefix
        extra = kv.cfg.token_ring_extra
        self._ring_rows = {
            k: r.ring - extra for k, r in sorted(kv.snapshot_rings.items()) if k != CARRY
        }
        self._rings_at = rings_source(cfg) if self._ring_rows else None
        self.context = context
        self.ranks = ranks if ranks is not None else AloneOnHost(self.host.store)
        # index keys shared on the device: keys one per token, ranks that admit on their own
        shareable = not self.ranks.replicated and keys_unshareable(cfg) is None
        self.key_records = KeyRecords(kv, self.page) if shareable else None
        self.stats = PrefixStats()

    def _rows(self, region_source: int, tokens: int) -> int:
        """Rows of region source ``region_source`` that ``tokens`` tokens complete."""
        if region_source == self._carry:
            assert self.kv.sessions is not None
            return self.kv.sessions.carry_rows(tokens)
        return self.kv.model_cfg.rows_for_tokens(self._source_of[region_source], tokens)

    def _rings(self, cached: dict[int, Region], tokens: int) -> dict[int, bytes] | None:
        """The token-ring snapshots an importer of ``tokens`` cached tokens is seated with
        (None: the prefix holds none, though this model has rings): each ring's rows of the
        positions before ``tokens`` that a reader may need, at their places in this ring
        (its other rows are never read: the first pass writes them); with a carry, a carry
        ring holding the page carry of position ``tokens - 1``."""
        out: dict[int, bytes] = {}
        if self._rings_at is not None:
            region = cached.get(self._rings_at)
            if region is None or self._ring_position(region) != tokens:
                return None  # rings of a longer record: not what a reader at ``tokens`` needs
            out = self._seat_rings(region, tokens)
        carry = self.kv.carry
        if carry is None:
            return out
        assert self._carry is not None
        region = cached[self._carry]
        ring = torch.zeros_like(carry.data[0], device="cpu")
        at = region.offset + (tokens // self.page - 1) * region.row_bytes
        row = self.host.mapping.tensor[at : at + region.row_bytes]
        ring[(tokens - 1) % carry.ring] = row.view(ring.dtype)
        return {**out, CARRY: ring.view(torch.uint8).numpy().tobytes()}

    def _ring_snapshot(self, slot: int, tokens: int) -> torch.Tensor:
        """Bytes of ``slot``'s token rings as a reader at position ``tokens`` sees them: the
        position (8 bytes), then ring by ring the rows of the positions ``tokens - n ..
        tokens - 1`` in order (n: what a reader may need of the ring, ``_ring_rows``), which
        the slot's rings still hold."""
        parts = [torch.tensor([tokens], dtype=torch.int64).view(torch.uint8)]
        for key, n in self._ring_rows.items():
            data = self.kv.snapshot_rings[key].data
            at = torch.remainder(torch.arange(tokens - n, tokens), data.shape[1])
            parts.append(data[slot, at.to(data.device)].contiguous().view(torch.uint8).flatten())
        return torch.cat([p.cpu() for p in parts])

    def _ring_position(self, region: Region) -> int:
        """The position whose readers a prefix's ring snapshot serves: its record's length. A
        request importing fewer of its pages gets no rings from it."""
        head = self.host.mapping.tensor[region.offset : region.offset + 8]
        return int(head.clone().view(torch.int64)[0])

    def _seat_rings(self, region: Region, tokens: int) -> dict[int, bytes]:
        """``_ring_snapshot``'s bytes in ``region``, laid out as this worker's rings hold
        positions (position t at row t mod R)."""
        arena = self.host.mapping.tensor
        at = region.offset + 8
        out = {}
        for key, n in self._ring_rows.items():
            ring = self.kv.snapshot_rings[key]
            slot = torch.zeros_like(ring.data[0], device="cpu")
            size = n * slot[0].numel() * slot.element_size()
            rows = arena[at : at + size].clone().view(slot.dtype).view(n, -1)
            slot[torch.remainder(torch.arange(tokens - n, tokens), ring.ring)] = rows
            out[key] = slot.view(torch.uint8).numpy().tobytes()
            at += size
        return out

    # ---- admission ----------------------------------------------------------------------
    def admit(self, slot: int, req: Request, budget: int, manifest_bytes: int) -> int | None:
        """Admits waiting ``req`` into free ``slot`` with the longest cached prefix of its
        tokens (``budget``, ``manifest_bytes``: as ``KVCache.admit`` takes them). Returns the
        tokens imported — its ``num_computed`` to be — or 0 when a prefix is cached but the
        device has no room now (nothing taken), or None when there is no usable prefix (admit
        it as usual). Raises ``HostStoreUnavailable`` when the store fails."""
        query = prefix_query(req, self.salt, self.context)
        if query is None:
            return None
        ids, hashes = query
        self.stats.queries += 1
        store, who = self.host.store, self.host.who
        try:
            # token rings: a record serves a reader at its end only
            hit = store.acquire_prefix(
                who.owner, who.generation, hashes, ids[: len(hashes) * self.page], self.page,
                whole=self._rings_at is not None,
            )  # fmt: skip
        except Exception as e:
            raise HostStoreUnavailable(f"host KV store unavailable: {describe(e)}") from e
        if hit is None:
            return None
        shared = None
        if self.key_records is not None:
            shared = self.key_records.shared(hashes, ids, hit.tokens)
        try:
            return self._import(slot, req, hit, budget, manifest_bytes, shared)
        finally:
            self._release(hit)

    def _import(
        self,
        slot: int,
        req: Request,
        hit: PrefixHit,
        budget: int,
        manifest_bytes: int,
        shared: tuple[KeyPages, int] | None,
    ) -> int | None:
        kv, cfg = self.kv, self.kv.model_cfg
        assert kv.sessions is not None
        cached = {r.source: r for r in hit.regions}
        rings = self._rings(cached, hit.tokens)
        if rings is None:  # a record of rings for another position: admit it as usual
            return None
        rows = [cfg.rows_for_tokens(s, budget) for s in cfg.stored_sources]
        session = kv.sessions.regions(budget, manifest_bytes)
        try:
            regions = self.host.allocate_regions(req.request_id, rows, session)
        except CapacityExhausted:
            return None  # the admission without it meets the same refusal, and reports it
        except Exception as e:
            raise HostStoreUnavailable(f"host KV store unavailable: {describe(e)}") from e
        try:
            self._copy_in(cached, regions, hit.tokens)
            shared_keys = shared[0] if shared is not None else None
            seated = kv.adopt(slot, req.request_id, regions, hit.tokens, rings, budget, shared_keys)
        except BaseException:
            self.host.release_regions(regions)
            raise
        if not seated:
            self.host.release_regions(regions)
            return 0
        kv.sessions.clear_manifest(slot)  # fresh regions: no earlier holder's manifest counts
        req.resumed_tokens = hit.tokens
        req.shared_tokens = shared[1] if shared is not None else 0
        self.stats.hits += 1
        self.stats.hit_tokens += hit.tokens
        self.stats.keys_shared += int(shared is not None)
        return hit.tokens

    def _copy_in(self, cached: dict[int, Region], regions: list[Region], tokens: int) -> None:
        """The cached rows and keys of ``tokens`` tokens into a request's fresh ``regions``,
        by the rank that writes the arena; every rank returns once they are there."""
        error: BaseException | None = None
        if self.host.writer:
            arena = self.host.mapping.tensor
            try:
                for r in regions:
                    if r.source != MANIFEST_SOURCE:
                        copy_rows(arena, cached[r.source], r, self._rows(r.source, tokens))
            except Exception as e:
                error = e
        self.ranks.host_written(error)

    def _release(self, hit: PrefixHit) -> None:
        try:
            self.host.store.release_prefix(hit.lease_id)
        except Exception as e:  # the store drops it with this process's generation
            log.warning("could not return prefix lease %s: %s", hit.lease_id, describe(e))

    # ---- leaving pages behind -----------------------------------------------------------
    def leave(self, slot: int, req: Request) -> None:
        """Hands the complete pages of ``req``'s committed tokens to the store as a cached
        prefix, before ``slot`` is released. Nothing for a request that failed (a pass may have
        left its rows half written); the store frees the copy when a cached prefix already
        holds every page. A store full of live rows, or down, or rows not all on the host keep
        nothing (counted in ``stats.not_left``, logged)."""
        tokens = req.num_computed // self.page * self.page
        if req.error is not None or tokens == 0 or self.ranks.own_store is None:
            return
        if not self._durable(slot, tokens):
            self.stats.not_left += 1
            log.debug("%s: rows of its %d tokens are not all on the host", req.request_id, tokens)
            return
        if self._leave(slot, req, tokens, keys=True):
            self.stats.left += 1

    def publish(self, slot: int, req: Request) -> None:
        """Hands the complete pages of live ``req``'s computed prompt to the store as a cached
        prefix now, for requests waiting with the same first tokens (a shared system prompt):
        they import it instead of computing it beside this one. Its index-key pages stay its
        own (the record holds their host copies); at its end it leaves its whole history as
        usual. Nothing when its rows are not all on the host yet (deferred backups)."""
        tokens = min(req.num_computed, len(req.prompt_ids)) // self.page * self.page
        if req.error is not None or tokens == 0 or self.ranks.own_store is None:
            return
        if not self._durable(slot, tokens):
            return
        if self._leave(slot, req, tokens, keys=False):
            self.stats.published += 1

    def _durable(self, slot: int, tokens: int) -> bool:
        """Whether every stored source's rows of the first ``tokens`` tokens are durable on the
        host."""
        cfg = self.kv.model_cfg
        return all(
            self.host.durable(slot, s, 0, cfg.rows_for_tokens(s, tokens))
            for s in cfg.stored_sources
        )

    def _leave(self, slot: int, req: Request, tokens: int, keys: bool) -> bool:
        """Copies the slot's rows of ``tokens`` tokens into a cached prefix the store keeps
        (``keys``: and keeps its index-key pages on the device as a record); whether the store
        kept it (False: it held every page, or refused, counted in ``stats.not_left``)."""
        store = self.ranks.own_store
        assert store is not None
        ids = req.ids_from(0, tokens)
        hashes = page_hashes(self.salt, ids)
        if keys and self.key_records is not None:
            self.key_records.keep(slot, hashes, ids)
        if self.host.on_gpu:  # the step's host copies were queued on the stream
            torch.cuda.current_stream(self.host.device).synchronize()
        try:
            return self._hand_over(store, slot, hashes, ids)
        except CapacityExhausted as e:
            self.stats.not_left += 1
            log.debug("no room to cache %d tokens of %s: %s", tokens, req.request_id, e)
        except Exception as e:
            self.stats.not_left += 1
            log.warning("could not cache the prefix of %s: %s", req.request_id, describe(e))
        return False

    def _hand_over(self, store: RegionStore, slot: int, hashes: list[str], ids: list[int]) -> bool:
        """The copy and its hand-over; whether the store kept it as a new record."""
        who = self.host.who
        tokens = len(ids)
        mine = [r for r in self.host.regions(slot) if r.source != MANIFEST_SOURCE]
        sources = [r for r in mine if r.source >= 0]
        rid = f"prefix-{uuid.uuid4().hex}"
        session = {
            r.source: (self._rows(r.source, tokens), r.row_bytes) for r in mine if r.source < 0
        }
        rings = self._ring_snapshot(slot, tokens) if self._rings_at is not None else None
        if rings is not None:
            session[self._rings_at] = (1, rings.numel())
        regions = self.host.allocate_regions(
            rid, [self._rows(r.source, tokens) for r in sources], session, store
        )
        by_source = {r.source: r for r in regions}
        arena = self.host.mapping.tensor
        try:
            for r in mine:
                copy_rows(arena, r, by_source[r.source], self._rows(r.source, tokens))
            if rings is not None:
                at = by_source[self._rings_at].offset
                arena[at : at + rings.numel()].copy_(rings)
            kept = store.cache_prefix(rid, who.owner, who.generation, hashes, ids, self.page)
        except BaseException:
            self.host.release_regions(regions)  # still this worker's: not handed over
            raise
        return kept
