"""The differentiable training forward of an ``MLADecoder`` (DeepSeek-V3.2, GLM-5) over whole
sequences [B, T] at positions 0..T-1, without a KV cache, through the model's own modules and
parameters, so that trained weights export unchanged.

Attention is MLA in the expanded form transformers runs: per-head keys ``[k_nope ; k_rope]``
(``k_nope`` and the values from ``kv_b_proj(kv_a_layernorm(latent))``, ``k_rope`` the shared
RoPE'd key in the interleaved layout ``mla.py`` uses), in fused SDPA at the model's
``softmax_scale``: the logits of the absorbed form that serving runs.

- ``dense``: causal attention (``is_causal``: no [B, H, T, T] tensor);
- ``sparse``: each query attends exactly the rows the inference path selects: its producer's
  top-k of the fp32 index scores (``ops.select_topk``, ties to the lower position; every
  visible row while fewer than ``index_topk`` are), which IndexShare followers reuse.

Each index producer's indexer (the MTP layer's included) learns by DSA distillation alone: it
reads detached inputs, and its loss is KL(target || softmax(scores)) over the allowed rows
(visible in dense mode, selected in sparse), the target being the main attention's
probabilities summed over heads and renormalised over those rows, detached. Scores and targets
are computed a chunk of queries at a time (``SCORE_ELEMENTS``), the KL under activation
checkpointing, so that nothing of size [B, T, H, T] is kept at any T.

The MTP layer (``mtp`` and a model loaded with it) runs as the inference MTP path does
(``MLADecoder._follow_target`` / ``mtp_step``): MTP position i, at rotary position i, fuses
``embed(tokens[:, i+1])`` with the target's hidden state at i *after* the final norm (what
``SparseDecoder.forward`` returns and records in the carry), attends causally over its own rows
(sparse: by its own indexer's selection), then its MLP and ``shared_head``: ``mtp_logits[:, i]``
predicts ``tokens[:, i+2]``. That hidden state is not detached: the MTP loss reaches the trunk,
as in DeepSeek-V3's MTP objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.worker.model.mla_attention import MLA
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.mla_layer import MLALayer
from services.worker.model.rotary import Rotary, apply_rope
from services.worker.model.vocab import vocab_logits
from training.target.forward import MODES, Mode
from training.target.mla_indexer import (
    draw_queries,
    index_inputs,
    index_kl,
    select,
    selection_mask,
)
from training.target.mla_moe import mlp_train_forward

# Elements of one chunk's [B, heads, chunk, T] index logits or attention logits (fp32).
SCORE_ELEMENTS = 1 << 26


class QueryKL(NamedTuple):
    positions: torch.Tensor  # [B, n] int64 the query positions of the layer's KL, ascending
    kl: torch.Tensor  # [B, n] fp32 each one's KL(target || softmax(scores)), detached


class MLATrainOutput(NamedTuple):
    logits: torch.Tensor  # [B, T, V] fp32
    index_kl: torch.Tensor  # [] mean over index producers of their mean KL (0 when not asked)
    # sparse: layer -> [B, T, k] row positions in selection order, -1 pads (a follower's are
    # its leader's; the MTP layer's [B, T-1, k])
    selections: dict[int, torch.Tensor]
    mtp_logits: torch.Tensor | None  # [B, T-1, V] fp32: at i, the prediction of tokens[:, i+2]
    expert_load: dict[int, torch.Tensor]  # MoE layer -> (token, choice) pairs per expert [E]
    query_kl: dict[int, QueryKL]  # index producer -> its per-query KLs (when index_loss)


@dataclass
class _Pass:
    mode: Mode
    index_loss: bool
    kl_queries: int | None
    gen: torch.Generator | None
    chunk: int | None
    topk: int
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, T, T] bool
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    kls: list[torch.Tensor] = field(default_factory=list)
    query_kl: dict[int, QueryKL] = field(default_factory=dict)
    loads: dict[int, torch.Tensor] = field(default_factory=dict)
    drawn: dict[int, torch.Tensor] = field(default_factory=dict)  # T -> [B, n] KL positions

    def queries_per_chunk(self, b: int, heads: int, t: int) -> int:
        return self.chunk or max(1, SCORE_ELEMENTS // (b * heads * t))

    def kl_positions(self, b: int, t: int, device: torch.device) -> torch.Tensor:
        """One draw per sequence length: the target's layers share theirs, the MTP layer
        (T - 1 positions) has its own."""
        if t not in self.drawn:
            self.drawn[t] = draw_queries(b, t, self.kl_queries, self.gen, device)
        return self.drawn[t]


def mla_train_forward(
    model: MLADecoder,
    tokens: torch.Tensor,
    mode: Mode = "dense",
    index_loss: bool = True,
    kl_queries: int | None = None,
    gen: torch.Generator | None = None,
    mtp: bool = True,
    *,
    chunk: int | None = None,
) -> MLATrainOutput:
    """tokens [B, T] int64 -> ``MLATrainOutput``: next-token logits at every position, the
    indexers' KL (``index_loss``), the selections (sparse), the MTP layer's logits (``mtp``,
    a model loaded with its MTP layer, T >= 2) and each MoE layer's expert load.

    ``kl_queries``: each producer's KL is taken at that many query positions per sequence,
    drawn uniformly without replacement by ``gen`` (``draw_queries``; None or >= T: every
    query). Every query sees at least one row, so the mean over the drawn queries is an
    unbiased estimate of the mean over all queries (and its gradient of that mean's gradient).
    ``chunk``: queries per chunk of index scores and attention targets (None: as many as keep
    a chunk within ``SCORE_ELEMENTS``)."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; choose from {MODES}")
    if kl_queries is not None and kl_queries < 1:
        raise ValueError(f"kl_queries must be >= 1 or None, got {kl_queries}")
    if model.weight_format.fp8 or model.shards.layout.n > 1:
        raise ValueError("training runs a model held whole on one rank, not in FP8")
    b, t = tokens.shape
    dev = tokens.device
    p = _Pass(mode, index_loss, kl_queries, gen, chunk, model.cfg.index_topk)
    h = model.embed(tokens.reshape(b * t))  # [B*T, d]
    rotary = model.rotary(torch.arange(t, device=dev).repeat(b))
    for i, layer in enumerate(model.layers):
        h = _layer(p, i, layer, h, b, t, rotary)
    final = model.norm(h)
    logits = model.logits(final).view(b, t, -1)
    mtp_logits = None
    if mtp and model.mtp is not None and t >= 2:
        m, n = model.mtp, t - 1
        hidden = final.view(b, t, -1)[:, :-1].reshape(b * n, -1)
        u = m.fuse(model.embed(tokens[:, 1:].reshape(b * n)), hidden)
        rotary = model.rotary(torch.arange(n, device=dev).repeat(b))
        g = m.shared_head.norm(_layer(p, model.mtp_layer, m, u, b, n, rotary))
        mtp_logits = vocab_logits(g, m.shared_head.head.weight, model.vocab_group).view(b, n, -1)
    index_kl = torch.stack(p.kls).mean() if p.kls else logits.new_zeros(())
    return MLATrainOutput(logits, index_kl, p.selections, mtp_logits, p.loads, p.query_kl)


def _layer(
    p: _Pass, i: int, layer: MLALayer, h: torch.Tensor, b: int, t: int, rotary: Rotary
) -> torch.Tensor:
    """Decoder layer ``i`` over the residual stream h [B*T, d] -> [B*T, d]."""
    attn = layer.attn
    x = layer.attn_norm(h)
    q, k, v, q_latent = expanded_qkv(attn, x, rotary, b, t)
    index = None
    if layer.indexer is not None and (p.mode == "sparse" or p.index_loss):
        index = index_inputs(layer.indexer, x.detach(), q_latent.detach(), rotary, b, t)
    mask = None
    if p.mode == "sparse":
        if index is not None:
            per_chunk = p.queries_per_chunk(b, index.q.shape[2], t)
            p.selections[i] = select(index, p.topk, per_chunk)
            p.masks[i] = selection_mask(p.selections[i], t)
        else:  # an IndexShare follower: its leader's positions over its own rows
            leader = layer.spec.leader
            p.selections[i], p.masks[i] = p.selections[leader], p.masks[leader]
        mask = p.masks[i]
    h = h + attn.o_proj(attend(q, k, v, mask, attn.scale))
    if index is not None and p.index_loss:
        positions = p.kl_positions(b, t, h.device)
        per_chunk = p.queries_per_chunk(b, max(q.shape[1], index.q.shape[2]), t)
        kl = index_kl(q.detach(), k.detach(), index, mask, positions, attn.scale, per_chunk)
        p.kls.append(kl.mean())
        p.query_kl[i] = QueryKL(positions, kl.detach())
    out, load = mlp_train_forward(layer.mlp, layer.mlp_norm(h))
    if load is not None:
        p.loads[i] = load
    return h + out


# ---- attention -----------------------------------------------------------------------------
def expanded_qkv(
    attn: MLA, x: torch.Tensor, rotary: Rotary, b: int, t: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B*T, d] -> (q, k [B, H, T, qk_head_dim], v [B, H, T, v_head_dim], the q latent
    ``q_a_layernorm(q_a_proj(x))`` [B*T, q_lora_rank] that the indexer reads)."""
    c = attn.cfg
    n, heads = x.shape[0], attn.heads
    q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_latent).view(n, heads, c.qk_head_dim)
    q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    q = torch.cat([q_nope, apply_rope(q_rope, rotary, interleaved=True)], dim=-1)
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(n, heads, -1)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_rope = apply_rope(k_rope, rotary, interleaved=True).unsqueeze(1).expand(-1, heads, -1)
    k = torch.cat([k_nope, k_rope], dim=-1)

    def per_head(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(b, t, heads, -1).transpose(1, 2)

    return per_head(q), per_head(k), per_head(v), q_latent


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q, k [B, H, T, d_qk], v [B, H, T, d_v]; mask [B, T, T] bool (True: attend) or None
    (causal) -> [B*T, H*d_v]. The narrower of q/k and v is zero-padded to the wider width
    (fused kernels take equal widths): zeros add nothing to a logit, and the output is cut
    back to d_v."""
    b, heads, t, d_v = v.shape
    width = max(q.shape[-1], d_v)
    q, k, v = (F.pad(y, (0, width - y.shape[-1])) if y.shape[-1] < width else y for y in (q, k, v))
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
    return o[..., :d_v].transpose(1, 2).reshape(b * t, heads * d_v)
