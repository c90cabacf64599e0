"""The index keys of cached prefixes, shared on the device (the hierarchy modes, DESIGN §9).

In a hierarchy mode every committed row lives on the host, but the index keys of a request's
whole history live on the device (the indexer scores every row), in pages of the payload's pool.
For a long shared prefix (an agent's system prompt and tools) they are most of what a session
holds there. So when a request leaves its pages in the host store (``serving.prefix_reuse``),
the device pages holding the index keys of its complete pages stay too, as a record named by
the pages' chained hashes; a request importing that prefix from the host seats those pages as
its first key pages, shared (read, never written), instead of bringing the keys back from the
host into pages of its own. Its keys after them come from the host as before.

*Which pages.* A key page holds ``K`` rows (as many as fit a page of the pool). A record of
``T`` tokens keeps the key pages that its rows complete before ``T - lag`` (a lagged source,
the MTP layer: its row ``t`` is written by the pass at ``t + 1``, so a reader's first pass
writes row ``T - 1``); a reader of ``t <= T`` tokens shares the first of them that end at or
before ``t - lag``. Pages are shared whole: no reader writes a row of a shared page.

*Memory.* A page only records hold is optional memory (eq. 3): any take from the pool drops
records least recently used first before it fails (``PagePool.reclaim``), so cached keys give
way to admissions, tails, hot caches and optional history alike.

Only models whose every key producer writes one key per token (no compressed or windowed
source) keep key records; so does each rank of a data-parallel group (it admits on its own),
and no rank of a tensor-parallel group (its followers leave no pages: rank 0 does)."""

from __future__ import annotations

from collections.abc import Sequence

from dhisparse.family.config import ModelConfig
from services.worker.serving.cache import KVCache
from services.worker.serving.device_records import DeviceRecords

KeyPages = dict[int, list[int]]  # by producer layer, a pool's pages in row order


def keys_unshareable(cfg: ModelConfig) -> str | None:
    """Why ``cfg``'s index keys are not shared between requests on the device, or None."""
    for layer in cfg.key_producers:
        src = cfg.sources[cfg.layers[layer].source]
        if src.compress != 1 or src.window > 0:
            return "index keys of compressed or windowed sources"
    return None


class KeyRecords:
    def __init__(self, kv: KVCache, page_size: int) -> None:
        """``kv``: a hierarchy mode's KV state (index keys in its payload's pool);
        ``page_size``: tokens per page of the records' hashes."""
        why = keys_unshareable(kv.model_cfg)
        if why is not None:
            raise ValueError(f"no key records for {why}")
        shared = kv.index_keys.shared
        if shared is None:
            raise ValueError("key records need index keys in the payload's page pool")
        cfg = kv.model_cfg
        self.keys = kv.index_keys
        self.page = page_size
        self._lag = {i: cfg.sources[cfg.layers[i].source].lag for i in self.keys.pools}
        self.records = DeviceRecords[KeyPages](page_size, self.keys.cache, self.keys.uncache)
        shared.pages.reclaim = self.records.evict_one

    def _pages(self, layer: int, tokens: int) -> int:
        """Key pages of producer ``layer`` whose rows precede ``tokens - lag``."""
        return max(0, tokens - self._lag[layer]) // self.keys.pools[layer].page_size

    def keep(self, slot: int, hashes: Sequence[str], token_ids: Sequence[int]) -> None:
        """Keeps ``slot``'s key pages of its first ``len(hashes)`` pages of tokens (written,
        committed) as a record, before the slot lets go of them; nothing when a record holds
        all those pages already, or the tokens complete no key page."""
        tokens = len(hashes) * self.page
        if not hashes or self.records.covers(hashes, token_ids):
            return
        pages = {
            layer: pool.slot_pages(slot, self._pages(layer, tokens))
            for layer, pool in self.keys.pools.items()
        }
        if any(pages.values()):
            self.records.add(hashes, token_ids, pages)

    def shared(
        self, hashes: Sequence[str], token_ids: Sequence[int], tokens: int
    ) -> tuple[KeyPages, int] | None:
        """The cached key pages a request importing its first ``tokens`` tokens (whole pages of
        ``hashes`` and ``token_ids``) seats as its first, by producer layer: those of the record
        that holds the longest run of those pages, and the leading tokens that run covers;
        None when no page is cached."""
        found = self.records.find(hashes[: tokens // self.page], token_ids)
        if found is None:
            return None
        pages, matched = found
        upto = min(matched * self.page, tokens)
        shared = {layer: p[: self._pages(layer, upto)] for layer, p in pages.items()}
        return (shared, upto) if any(shared.values()) else None
