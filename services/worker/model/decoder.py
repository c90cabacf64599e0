"""The DSA-style decoder: per layer, an indexer selects rows, the KV cache resolves them to
locations, and sparse attention reads exactly those rows (eq. 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dhisparse.family.config import ModelConfig
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.token_ring import ExtendedRows
from services.worker.model.layers import RMSNorm
from services.worker.model.rotary import Rotary
from services.worker.model.row_selection import select_rows
from services.worker.model.vocab import vocab_logits
from services.worker.ops import sparse_attention_ref
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.parallel.exchange import ExpertExchange
from services.worker.serving.cache import KVCache


@dataclass
class LayerTrace:
    """What one layer's attention consumed, for exactness checks."""

    layer: int
    selection: torch.Tensor  # [N, k] row positions
    locations: torch.Tensor  # [N, k] pool locations
    rows: torch.Tensor  # [N, k, d_kv] the gathered attention inputs (zero where padded)


@dataclass
class ForwardState:
    """State shared by the layers of one forward pass."""

    ext: dict[int, ExtendedRows] = field(default_factory=dict)
    # source -> (slots, rows, values) written, and which tokens of the pass they are (None: one
    # row per token, in order)
    new_rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = (
        field(default_factory=dict)
    )
    selection: dict[int, torch.Tensor] = field(default_factory=dict)
    locations: dict[int, torch.Tensor] = field(default_factory=dict)
    rotary: Rotary | None = None  # the pass's positions, rotary tables shared by every layer


class SparseDecoder(nn.Module):
    """The DSA forward pass over the KV cache, shared by every family: per layer, the owner
    writes its source's rows, an index producer writes its index keys and selects rows,
    followers take their leader's selection, the cache resolves selections to locations, and
    sparse attention reads exactly those rows.

    A family provides ``cfg`` (the topology), ``embed``, ``layers`` (each with ``spec``,
    ``attn_norm``, ``attn``, ``indexer`` or None, ``mlp_norm``, ``mlp``), ``norm`` (the norms
    ``RMSNorm``s, whose ``add_norm`` joins the residual),
    ``lm_head`` (None: tied to ``embed``) and ``rotary(positions)``; its attention has
    ``owner``, ``scale``, ``token_rows(x, rotary)``, ``queries(x, rotary) -> (q, q_latent)``
    and ``output(o)``; its indexer ``keys(x, rows, rotary)`` and
    ``queries(x, q_latent, rotary) -> (q, w)``."""

    cfg: ModelConfig
    embed: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm
    lm_head: nn.Linear | None
    vocab_group: Comm = LOCAL  # the ranks holding the rest of the head's rows
    # data-parallel attention: the MoE layers' exchange, which idle ranks serve (``idle``)
    expert_exchange: ExpertExchange | None = None

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

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its rows and activations are computed in: the token embedding's."""
        return self.embed.weight.dtype

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
        given_selections: dict[int, torch.Tensor] | None = None,
        given_experts: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids: [N] new tokens of ``batch`` -> final hidden states [N, d_model].

        Writes the new tokens' rows and index keys into ``kv`` as a side effect; the caller
        then ``kv.commit``s the tokens that are final. ``features``: for each layer index it
        names, filled with that layer's output hidden states [N, d_model] (the target features
        a DFlash-style drafter is conditioned on). ``begin=False``: the caller already began the
        pass on ``kv`` (host-side planning that a captured graph cannot hold). ``selections``:
        filled with every layer's selected row positions [N, k] (-1 pads; a follower's are its
        leader's), without the gathered rows a ``trace`` keeps.

        Injection (to compare against a reference with its discrete choices imposed):
        ``given_selections``: layer -> row positions [N, k] int64 (-1 pads) that layer attends
        instead of its own selection; a producer given one neither runs its indexer nor writes
        its index keys in this pass (so every pass over the cache must be given one), and its
        followers take it. ``given_experts``: MoE layer -> experts [N, top_k] int64 that replace
        the router's choice (``Router.forward``'s ``given``)."""
        given_selections = given_selections or {}
        given_experts = given_experts or {}
        if begin:
            kv.payload.begin(batch)
        h = self.embed(input_ids)
        st = ForwardState(rotary=self.rotary(batch.positions))
        # Each residual join is one kernel with the norm after it (``add_norm``): the MLP's
        # output joins h before the next layer's attn_norm, the last layer's before ``norm``.
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        x = self.layers[0].attn_norm(h) if len(self.layers) else h
        for i, layer in enumerate(self.layers):
            a = self._attention(i, layer, x, batch, kv, st, trace, given_selections.get(i))
            x, h = layer.mlp_norm.add_norm(a, h)  # h = h + a; x = mlp_norm(h)
            m = layer.mlp(x) if i not in given_experts else layer.mlp(x, given_experts[i])
            x, h = next_norms[i].add_norm(m, h)  # h = h + m; x = the next norm of h
            if features is not None and i in features:
                features[i] = h
        if selections is not None:
            selections.update(st.selection)
        out = x if len(self.layers) else self.norm(h)
        self._follow_target(input_ids, out, batch, kv)
        return out

    def _follow_target(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> None:
        """After the target's layers: a draft layer's rows that the pass's tokens and final
        hidden states ``hidden`` [N, d] complete (the MTP layer's, ``MLADecoder``)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., vocab] fp32 (the whole vocabulary's, on every rank)."""
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return vocab_logits(hidden, w, self.vocab_group)

    # ---- one layer --------------------------------------------------------------------------
    def _attention(
        self,
        i: int,
        layer: nn.Module,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        st: ForwardState,
        trace: list[LayerTrace] | None,
        given: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``given``: the selection [N, k] to attend instead of running the layer's indexer
        (an MTP draft step reusing its first step's, ``index_share_for_mtp_iteration``; a
        reference's, injected through ``forward``'s ``given_selections``)."""
        spec = layer.spec
        s = spec.source
        src = self.cfg.sources[s]
        if layer.attn.owner:
            self._write_source(s, layer.attn, x, batch, kv, st)
        q, q_latent = layer.attn.queries(x, st.rotary)
        if given is not None:
            st.selection[i] = given
        elif layer.indexer is not None:
            self._write_keys(i, layer.indexer, x, kv, st)
            iq, iw = layer.indexer.queries(x, q_latent, st.rotary)
            st.selection[i] = select_rows(self.cfg, i, iq, iw, batch, kv, s)
            if i in self.followers:  # one selection starts every follower's transfer
                kv.payload.prefetch(self.followers[i], batch, st.selection[i])
        else:  # follower (shared indices) or reuse (shared source): the leader's positions
            st.selection[i] = st.selection[spec.leader]
        if spec.index == "reuse":
            locs = st.locations[spec.leader]  # inherited: no resolution
        else:
            locs = kv.payload.resolve(i, s, batch, st.selection[i])
        st.locations[i] = locs
        win_pool = win_locs = None
        if src.window > 0:
            win_pool, win_locs = st.ext[s].rows, st.ext[s].window_locs(src.window, src.lag)
        traced: list[torch.Tensor] | None = None if trace is None else []
        # fp8 rows are dequantized into a fixed workspace, a block of query tokens at a time
        step = len(q) if kv.attention_block is None else kv.attention_block
        outs = []
        for a in range(0, max(len(q), 1), max(step, 1)):
            b = a + step
            pool, at = kv.attention_rows(s, locs[a:b])
            if traced is not None:
                traced.append(pool[at.clamp(min=0)].masked_fill((at < 0).unsqueeze(-1), 0))
            wl = None if win_locs is None else win_locs[a:b]
            outs.append(self.attention_fn(
                q[a:b], pool, at, self.cfg.d_latent, layer.attn.scale, win_pool, wl
            ))  # fmt: skip
        if trace is not None:
            trace.append(LayerTrace(i, st.selection[i], locs, torch.cat(traced)))
        return layer.attn.output(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _write_keys(
        self, i: int, indexer: nn.Module, x: torch.Tensor, kv: KVCache, st: ForwardState
    ) -> None:
        """Producer ``i``'s index keys of the rows this pass wrote to its source."""
        slots, rows, values, keep = st.new_rows[self.cfg.layers[i].source]
        if rows.numel():
            keys = indexer.keys(x, values, st.rotary)
            kv.index_keys.write(i, slots, rows, keys if keep is None else keys[keep])

    def _write_source(
        self,
        s: int,
        attn: nn.Module,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        st: ForwardState,
    ) -> None:
        """Computes the chunk's rows of source ``s`` and stores the complete ones (eq. 8; the
        row of a lagged source's token at p is row p - lag, none for p < lag)."""
        src = self.cfg.sources[s]
        m = src.compress
        tok_rows = attn.token_rows(x, st.rotary)
        if s in kv.rings:
            st.ext[s] = kv.rings[s].extend(batch, tok_rows)
        keep = None
        if m == 1:
            rows = batch.positions - src.lag if src.lag else batch.positions
            slots, values = batch.token_slot, tok_rows
            if src.lag and min(batch.starts) < src.lag:  # a request's first tokens: no row
                keep = rows >= 0
                slots, rows, values = slots[keep], rows[keep], values[keep]
        else:
            done = kv.payload.pass_state.completed_rows(m)  # planned on the host
            if done is None:
                slots, rows, values = batch.slots[:0], batch.starts_t[:0], tok_rows[:0]
            else:
                offs = torch.arange(m, device=tok_rows.device)
                pos = done.rows.unsqueeze(1) * m + offs.unsqueeze(0)
                idx = st.ext[s].index(done.reqs.unsqueeze(1).expand_as(pos), pos)
                slots, rows = batch.slots[done.reqs], done.rows
                values = attn.compress(st.ext[s].rows[idx])
        if rows.numel():
            kv.payload.write_rows(s, slots, rows, values)
        st.new_rows[s] = (slots, rows, values, keep)
