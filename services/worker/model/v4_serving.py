"""DeepSeek-V4 as the engine's model: the step-1 module tree (``V4Decoder``) run over a batch
of requests, each at its own position, with its KV state in the engine's cache
(``dhisparse.family.v4_config.v4_topology``: a source per layer that computes rows).

Per layer and pass:

- the chunk's K=V rows join the layer's source's token ring (a consumer of a DeepSeek-V4.1
  shared source: its own window ring, a state ring); each query attends the ring's rows of
  its last ``sliding_window`` positions;
- a CSA / HCA layer's compressor projects the chunk's tokens into its per-slot ring of
  projections (a state ring of the cache, ``v4_state_rings``: the open window's tokens and,
  overlapping, the window before), snapshotted with a durable session like the token rings;
  each row a chunk completes is pooled from the ring and written to the payload at its row
  index; a CSA layer's indexer does the same with its own compressor into the index keys;
- a consumer of a shared source writes nothing of it: a Reindex layer selects over the
  source's index keys, a Reuse layer attends its leader's selection and rows;
- with DeepSeek-V4.1's candidate blocks (``V4Config.candidates``) the candidate source's
  indexer publishes each query token's blocks into the pass's ``PassCandidates`` (the pass's
  own tensors, made anew by every pass: a captured decode pass recomputes them on replay), and
  every later indexer of the pass scores only inside them;
- a CSA query attends the rows the indexer's top-k over the index keys selects
  (``row_selection.select_rows``), an HCA query every row it sees (``w < (t + 1) // rate``);
  the payload resolves them to locations, and the sparse attention (``attention_fn``: the
  torch reference, or the Triton kernels) reads ``pool[location]`` and the window's ring rows
  in one softmax with the heads' sinks;
- the hyper-connections and the MoE are per token (hash routing by the pass's token ids).

A slot's rings hold only positions its earlier passes wrote, and every read of a position
before 0 is masked, so a slot needs no clearing between requests.

Built with the MTP layer (``--drafter mtp``, ``v4_mtp.MTPBlock``), its source is layer N's, a
sliding window that lags by one and keeps no history (its rows live in the source's token ring
alone, nothing in the payload): every target pass records its last block's streams in the
carry and writes the MTP rows its tokens complete (``_follow_target``); ``mtp_step`` runs one
MTP-only draft pass (docs/mtp.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dhisparse.family.v4_config import v4_state_rings, v4_topology
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.pass_rows import visible_width
from services.worker.kv.token_ring import ExtendedRows, RingIndex, TokenRing
from services.worker.model.candidate_blocks import PassCandidates
from services.worker.model.decoder import LayerTrace
from services.worker.model.hot_vocab import HotHead
from services.worker.model.mla_mtp import MTPStep
from services.worker.model.row_selection import select_rows
from services.worker.model.v4_attention import Attention
from services.worker.model.v4_compressor import Compressor
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_mtp import MTPBlock
from services.worker.model.v4_rope import PassRope
from services.worker.ops import sparse_attention_ref
from services.worker.serving.cache import STATE_RINGS, KVCache


def pooled_rows(
    comp: Compressor, ext: ExtendedRows, reqs: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """[g, dim] the compressed rows ``rows`` [g] of batch requests ``reqs`` [g] (the pass's
    completed rows of the compressor's rate), pooled from the projections in ``ext`` (this
    pass's and the slot ring's before it)."""
    m, width = comp.rate, comp.wkv.out_features
    own = ext.at.groups(ext.ring, reqs, rows, m, 0)  # [g, m]
    proj = ext.rows[own]
    prev_kv = prev_gate = None
    if comp.overlap:  # the window before: none before row 0 (position < 0: gate -inf)
        before = ext.at.groups(ext.ring, reqs, rows, m, 1)
        prev = ext.rows[before.clamp(min=0)]
        missing = (before < 0).unsqueeze(-1)
        prev_kv = prev[..., :width].masked_fill(missing, 0)
        prev_gate = prev[..., width:].masked_fill(missing, float("-inf"))
    return comp.pool(proj[..., :width], proj[..., width:], prev_kv, prev_gate, rows)


@dataclass(frozen=True)
class V4Pass:
    """What the layers of one forward pass share: its batch and cache, the compressors'
    rings, its positions with their rotary tables, its ring addressing (``RingIndex``), its
    candidate blocks (V4.1), the selections its selecting layers made (``chosen_by``) and the
    trace of what they read (None: none kept)."""

    batch: ForwardBatch
    kv: KVCache
    rings: dict[tuple[int, str], TokenRing]
    rope: PassRope
    ring_at: RingIndex
    blocks: PassCandidates | None
    trace: list[LayerTrace] | None
    chosen_by: dict[int, torch.Tensor]


class V4Model(nn.Module):
    """The engine's model interface over ``net``: ``cfg`` (the KV topology), ``forward``
    (tokens, batch, cache -> final hidden states), ``logits``. ``family``: the model's math."""

    expert_exchange = None  # one rank: no expert exchange

    def __init__(self, net: V4Decoder, name: str) -> None:
        super().__init__()
        self.net = net
        self.family = net.cfg
        self.mtp: MTPBlock | None = None if net.mtp is None else net.mtp[0]
        self.cfg = v4_topology(net.cfg, name, mtp=self.mtp is not None)
        self.cfg.validate()
        # (layer, "kv" | "index") -> the key of its compressor's ring in the cache's snapshot
        self.ring_keys = {
            (i, part): STATE_RINGS - j for j, (i, part, _, _) in enumerate(v4_state_rings(net.cfg))
        }
        self.attention_fn = sparse_attention_ref
        for block in (*net.layers, *(net.mtp or ())):
            block.ffn.fuse()

    def use_triton_attention(self) -> None:
        from services.worker.ops.sparse_attention_triton import sparse_attention_triton

        self.attention_fn = sparse_attention_triton

    def _attend(
        self, attn: Attention, q: torch.Tensor, picked: Picked | None, window: torch.Tensor,
        ring: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """q [N, heads, head_dim] over the ``picked`` compressed rows (None: none) and the
        ring's rows at ``window`` [N, W] (-1: none), one softmax with the heads' sinks."""
        sinks = attn.attn_sink.float()
        d = attn.head_dim
        if picked is None:
            return self.attention_fn(q, ring, window, d, attn.scale, sinks=sinks)
        return self.attention_fn(
            q, picked.pool, picked.at, d, attn.scale, ring, window, sinks=sinks
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        trace: list[LayerTrace] | None = None,
        features: dict[int, torch.Tensor] | None = None,
        begin: bool = True,
    ) -> torch.Tensor:
        """input_ids: [N] new tokens of ``batch`` -> final hidden states [N, hidden] (after the
        hyper head and ``norm``). Writes the pass's rows, index keys and ring entries into
        ``kv`` as ``SparseDecoder.forward`` does; ``begin=False``: the caller began the pass.
        ``trace``: filled with each CSA / HCA layer's selection, locations and the compressed
        rows it read (the window rows come from the token rings in every mode). ``features``
        naming a layer (a drafter's target features) are not available for V4 and raise; an
        empty one (the MTP drafter's: it reads the carry) asks for nothing."""
        if features:
            raise ValueError("DeepSeek-V4 gives no drafter features")
        if begin:
            kv.payload.begin(batch)
        rule = self.family.candidates
        p = V4Pass(
            batch=batch,
            kv=kv,
            rings={part: kv.snapshot_rings[key] for part, key in self.ring_keys.items()},
            rope=PassRope(batch.positions),  # every layer's rotary tables, computed once
            ring_at=RingIndex(batch),  # every ring's addressing, once per ring size
            blocks=None if rule is None else PassCandidates(rule),  # from its source
            trace=trace,
            chosen_by={},
        )
        streams = self.net.streams(input_ids)
        for i, block in enumerate(self.net.layers):
            streams = block.run(
                streams, input_ids, lambda x, i=i, a=block.attn: self._attention(i, a, x, p)
            )
        if self.mtp is not None:
            self._follow_target(input_ids, streams, p)
        return self.net.final(streams)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its rows and activations are computed in: the token embedding's (the
        tensors ``v4_precision`` keeps in fp32 come first among its parameters)."""
        return self.net.embed.weight.dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] fp32."""
        return self.net.head(hidden).float()

    # ---- the MTP layer ---------------------------------------------------------------------
    @property
    def mtp_layer(self) -> int:
        """The MTP layer's index (N, after the target's layers)."""
        return self.family.num_layers

    @property
    def mtp_head(self) -> torch.Tensor:
        """[V, hidden] the MTP layer's head: the target's."""
        return self.net.head.weight

    @property
    def mtp_source(self) -> int:
        """The MTP layer's source (after the target's sources)."""
        return self.cfg.layers[self.mtp_layer].source

    @property
    def mtp_index_share(self) -> bool:
        """V4's MTP layer has no indexer: no selection to share between draft steps."""
        return False

    def _follow_target(self, input_ids: torch.Tensor, streams: torch.Tensor, p: V4Pass) -> None:
        """The MTP rows the pass's tokens complete: the token at p with the target's last
        streams at p - 1 (this pass's, or the carry's for a request's first token) gives MTP
        row p - 1, stored in the MTP source's ring under p (``SourceSpec.lag``), through the
        layer's fusion, hyper-connection and K=V projection only (its attention and MoE are
        not needed to write its KV). Every pass records its streams in the carry."""
        assert self.mtp is not None
        batch, kv = p.batch, p.kv
        ext = kv.follow_carry(batch, streams.flatten(1))
        before = ext.index(batch.token_req, batch.positions - 1).clamp(min=0)  # p = 0: no row
        prev = ext.rows[before].view_as(streams)
        x = self.mtp.attention_input(self.mtp.fuse(self.net.embed(input_ids), prev))
        rows = self.mtp.attn.kv_rows(x, (batch.positions - 1).clamp(min=0))
        kv.rings[self.mtp_source].extend(batch, rows, p.ring_at)

    @torch.no_grad()
    def mtp_step(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        hidden: torch.Tensor | None = None,
        selection: torch.Tensor | None = None,
        begin: bool = True,
        hot: HotHead | None = None,
    ) -> MTPStep:
        """One MTP-only draft pass: ``tokens`` [R], one per request at ``batch.positions`` (a
        decode-shaped batch of the MTP source only), each with the streams before it —
        ``hidden`` [R, hc_mult * hidden], or the carry's (the target's at p - 1) when None.
        Writes MTP row p - 1 into the source's ring (the verify pass rewrites it) and attends
        the MTP rows of the window before it. ``selection`` must be None (no MTP indexer).
        ``begin=False``: the caller already began the pass on ``kv``. ``hot``: the logits
        cover its ids only (``HotHead``, built from ``mtp_head``)."""
        assert self.mtp is not None and kv.carry is not None, "a model loaded with its MTP layer"
        assert selection is None, "DeepSeek-V4's MTP layer selects no rows"
        if begin:
            kv.payload.begin(batch)
        if hidden is None:
            hidden = kv.carry.rows_at(batch.slots, batch.positions - 1)
        r, c = tokens.shape[0], self.family
        mtp = self.mtp
        streams = mtp.fuse(self.net.embed(tokens), hidden.view(r, c.hc_mult, c.hidden_size))
        streams = mtp.run(streams, tokens, lambda x: self._mtp_attention(x, batch, kv))
        none = torch.empty(r, 0, dtype=torch.int64, device=tokens.device)
        if hot is not None:
            logits = hot.logits(mtp.final(streams))
            return MTPStep(streams.flatten(1), logits, none, hot.tokens(logits))
        logits = self.logits(mtp.final(streams))
        return MTPStep(streams.flatten(1), logits, none, logits.argmax(-1))

    def _mtp_attention(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """The MTP layer's attention for x [R, hidden] of tokens at p: its query and row at
        position p - 1 over the rows p - window .. p - 1 (ring positions p - window + 1 .. p,
        none below 1)."""
        assert self.mtp is not None
        attn, pos = self.mtp.attn, batch.positions - 1
        _, q, rows = attn.project(x, pos)
        ext = kv.rings[self.mtp_source].extend(batch, rows)
        window = ext.window_locs(attn.window, lag=1)
        return attn.output(self._attend(attn, q, None, window, ext.rows), pos)

    def _attention(self, i: int, attn: Attention, x: torch.Tensor, p: V4Pass) -> torch.Tensor:
        """Layer ``i``'s attention over its source for x [N, hidden] -> [N, hidden] in pass
        ``p``; a CSA / HCA layer appends what it read of the payload to ``p.trace``. A layer
        that computes rows writes them and its index keys; a Reuse consumer attends its
        leader's selection (``p.chosen_by``: a selecting layer's selection this pass), resolved
        again in its own layer, a Reindex consumer selects over its KV source's keys; the
        candidate source's indexer publishes the pass's candidate blocks (V4.1) into
        ``p.blocks``, read by later ones."""
        spec = self.cfg.layers[i]
        s = spec.source
        batch, kv, rings, pos, blocks = p.batch, p.kv, p.rings, p.rope, p.blocks
        q_latent, q, rows = attn.project(x, pos)
        window_ring = rings[i, "window"] if (i, "window") in rings else kv.rings[s]
        ext = window_ring.extend(batch, rows, p.ring_at)
        window = ext.window_locs(attn.window)  # [N, W] positions t - W + 1 .. t, -1: before 0
        picked = None
        if attn.kind != "sliding":
            if attn.compressor is not None:
                self._write_rows(i, attn, x, p)
            if spec.index == "reuse":
                selection = p.chosen_by[spec.leader]
            elif attn.kind == "csa":
                idx = attn.indexer
                iq, iw = idx.queries(x, q_latent, pos)
                # index_scores weighs relu(q . k) by w: the indexer's dim^-0.5 goes into w
                key_layer = self.cfg.key_layer(i)
                step = None if blocks is None else blocks.step(i)
                selection = select_rows(
                    self.cfg, key_layer, iq, iw * idx.dim**-0.5, batch, kv, s, step
                )
            else:
                selection = every_visible_row(batch, attn.rate)
            p.chosen_by[i] = selection
            picked = pick_rows(i, s, batch, kv, selection)
            if p.trace is not None:
                p.trace.append(LayerTrace(i, selection, picked.locs, picked.rows()))
        return attn.output(self._attend(attn, q, picked, window, ext.rows), pos)

    def _write_rows(self, i: int, attn: Attention, x: torch.Tensor, p: V4Pass) -> None:
        """Layer ``i`` computes its source's rows: the compressed rows the pass's chunks
        complete (planned by the pass's state, ``pass_rows``) into the payload and, CSA, their
        index keys."""
        batch, kv, rings = p.batch, p.kv, p.rings
        ext_rows = rings[i, "kv"].extend(batch, attn.compressor.project(x), p.ring_at)
        keys_comp = attn.indexer.compressor if attn.kind == "csa" else None
        ext_keys = None
        if keys_comp is not None:
            ext_keys = rings[i, "index"].extend(batch, keys_comp.project(x), p.ring_at)
        done = kv.payload.pass_state.completed_rows(attn.rate)
        if done is None:
            return
        slots = batch.slots[done.reqs]
        rows_new = pooled_rows(attn.compressor, ext_rows, done.reqs, done.rows)
        kv.payload.write_rows(self.cfg.layers[i].source, slots, done.rows, rows_new)
        if keys_comp is not None and ext_keys is not None:
            keys = pooled_rows(keys_comp, ext_keys, done.reqs, done.rows)
            kv.index_keys.write(i, slots, done.rows, keys)


@dataclass(frozen=True)
class Picked:
    """A layer's selected compressed rows as attention reads them: ``pool[at]`` [N, S] (-1:
    none), and the rows' locations in the payload, ``locs`` [N, S] (-1 where the selection
    pads)."""

    pool: torch.Tensor
    at: torch.Tensor
    locs: torch.Tensor

    def rows(self) -> torch.Tensor:
        """[N, S, d] the rows, zero where none."""
        return self.pool[self.at.clamp(min=0)].masked_fill((self.at < 0).unsqueeze(-1), 0)


def pick_rows(i: int, s: int, batch: ForwardBatch, kv: KVCache, selection: torch.Tensor) -> Picked:
    """Layer ``i``'s ``selection`` [N, S] of source ``s``'s compressed rows, resolved. With a
    hot cache of B rows per request (the hierarchy modes) the payload resolves at most B
    columns at a time, so a selection wider than B (an HCA layer's every visible row) is read
    block by block into rows of its own before the next block is resolved; the rows read are
    the same."""
    block = kv.payload.layout()["hot_cache_rows"] or max(selection.shape[1], 1)
    if selection.shape[1] <= block:
        locs = kv.payload.resolve(i, s, batch, selection)
        pool, at = kv.attention_rows(s, locs)
        return Picked(pool, at, locs)
    rows, resolved = [], []
    for a in range(0, selection.shape[1], block):
        locs = kv.payload.resolve(i, s, batch, selection[:, a : a + block])
        rows.append(Picked(*kv.attention_rows(s, locs), locs).rows())
        resolved.append(locs)
    locs = torch.cat(resolved, dim=1)
    at = torch.arange(locs.numel(), device=locs.device).view_as(locs)
    return Picked(torch.cat(rows, dim=1).flatten(0, 1), torch.where(locs >= 0, at, -1), locs)


def every_visible_row(batch: ForwardBatch, rate: int) -> torch.Tensor:
    """[N, S] every compressed row each query sees (``w < (t + 1) // rate``) in row order,
    ``-1`` beyond; S: ``visible_width`` of the most any request sees after its chunk (the width
    a CUDA graph's key names)."""
    width = visible_width(max(batch.ends()) // rate)
    rows = torch.arange(width, device=batch.positions.device)
    seen = ((batch.positions + 1) // rate).unsqueeze(1)
    return torch.where(rows < seen, rows, torch.full_like(rows, -1))
