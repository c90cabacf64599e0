"""Prepared prefixes imported without prefill (bench only): a session whose first ``tokens``
tokens are a history already committed, seated as a finished prefill would leave it.

A ``History`` is the stored state of those tokens: every source's rows and every index
producer's keys, as the KV codecs store them (``RowCodec``: the serving dtype, or packed fp8),
and, with a lagged source (the MTP layer's), the target's final hidden state at the last
position (the carry the next pass's first lagged row reads). ``random_history`` draws it
(rows and keys of the serving dtype's scale, quantized by the codecs as a pass would store
them); ``captured_history`` reads it back from a resident engine that prefilled the tokens
(what the import is checked against).

``HistoryImport`` seats it. It takes the place of the scheduler's prefix reuse
(``Scheduler.prefix``, the existing seam through which an admission imports tokens instead of
computing them; the prefix reuse it replaces keeps serving every prompt that begins with no
prepared history) and keeps that contract, ``admit(slot, req, budget, manifest_bytes)``:

- hierarchy modes (durable sessions): host regions are allocated as an admission's, the rows
  and keys copied into them, and the session seated by ``KVCache.adopt`` — exactly as
  ``serving.prefix_reuse`` seats a cached prefix (rows stay on the host, index keys come back
  to the GPU, the tail ring is refilled, the hot cache starts empty);
- resident: the request is admitted as usual (``KVCache.admit``: pages for every prompt token)
  and the rows and keys written into its pages and key pools.

Either way its first ``tokens`` tokens count as computed and its prefill runs from there (the
prompt's remaining tokens, at least one: the pass that samples needs its logits). A history's
copy into the host arena happens inside the admission, so it counts in the allocation wait,
as a cached prefix's copy does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.errors import CapacityExhausted
from services.worker.engine.engine import Engine
from services.worker.hierarchy.session import MANIFEST_SOURCE, carry_source, key_source
from services.worker.kv.row_codec import RowCodec
from services.worker.request.request import Request
from services.worker.serving.cache import CARRY, KVCache
from services.worker.serving.prefix_reuse import PrefixStats

KEY_TOKENS = 64  # a prompt's history is found by its first tokens (prepared prompts differ there)
CHUNK_ROWS = 8192  # rows drawn and encoded at once


@dataclass(frozen=True)
class History:
    """The committed state of a prompt's first ``tokens`` tokens, stored bytes on the CPU:
    ``rows[source]`` [rows_for_tokens, row_bytes] uint8, ``keys[layer]`` [rows, key_bytes]
    uint8 (producers only, without a pool's padding), ``carry`` [d_model] in the carry's dtype
    or None (no lagged source)."""

    tokens: int
    rows: dict[int, torch.Tensor]
    keys: dict[int, torch.Tensor]
    carry: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in [*self.rows.values(), *self.keys.values()])


def _encode(codec: RowCodec, values: torch.Tensor) -> torch.Tensor:
    """values [n, width] in the serving dtype as stored bytes [n, row_bytes] uint8 (on the
    values' device)."""
    out = torch.empty(values.shape[0], codec.stored_width, dtype=codec.storage,
                      device=values.device)  # fmt: skip
    codec.store(out, torch.arange(values.shape[0], device=values.device), values)
    return out.view(torch.uint8).view(values.shape[0], codec.row_bytes)


def _draw(codec: RowCodec, rows: int, scale: float, g: torch.Generator, device) -> torch.Tensor:
    """``rows`` random rows (normal, std ``scale``, drawn on ``device`` by ``g``) stored by
    ``codec``, in chunks, on the CPU."""
    # pinned beside a GPU: a resident admission copies it to the device
    out = torch.empty(rows, codec.row_bytes, dtype=torch.uint8,
                      pin_memory=device.type == "cuda")  # fmt: skip
    for lo in range(0, rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, rows - lo)
        v = torch.randn(n, codec.width, generator=g, dtype=torch.float32, device=device)
        out[lo : lo + n] = _encode(codec, (v * scale).to(codec.dtype)).cpu()
    return out


def random_history(kv: KVCache, tokens: int, seed: int, scale: float = 1.0) -> History:
    """Random rows and keys of ``tokens`` tokens as ``kv``'s codecs store them: the worst case
    for the hierarchy (selections with no locality beyond what random keys give)."""
    cfg = kv.model_cfg
    device = torch.device(kv.cfg.device)
    g = torch.Generator(device=device).manual_seed(seed)
    rows = {s: _draw(kv.codecs.rows, cfg.rows_for_tokens(s, tokens), scale, g, device)
            for s in cfg.stored_sources}  # fmt: skip
    keys = {
        layer: _draw(kv.codecs.keys, cfg.rows_for_tokens(cfg.layers[layer].source, tokens),
                     scale, g, device)
        for layer in cfg.index_producers
    }  # fmt: skip
    carry = None
    if kv.carry is not None:
        d = kv.carry.data
        carry = (torch.randn(d.shape[-1], generator=g, device=device) * scale).to(d.dtype).cpu()
    return History(tokens, rows, keys, carry)


def captured_history(eng: Engine, req: Request, tokens: int) -> History:
    """The stored state of the first ``tokens`` tokens of ``req`` (running in resident
    ``eng``, its prefill done): what an import of them must reproduce."""
    kv = eng.kv
    if kv.keys_shared or req.slot is None or req.num_computed < tokens:
        raise ValueError("capture from a resident engine's running request, prefilled")
    cfg = kv.model_cfg
    slot = req.slot

    def read(pools: Mapping[int, object], key: int, source: int, width: int) -> torch.Tensor:
        pool = pools[key]
        n = cfg.rows_for_tokens(source, tokens)
        dev = pool.data.device
        locs = pool.locations(torch.full((n,), slot, device=dev), torch.arange(n, device=dev))
        return pool.data[locs].view(torch.uint8)[:, :width].cpu().clone()

    rows = {s: read(kv.payload.pools, s, s, kv.codecs.rows.row_bytes)
            for s in cfg.stored_sources}  # fmt: skip
    keys = {layer: read(kv.index_keys.pools, layer, cfg.layers[layer].source,
                        kv.codecs.keys.row_bytes)
            for layer in cfg.index_producers}  # fmt: skip
    carry = None
    if kv.carry is not None:
        carry = kv.carry.data[slot, (tokens - 1) % kv.carry.ring].cpu().clone()
    return History(tokens, rows, keys, carry)


def history_tokens(input_len: int, page_size: int) -> int:
    """Tokens of an ``input_len`` prompt imported as history: its complete pages, at least one
    token left to compute (as a cached prefix is imported)."""
    return (input_len - 1) // page_size * page_size


class HistoryImport:
    """An engine's scheduler seam for prepared histories (see the module's docstring)."""

    def __init__(self, eng: Engine, histories: Mapping[tuple[int, ...], History]) -> None:
        """``histories``: a prompt's first ``KEY_TOKENS`` ids -> the history its first tokens
        have. Installs itself as ``eng``'s scheduler prefix; the one it replaces (None, or the
        engine's prefix reuse) serves the other prompts."""
        kv = eng.kv
        if set(kv.snapshot_rings) - {CARRY}:
            raise ValueError("prepared histories do not cover token rings (windowed sources)")
        if kv.keys_shared and kv.sessions is None:
            raise ValueError("a hierarchy engine imports histories into durable sessions")
        self.kv = kv
        self.cfg: ModelConfig = kv.model_cfg
        self.histories = dict(histories)
        self.inner = eng.scheduler.prefix
        self.stats = self.inner.stats if self.inner is not None else PrefixStats()
        self.imported = 0  # sessions seated from a prepared history
        self.imported_tokens = 0
        eng.scheduler.prefix = self

    def lookup(self, req: Request) -> History | None:
        """The history ``req``'s prompt begins with, if any (a preempted request that is
        admitted again imports it again, as a cached prefix would give it back)."""
        h = self.histories.get(tuple(req.prompt_ids[:KEY_TOKENS]))
        if h is None or len(req.prompt_ids) <= h.tokens:
            return None
        return h

    def admit(self, slot: int, req: Request, budget: int, manifest_bytes: int) -> int | None:
        """Tokens imported (the request's ``num_computed`` to be), 0 when there is no room now
        (nothing taken; it waits), or what the replaced prefix reuse answers for a prompt
        without a prepared history."""
        h = self.lookup(req)
        if h is None:
            return None if self.inner is None else self.inner.admit(slot, req, budget,
                                                                     manifest_bytes)  # fmt: skip
        seated = self._adopt if self.kv.keys_shared else self._resident
        if not seated(slot, req, h, budget, manifest_bytes):
            return 0
        req.resumed_tokens = h.tokens
        self.imported += 1
        self.imported_tokens += h.tokens
        return h.tokens

    def leave(self, slot: int, req: Request) -> None:
        if self.inner is not None and self.lookup(req) is None:
            self.inner.leave(slot, req)  # a prepared session's pages are not cached again

    def publish(self, slot: int, req: Request) -> None:
        if self.inner is not None and self.lookup(req) is None:
            self.inner.publish(slot, req)

    # ---- resident ---------------------------------------------------------------------------
    def _resident(self, slot: int, req: Request, h: History, budget: int, manifest: int) -> bool:
        kv = self.kv
        if not kv.admit(slot, req.request_id, req.num_tokens, budget, manifest):
            return False
        for s, rows in h.rows.items():
            _write_pool(kv.payload.pools[s], slot, rows)
        for layer, keys in h.keys.items():
            _write_pool(kv.index_keys.pools[layer], slot, keys)
        if h.carry is not None:
            assert kv.carry is not None
            kv.carry.data[slot, (h.tokens - 1) % kv.carry.ring] = h.carry.to(kv.carry.data.device)
        return True

    # ---- hierarchy: host regions, then KVCache.adopt ----------------------------------------
    def _adopt(self, slot: int, req: Request, h: History, budget: int, manifest: int) -> bool:
        kv, cfg = self.kv, self.cfg
        assert kv.sessions is not None and kv.host_backups is not None
        host = kv.host_backups
        rows = [cfg.rows_for_tokens(s, budget) for s in cfg.stored_sources]
        try:
            regions = host.allocate_regions(
                req.request_id, rows, kv.sessions.regions(budget, manifest)
            )
        except CapacityExhausted:
            return False  # the host arena is full of live sessions: wait for one to end
        arena = host.mapping.tensor
        keys_of = {key_source(layer): keys for layer, keys in h.keys.items()}
        try:
            for r in regions:
                src = h.rows.get(r.source) if r.source >= 0 else keys_of.get(r.source)
                if src is not None:
                    n, w = src.shape
                    view = arena[r.offset : r.offset + n * r.row_bytes].view(n, r.row_bytes)
                    view[:, :w].copy_(src)
                elif r.source not in (MANIFEST_SOURCE, carry_source(cfg)):
                    raise ValueError(f"a history has nothing for region source {r.source}")
            rings = self._rings(h)
            seated = kv.adopt(slot, req.request_id, regions, h.tokens, rings, budget)
        except BaseException:
            host.release_regions(regions)
            raise
        if not seated:
            host.release_regions(regions)
        return seated

    def _rings(self, h: History) -> dict[int, bytes]:
        """The carry ring a seated history starts with: its carry at position ``tokens - 1``
        (the ring's other rows are never read: the first pass writes them)."""
        carry = self.kv.carry
        if carry is None:
            return {}
        assert h.carry is not None
        ring = torch.zeros_like(carry.data[0], device="cpu")
        ring[(h.tokens - 1) % carry.ring] = h.carry
        return {CARRY: ring.view(torch.uint8).numpy().tobytes()}


def _write_pool(pool, slot: int, stored: torch.Tensor) -> None:
    """A slot's first rows of a paged pool (pages ensured) set to ``stored`` bytes [n, w]
    (w at most the pool's row: a shared pool's padding stays)."""
    n, w = stored.shape
    if n == 0:
        return
    dev = pool.data.device
    locs = pool.locations(torch.full((n,), slot, device=dev), torch.arange(n, device=dev))
    raw = pool.data.view(torch.uint8).view(pool.data.shape[0], -1)
    raw[locs, :w] = stored.to(dev)


def prepared_prompts(
    histories: Sequence[History], input_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """One prompt of ``input_len`` random ids per history (its first ``history.tokens`` ids
    are the history's; the rest is prefilled)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for h in histories:
        if h.tokens >= input_len:
            raise ValueError(f"a history of {h.tokens} tokens in a prompt of {input_len}")
        out.append(torch.randint(0, vocab, (input_len,), generator=g).tolist())
    return out
