"""The DSA-style decoder: per layer, an indexer selects rows, the KV cache resolves them to
locations, and sparse attention reads exactly those rows (eq. 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.cache import KVCache
from services.worker.kv.token_ring import ExtendedRows
from services.worker.kv.workspace import SCORE_BLOCK, SHORT_CHUNK
from services.worker.model.attention import MLAAttention
from services.worker.model.config import ModelConfig
from services.worker.model.indexer import LightningIndexer
from services.worker.model.layers import RMSNorm, SwiGLU
from services.worker.model.rotary import Rotary
from services.worker.ops import index_scores, select_topk, sparse_attention_ref


def key_rows(rows: int) -> int:
    """The index-key width a decode pass gathers when its longest request sees ``rows`` rows:
    rounded up to an eighth of its power of two (>= 256), so the width, and with it a captured
    decode graph, changes once every few thousand tokens, at most 12.5% (and 255 rows) over.
    Eager and captured passes use the same width, so they compute the same scores."""
    step = max(256, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


@dataclass
class LayerTrace:
    """What one layer's attention consumed, for exactness checks."""

    layer: int
    selection: torch.Tensor  # [N, k] row positions
    locations: torch.Tensor  # [N, k] pool locations
    rows: torch.Tensor  # [N, k, d_kv] the gathered attention inputs (zero where padded)


@dataclass
class _Pass:
    """State shared by the layers of one forward pass."""

    ext: dict[int, ExtendedRows] = field(default_factory=dict)
    new_rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    selection: dict[int, torch.Tensor] = field(default_factory=dict)
    locations: dict[int, torch.Tensor] = field(default_factory=dict)
    rotary: Rotary | None = None  # the pass's positions, rotary tables shared by every layer


class DSALayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.spec = cfg.layers[layer]
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLAAttention(cfg, layer)
        self.indexer = LightningIndexer(cfg) if self.spec.index == "producer" else None
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)


class SparseDecoder(nn.Module):
    """The DSA forward pass over the KV cache, shared by every family: per layer, the owner
    writes its source's rows, an index producer writes its index keys and selects rows,
    followers take their leader's selection, the cache resolves selections to locations, and
    sparse attention reads exactly those rows.

    A family provides ``cfg`` (the topology), ``embed``, ``layers`` (each with ``spec``,
    ``attn_norm``, ``attn``, ``indexer`` or None, ``mlp_norm``, ``mlp``), ``norm``,
    ``lm_head`` (None: tied to ``embed``) and ``rotary(positions)``; its attention has
    ``owner``, ``scale``, ``token_rows(x, rotary)``, ``queries(x, rotary) -> (q, q_latent)``
    and ``output(o)``; its indexer ``keys(x, rows, rotary)`` and
    ``queries(x, q_latent, rotary) -> (q, w)``."""

    cfg: ModelConfig
    embed: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear | None

    def _init_topology(self, cfg: ModelConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        # follower layers (and their sources) of each index producer, resolved together
        self.followers: dict[int, list[tuple[int, int]]] = {}
        for i, spec in enumerate(cfg.layers):
            if spec.index == "follower":
                self.followers.setdefault(spec.leader, []).append((i, spec.source))
        self.attention_fn = sparse_attention_ref

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return Rotary(positions, self.cfg.rope_theta)

    def use_triton_attention(self) -> None:
        from services.worker.ops.sparse_attention_triton import sparse_attention_triton

        self.attention_fn = sparse_attention_triton

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        trace: list[LayerTrace] | None = None,
        features: dict[int, torch.Tensor] | None = None,
        begin: bool = True,
        selections: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids: [N] new tokens of ``batch`` -> final hidden states [N, d_model].

        Writes the new tokens' rows and index keys into ``kv`` as a side effect; the caller
        then ``kv.commit``s the tokens that are final. ``features``: for each layer index it
        names, filled with that layer's output hidden states [N, d_model] (the target features
        a DFlash-style drafter is conditioned on). ``begin=False``: the caller already began the
        pass on ``kv`` (host-side planning that a captured graph cannot hold). ``selections``:
        filled with every layer's selected row positions [N, k] (-1 pads; a follower's are its
        leader's), without the gathered rows a ``trace`` keeps."""
        if begin:
            kv.begin(batch)
        h = self.embed(input_ids)
        st = _Pass(rotary=self.rotary(batch.positions))
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, layer.attn_norm(h), batch, kv, st, trace)
            h = h + layer.mlp(layer.mlp_norm(h))
            if features is not None and i in features:
                features[i] = h
        if selections is not None:
            selections.update(st.selection)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., vocab] fp32."""
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return hidden.float() @ w.float().t()

    # ---- one layer --------------------------------------------------------------------------
    def _attention(
        self,
        i: int,
        layer: DSALayer,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        st: _Pass,
        trace: list[LayerTrace] | None,
    ) -> torch.Tensor:
        spec = layer.spec
        s = spec.source
        src = self.cfg.sources[s]
        if layer.attn.owner:
            self._write_source(s, layer.attn, x, batch, kv, st)
        q, q_latent = layer.attn.queries(x, st.rotary)
        if layer.indexer is not None:
            slots, rows, values = st.new_rows[s]
            if rows.numel():
                keys = layer.indexer.keys(x, values, st.rotary)
                kv.index_keys.write(i, slots, rows, keys)
            iq, iw = layer.indexer.queries(x, q_latent, st.rotary)
            st.selection[i] = self._select(i, iq, iw, batch, kv, src.compress)
            if i in self.followers:  # one selection starts every follower's transfer
                kv.payload.prefetch(self.followers[i], batch, st.selection[i])
        else:  # follower (shared indices) or reuse (shared source): the leader's positions
            st.selection[i] = st.selection[spec.leader]
        if spec.index == "reuse":
            locs = st.locations[spec.leader]  # inherited: no resolution
        else:
            locs = kv.payload.resolve(i, s, batch, st.selection[i])
        st.locations[i] = locs
        pool = kv.payload.pool(s)
        if trace is not None:
            rows = pool[locs.clamp(min=0)].masked_fill((locs < 0).unsqueeze(-1), 0)
            trace.append(LayerTrace(i, st.selection[i], locs, rows))
        win_pool = win_locs = None
        if src.window > 0:
            win_pool, win_locs = st.ext[s].rows, st.ext[s].window_locs(src.window)
        o = self.attention_fn(
            q, pool, locs, self.cfg.d_latent, layer.attn.scale, win_pool, win_locs
        )
        return layer.attn.output(o)

    def _write_source(
        self,
        s: int,
        attn: nn.Module,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        st: _Pass,
    ) -> None:
        """Computes the chunk's rows of source ``s`` and stores the complete ones (eq. 8)."""
        m = self.cfg.sources[s].compress
        tok_rows = attn.token_rows(x, st.rotary)
        if s in kv.rings:
            st.ext[s] = kv.rings[s].extend(batch, tok_rows)
        if m == 1:
            slots, rows, values = batch.token_slot, batch.positions, tok_rows
        else:
            dev = tok_rows.device
            lo = batch.starts_t // m
            hi = (batch.starts_t + batch.cu_lens[1:] - batch.cu_lens[:-1]) // m
            count = hi - lo
            group_req = torch.repeat_interleave(torch.arange(len(count), device=dev), count)
            first = torch.cumsum(count, 0) - count
            rows = lo[group_req] + torch.arange(len(group_req), device=dev) - first[group_req]
            pos = rows.unsqueeze(1) * m + torch.arange(m, device=dev).unsqueeze(0)
            idx = st.ext[s].index(group_req.unsqueeze(1).expand_as(pos), pos)
            values = attn.compress(st.ext[s].rows[idx]) if len(rows) else tok_rows[:0]
            slots = batch.slots[group_req]
        if rows.numel():
            kv.payload.write_rows(s, slots, rows, values)
        st.new_rows[s] = (slots, rows, values)

    def _select(
        self,
        i: int,
        q: torch.Tensor,
        w: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        m: int,
    ) -> torch.Tensor:
        """[N, k] ordered top-k row positions per query token over its visible rows, from the
        indexer's queries q [N, H, d_index] and weights w [N, H]."""
        k = self.cfg.index_topk
        num_visible = (batch.positions + 1) // m  # complete rows at or before each query
        ends = batch.ends()  # the host knows how far each request sees: no read-back
        if batch.is_decode:
            keys = kv.index_keys.gather(i, batch.slots, num_visible, key_rows(max(ends) // m))
            return select_topk(index_scores(q, w, keys), num_visible, k)
        if max(batch.lens) <= SHORT_CHUNK:  # verify rounds: every request at once
            # at the bucketed width, as a decode pass: a captured verify pass keeps its shapes
            width = key_rows(max(ends) // m)
            scores = self._short_chunk_scores(i, q, w, batch, kv, num_visible, width)
            return select_topk(scores, num_visible, k)
        out = torch.empty(batch.num_tokens, k, dtype=torch.int64, device=q.device)
        cu = batch.cu
        for r in range(batch.num_requests):
            a, b = cu[r], cu[r + 1]
            keys = kv.index_keys.gather(
                i, batch.slots[r : r + 1], num_visible[b - 1 : b], ends[r] // m
            )[0]
            for c in range(a, b, SCORE_BLOCK):
                e = min(b, c + SCORE_BLOCK)
                out[c:e] = select_topk(index_scores(q[c:e], w[c:e], keys), num_visible[c:e], k)
        return out

    def _short_chunk_scores(
        self,
        i: int,
        q: torch.Tensor,
        w: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        num_visible: torch.Tensor,
        max_visible: int,
    ) -> torch.Tensor:
        """[N, S] index scores of every token of a batch of short chunks: each request's
        queries, padded to the longest chunk, against its own keys in one batched product
        (the same per-query reduction as ``index_scores``). ``max_visible``: S, at least the
        most rows any request sees (keys beyond a request's rows are zero; top-k masks them)."""
        # each request's keys up to what its last (most-seeing) token sees: [R, S, D]
        seen = num_visible[batch.last_token_index]
        keys = kv.index_keys.gather(i, batch.slots, seen, max_visible).float()
        col = torch.arange(batch.num_tokens, device=q.device) - batch.cu_lens[batch.token_req]
        shape = (batch.num_requests, max(batch.lens))
        qp = q.new_zeros(*shape, *q.shape[1:]).float()
        qp[batch.token_req, col] = q.float()
        wp = w.new_zeros(*shape, w.shape[1]).float()
        wp[batch.token_req, col] = w.float()
        logits = torch.einsum("rkhd,rsd->rkhs", qp, keys)
        scores = (logits.relu() * wp.unsqueeze(-1)).sum(dim=2)  # [R, Kmax, S]
        return scores[batch.token_req, col]


class DSAModel(SparseDecoder):
    """The home-made DSA family (test fixtures for topologies no released family has yet:
    shared Reuse/Reindex sources, compression, local windows)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self._init_topology(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DSALayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
