"""What durable sessions add to a hierarchy's KV state, so that a successor process can rebuild
a request's device state from the host arena alone:

- the **index keys** of committed rows, backed up beside the rows in one session region per
  index producer (source id ``key_source(layer)``). Keys are a projection of the stored rows,
  but re-projecting is not bit-exact (a one-row matmul rounds differently from a batched one),
  and a flipped top-k would change the continuation, so the keys the run used are kept;
- a **manifest** region (source id ``MANIFEST_SOURCE``, two halves: ``durable.manifest``);
- **token-ring snapshots** (the last R uncompressed rows of windowed or compressed sources),
  which live in the manifest;
- with a lagged source (the MTP layer's), the **page carries**: the target's final hidden state
  at the last position of every complete page, one row per page (source id ``carry_source``).
  The carry ring keeps only a slot's last positions; a cached prefix that ends at any page
  boundary (``serving.prefix_reuse``) needs the hidden state there to write its importer's
  first lagged row.

Rows and keys go to the host at commit, in stream order; the manifest that names them is
written after they landed (``durable.journal``).
"""

from __future__ import annotations

import itertools

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.records import Region
from services.worker.hierarchy.host_backup import HostBackups
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.index_keys import IndexKeys
from services.worker.kv.token_ring import TokenRing

MANIFEST_SOURCE = -1


def key_source(layer: int) -> int:
    """Session-region source id of the index keys of producer ``layer``."""
    return -2 - layer


def carry_source(cfg: ModelConfig) -> int:
    """Session-region source id of the page carries: past every layer's key source."""
    return key_source(len(cfg.layers))


def rings_source(cfg: ModelConfig) -> int:
    """Region source id of a cached prefix's token-ring snapshots (``serving.prefix_reuse``):
    past the page carries'. A session keeps its rings in its manifest instead."""
    return carry_source(cfg) - 1


class SessionBackup:
    def __init__(
        self,
        model_cfg: ModelConfig,
        host: HostBackups,
        index_keys: IndexKeys,
        rings: dict[int, TokenRing],
        carry: TokenRing | None = None,
        page_size: int = 0,
    ) -> None:
        """``carry``: the KV cache's carry ring (a model with a lagged source), whose hidden
        states at page ends ``page_size`` apart are backed up as page carries."""
        self.cfg = model_cfg
        self.host = host
        self.keys = index_keys
        self.rings = rings
        self.producers = {i: model_cfg.layers[i].source for i in model_cfg.key_producers}
        pool = next(iter(index_keys.pools.values()))
        self.key_dtype = pool.data.dtype
        self.key_bytes = pool.row_bytes
        self.carry = carry
        self.page = page_size
        if carry is not None and page_size < 1:
            raise ValueError("page carries need a page size >= 1")
        self._pass: tuple[ForwardBatch, torch.Tensor] | None = None  # a pass's final hidden

    def regions(self, max_tokens: int, manifest_bytes: int) -> dict[int, tuple[int, int]]:
        """Session regions of a request of at most ``max_tokens`` tokens: ``{source id: (rows,
        row bytes)}`` — keys per producer, and the manifest's two halves."""
        out = {
            key_source(i): (max(1, self.cfg.rows_for_tokens(s, max_tokens)), self.key_bytes)
            for i, s in self.producers.items()
        }
        if self.carry is not None:
            d = self.carry.data
            out[carry_source(self.cfg)] = (
                max(1, max_tokens // self.page),
                d.shape[-1] * d.element_size(),
            )
        out[MANIFEST_SOURCE] = (2, manifest_bytes)
        return out

    def carry_rows(self, num_tokens: int) -> int:
        """Page carries of a request's first ``num_tokens`` tokens: one per complete page."""
        return num_tokens // self.page if self.carry is not None else 0

    def note_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """The target's final hidden states [N, d] of the pass over ``batch``, which ``commit``
        backs up at the page ends the pass commits."""
        if self.carry is not None:
            self._pass = (batch, hidden)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """Backs up the index keys of the rows this pass committed (as ``payload.commit``
        does the rows): asynchronous from a GPU, ordered before later work on the stream;
        none where another process writes the host backups."""
        if not self.host.writer:
            return
        slots = list(batch.slot_ids)
        for layer, s in self.producers.items():
            pool = self.keys.pools[layer]
            for r, slot in enumerate(slots):
                lo = self.cfg.rows_for_tokens(s, batch.starts[r])
                hi = self.cfg.rows_for_tokens(s, num_tokens[r])
                if hi <= lo:
                    continue
                rows = torch.arange(lo, hi, device=pool.data.device)
                keys = pool.data[pool.locations(torch.full_like(rows, slot), rows)]
                dst = self.host.session_rows(slot, key_source(layer), lo, hi, self.key_dtype)
                dst.copy_(keys, non_blocking=self.host.on_gpu)
        if self.carry is not None:
            self._commit_carries(batch, num_tokens)

    def _commit_carries(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """The hidden states of the page ends ``t = k * page - 1`` this pass committed
        (``batch.starts[r] <= t < num_tokens[r]``), from the pass ``note_hidden`` recorded."""
        noted, self._pass = self._pass, None
        spans = []
        for r, slot in enumerate(batch.slot_ids):
            # page k (k >= 1) ends at position k * page - 1; the pass covers starts[r] ..
            lo, hi = batch.starts[r] // self.page + 1, num_tokens[r] // self.page
            if hi >= lo:
                spans.append((r, slot, lo, hi))
        if not spans:
            return
        if noted is None or noted[0] is not batch:
            raise RuntimeError("a pass committed page ends whose hidden states were not noted")
        hidden = noted[1]
        dtype = self.carry.data.dtype
        cu = [0, *itertools.accumulate(batch.lens)]
        for r, slot, lo, hi in spans:
            # position k * page - 1 is token cu[r] + k * page - 1 - start of the pass
            first = cu[r] + lo * self.page - 1 - batch.starts[r]
            rows = hidden[first : first + (hi - lo) * self.page + 1 : self.page]
            dst = self.host.session_rows(slot, carry_source(self.cfg), lo - 1, hi, dtype)
            dst.copy_(rows.to(dtype), non_blocking=self.host.on_gpu)

    def ring_snapshots(self, slots: list[int]) -> list[dict[int, bytes]]:
        """Each slot's token rings as raw bytes, by source (R rows each: a few KiB), with one
        device-to-host copy per ring for all the slots."""
        out: list[dict[int, bytes]] = [{} for _ in slots]
        for s, ring in self.rings.items():
            idx = torch.tensor(slots, dtype=torch.int64, device=ring.data.device)
            host = ring.data[idx].contiguous().view(torch.uint8).cpu().numpy()
            for i in range(len(slots)):
                out[i][s] = host[i].tobytes()
        return out

    def restore(
        self,
        slot: int,
        num_tokens: int,
        rings: dict[int, bytes],
        shared_rows: dict[int, int] | None = None,
    ) -> None:
        """Rebuilds a seated slot's index keys (rows of ``num_tokens`` tokens, pages already
        ensured) from its host key regions, and its token rings from their snapshots. By
        producer layer, the first ``shared_rows`` keys are in shared pages (``KVCache.adopt``):
        they are there already and never written."""
        for layer, s in self.producers.items():
            n = self.cfg.rows_for_tokens(s, num_tokens)
            lo = min(n, (shared_rows or {}).get(layer, 0))
            if n == lo:
                continue
            pool = self.keys.pools[layer]
            rows = torch.arange(lo, n, device=pool.data.device)
            host = self.host.session_rows(slot, key_source(layer), lo, n, self.key_dtype)
            pool.write(torch.full_like(rows, slot), rows, host.to(pool.data.device))
        for s, ring in self.rings.items():
            raw = torch.frombuffer(bytearray(rings[s]), dtype=torch.uint8)
            ring.data[slot] = raw.view(ring.data.dtype).view_as(ring.data[slot]).to(ring.data)

    def clear_manifest(self, slot: int) -> None:
        """Marks the manifest region of a request just admitted to ``slot`` as never written
        (zero bytes, as ``durable.manifest.invalidate`` leaves them): its arena bytes may hold a
        finished request's manifest, which must not pass for this one's before the journal
        writes its first. None where another process writes the host backups (it clears
        them)."""
        if self.host.writer:
            self.manifest_buffer(slot).zero_()

    def manifest_buffer(self, slot: int) -> torch.Tensor:
        """[2, half] uint8 host view of the slot's manifest region."""
        return self.host.session_rows(slot, MANIFEST_SOURCE, 0, 2, torch.uint8)

    @staticmethod
    def manifest_of(regions: list[Region]) -> Region | None:
        return next((r for r in regions if r.source == MANIFEST_SOURCE), None)
