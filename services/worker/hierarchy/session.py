"""What durable sessions add to a hierarchy's KV state, so that a successor process can rebuild
a request's device state from the host arena alone:

- the **index keys** of committed rows, backed up beside the rows in one session region per
  index producer (source id ``key_source(layer)``). Keys are a projection of the stored rows,
  but re-projecting is not bit-exact (a one-row matmul rounds differently from a batched one),
  and a flipped top-k would change the continuation, so the keys the run used are kept;
- a **manifest** region (source id ``MANIFEST_SOURCE``, two halves: ``durable.manifest``);
- **token-ring snapshots** (the last R uncompressed rows of windowed or compressed sources),
  which live in the manifest.

Rows and keys go to the host at commit, in stream order; the manifest that names them is
written after they landed (``durable.journal``).
"""

from __future__ import annotations

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


class SessionBackup:
    def __init__(
        self,
        model_cfg: ModelConfig,
        host: HostBackups,
        index_keys: IndexKeys,
        rings: dict[int, TokenRing],
    ) -> None:
        self.cfg = model_cfg
        self.host = host
        self.keys = index_keys
        self.rings = rings
        self.producers = {i: model_cfg.layers[i].source for i in model_cfg.index_producers}
        pool = next(iter(index_keys.pools.values()))
        self.key_dtype = pool.data.dtype
        self.key_bytes = pool.row_bytes

    def regions(self, max_tokens: int, manifest_bytes: int) -> dict[int, tuple[int, int]]:
        """Session regions of a request of at most ``max_tokens`` tokens: ``{source id: (rows,
        row bytes)}`` — keys per producer, and the manifest's two halves."""
        out = {
            key_source(i): (max(1, self.cfg.rows_for_tokens(s, max_tokens)), self.key_bytes)
            for i, s in self.producers.items()
        }
        out[MANIFEST_SOURCE] = (2, manifest_bytes)
        return out

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

    def restore(self, slot: int, num_tokens: int, rings: dict[int, bytes]) -> None:
        """Rebuilds a seated slot's index keys (rows of ``num_tokens`` tokens, pages already
        ensured) from its host key regions, and its token rings from their snapshots."""
        for layer, s in self.producers.items():
            n = self.cfg.rows_for_tokens(s, num_tokens)
            if n == 0:
                continue
            pool = self.keys.pools[layer]
            rows = torch.arange(n, device=pool.data.device)
            host = self.host.session_rows(slot, key_source(layer), 0, n, self.key_dtype)
            pool.write(torch.full_like(rows, slot), rows, host.to(pool.data.device))
        for s, ring in self.rings.items():
            raw = torch.frombuffer(bytearray(rings[s]), dtype=torch.uint8)
            ring.data[slot] = raw.view(ring.data.dtype).view_as(ring.data[slot]).to(ring.data)

    def manifest_buffer(self, slot: int) -> torch.Tensor:
        """[2, half] uint8 host view of the slot's manifest region."""
        return self.host.session_rows(slot, MANIFEST_SOURCE, 0, 2, torch.uint8)

    @staticmethod
    def manifest_of(regions: list[Region]) -> Region | None:
        return next((r for r in regions if r.source == MANIFEST_SOURCE), None)
