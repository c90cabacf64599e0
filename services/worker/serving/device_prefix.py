"""Prefix reuse on the device (resident mode, DESIGN §9): a finished request's complete pages
stay in the device pools as a cached prefix while memory is spare, and a request whose tokens
begin with them shares them and computes only the rest.

*Leaving pages behind.* When a request gives up its slot (finished, aborted or preempted; not
when it failed), the pages holding the rows and index keys of its committed tokens' complete
pages are kept as a record named by the pages' chained hashes (``kv_host_store.prefix_index``,
salted as the host cache's), before the slot lets go of them: a page stays while a slot or a
record holds it (``kv.paged.PagePool``). A record whose every page another holds is not kept;
records a new one holds whole are dropped.

*Admission.* A waiting request takes the longest cached run of its leading pages, leaving at
least one token to compute (and a drafter's own context, as ``serving.prefix_reuse`` does). Its
slot's first pages are those pages, shared: its passes read them and never write them (its own
rows go to the pages after them), so nothing is copied. Its prefill starts after them.

*Eviction.* When a slot needs a page that is not free, records give theirs up least recently
used first (``KVCache.reclaim``), before any request waits or is preempted: a live request's
rows are never touched. Pages only records hold count as optional memory (eq. 3).

Exactness: rows are shared only between requests of equal salt and leading tokens, so a
shared row is the row this worker computes for those tokens, up to the rounding of the pass
that computed it (under batch-invariant numerics, exactly).

With a lagged source (the MTP layer: its row ``t`` is written by the pass at ``t + 1`` from
the target's hidden state at ``t``) a record of ``T`` tokens holds that source's rows up to
``T - 2``: the importer's first pass writes row ``T - 1`` into the page holding it. So that
page is copied, not shared, and the importer's carry ring gets the record's carry at ``T - 1``
(``kv.page_end_carry``: kept per slot as passes commit page ends). The carry is the record's
end's only, so such a model takes a record whole or not at all.

Not here: rows that are not one per token (compressed or windowed sources and their token
rings), and the hierarchy modes (they reuse prefixes through the node's host store,
``serving.prefix_reuse``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.prefix_index import PrefixSalt, page_hashes
from services.worker.kv.page_end_carry import PageEndCarry
from services.worker.request.request import Request
from services.worker.serving.cache import DevicePages, KVCache
from services.worker.serving.device_records import DeviceRecords
from services.worker.serving.prefix_reuse import PrefixStats, prefix_query


def unshareable(cfg: ModelConfig, page_size: int) -> str | None:
    """Why ``cfg``'s device pages cannot be shared between requests, or None."""
    if any(src.compress != 1 or src.window > 0 for src in cfg.sources):
        return "rows that are not one per token (compressed or windowed sources)"
    if any(src.lag >= page_size for src in cfg.sources):
        return f"a source lagging a page or more ({page_size} tokens)"
    return None


@dataclass(frozen=True)
class _Record:
    pages: DevicePages
    carry: torch.Tensor | None  # at its last position (a lagged source's next row reads it)


class DevicePrefixReuse:
    def __init__(self, kv: KVCache, salt: PrefixSalt, context: int = 0) -> None:
        """``kv``: resident KV state; ``salt``: what its rows depend on besides their tokens;
        ``context``: the last positions before a request's first sampled token that its
        drafter keeps a context of its own over (computed, never shared)."""
        why = unshareable(kv.model_cfg, kv.cfg.page_size)
        if why is not None:
            raise ValueError(f"device pages are not shared for {why}")
        if kv.resident is None:
            raise ValueError(
                "device pages are shared in resident mode (the hierarchy modes: ``PrefixReuse``)"
            )
        self.rows = kv.resident  # pages of the rows, by source
        self.keys = kv.index_keys  # pages of the index keys, by producer layer
        if salt.page_size != kv.cfg.page_size:
            raise ValueError(f"salt of page size {salt.page_size}, KV pages of {kv.cfg.page_size}")
        self.kv = kv
        self.salt = salt
        self.page = salt.page_size
        self.context = context
        self.records = DeviceRecords[_Record](self.page, self._hold, self._let_go)
        # a lagged source's pools (the MTP layer's rows and keys): a request copies the page
        # its next row goes to, and seats the carry at the record's last position; so it
        # takes a record whole (the carry is kept at its end only)
        cfg = kv.model_cfg
        self._lagged_rows = {s for s, src in enumerate(cfg.sources) if src.lag}
        self._lagged_keys = {i for i in self.keys.pools if cfg.sources[cfg.layers[i].source].lag}
        if self._lagged_rows and kv.carry is not None:
            kv.page_ends = PageEndCarry(kv.carry, self.page)
        self.stats = PrefixStats()
        kv.reclaim = self.records.evict_one

    def _hold(self, record: _Record) -> None:
        self.rows.cache(record.pages.rows)
        self.keys.cache(record.pages.keys)

    def _let_go(self, record: _Record) -> None:
        self.rows.uncache(record.pages.rows)
        self.keys.uncache(record.pages.keys)

    # ---- admission ----------------------------------------------------------------------
    def admit(self, slot: int, req: Request, budget: int, manifest_bytes: int) -> int | None:
        """Admits waiting ``req`` into free ``slot`` sharing the longest cached prefix of its
        tokens. Returns the tokens shared — its ``num_computed`` to be — or 0 when a prefix is
        cached but the device has no room now (nothing taken), or None when there is no usable
        prefix (admit it as usual). ``budget`` and ``manifest_bytes``: as the host cache's."""
        query = prefix_query(req, self.salt, self.context)
        if query is None:
            return None
        ids, hashes = query
        self.stats.queries += 1
        # with a lagged source, a record's carry is its end's: only a record ending there
        found = self.records.find(hashes, ids, whole=self.kv.page_ends is not None)
        if found is None:
            return None
        record, matched = found
        tokens = matched * self.page
        pages = record.pages.first(matched)
        copied = pages.first(0)
        if record.carry is not None:
            pages, copied = pages.split(self._lagged_rows, self._lagged_keys)
        if not self.kv.seat_prefix(slot, pages, copied, req.num_tokens):
            return 0
        if record.carry is not None:
            assert self.kv.page_ends is not None
            self.kv.page_ends.seat(slot, tokens, record.carry)
        req.resumed_tokens = req.shared_tokens = tokens
        self.stats.hits += 1
        self.stats.hit_tokens += tokens
        return tokens

    # ---- leaving pages behind -----------------------------------------------------------
    def publish(self, slot: int, req: Request) -> None:
        """Nothing: a live request's device pages are its own until it ends (a record shares
        pages no request writes); requests waiting with the same first tokens compute them."""

    def leave(self, slot: int, req: Request) -> None:
        """Keeps the pages of ``req``'s committed tokens' complete pages as a cached prefix,
        before ``slot`` is released. Nothing for a request that failed (a pass may have left
        its rows half written), nor when a record holds every one of those pages already."""
        tokens = req.num_computed // self.page * self.page
        if req.error is not None or tokens == 0:
            return
        ids = req.ids_from(0, tokens)
        hashes = page_hashes(self.salt, ids)
        if self.records.covers(hashes, ids):
            return
        pages = DevicePages(
            self.rows.prefix_pages(slot, tokens), self.keys.prefix_pages(slot, tokens)
        )
        carry = None
        if self.kv.page_ends is not None:  # the carry at position tokens - 1
            carry = self.kv.page_ends.data[slot].clone()
        self.records.add(hashes, ids, _Record(pages, carry))
        self.stats.left += 1
