"""The differentiable training forward of a DSAModel over whole sequences.

It runs the model's own modules (token rows, queries, output projection, indexer, MLP, norms,
head) over a batch of sequences [B, T] at positions 0..T-1, without a KV cache:

- ``dense``: causal attention over every earlier row (fused SDPA, ``is_causal``);
- ``sparse``: each query attends to exactly the rows the inference path selects: the index
  producer's top-k over its visible rows, shared by its followers (a boolean SDPA mask).

Each index producer's indexer is trained by DSA distillation: the KL from the main
attention's head-summed distribution (detached) to the softmax of the indexer's scores, over
the visible rows (dense) or the selected rows (sparse). The indexer sees detached inputs, so it
learns only from that loss and the LM loss never reaches it (selection has no gradient anyway).

Every topology the model family has: sources packing m tokens per row (a row is the
``compress`` of its complete group and becomes visible once the group is), local windows (the
query also attends to the raw token rows of its last W positions, in the same softmax, as the
inference path does), and producer, follower, reuse and Reindex layers. For a compressed
source the indexer's target is the attention's distribution over the compressed rows alone.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from services.worker.model.preset_decoder import DSAModel
from training.target.indexer_loss import (
    attention_target,
    batched_index_scores,
    causal_mask,
    indexer_kl,
    select_rows,
    window_mask,
)

Mode = Literal["dense", "sparse"]
MODES: tuple[Mode, ...] = ("dense", "sparse")


class TrainOutput(NamedTuple):
    logits: torch.Tensor  # [B, T, V]
    index_kl: torch.Tensor  # [] mean over index producers of the per-query KL (0 if not asked)
    selections: dict[int, torch.Tensor]  # sparse: producer layer -> [B, T, k] row positions


def train_forward(
    model: DSAModel, tokens: torch.Tensor, mode: Mode = "dense", index_loss: bool = True
) -> TrainOutput:
    """tokens: [B, T] int64 -> logits [B, T, V] for next-token prediction at every position,
    the indexer KL (when ``index_loss``) and, in sparse mode, each producer's selection."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; choose from {MODES}")
    cfg = model.cfg
    b, t = tokens.shape
    n = b * t
    dev = tokens.device
    positions = torch.arange(t, device=dev).repeat(b)  # [B*T]
    rows: dict[int, torch.Tensor] = {}  # source -> [B, T // m, d_kv] stored rows
    raw: dict[int, torch.Tensor] = {}  # windowed source -> [B, T, d_kv] token rows
    visible_of: dict[int, torch.Tensor] = {}  # m -> [1, T, T // m] rows each query can see
    window_of: dict[int, torch.Tensor] = {}  # W -> [1, T, T] each query's window
    masks: dict[int, torch.Tensor] = {}  # layer -> [B, T, T // m] selected rows (sparse)
    selections: dict[int, torch.Tensor] = {}
    kls: list[torch.Tensor] = []
    h = model.embed(tokens.reshape(n))  # [B*T, d_model]
    for i, layer in enumerate(model.layers):
        spec, attn = layer.spec, layer.attn
        src = cfg.sources[spec.source]
        m = src.compress
        x = layer.attn_norm(h)
        if attn.owner:
            tok = attn.token_rows(x, positions).view(b, t, cfg.d_kv)
            if src.window:
                raw[spec.source] = tok
            groups = tok[:, : t // m * m].reshape(b * (t // m), m, cfg.d_kv)
            rows[spec.source] = tok if m == 1 else attn.compress(groups).view(b, t // m, -1)
        r = rows[spec.source]
        if m not in visible_of:
            visible_of[m] = causal_mask(t, dev, m).unsqueeze(0)  # [1, T, T // m]
        visible = visible_of[m]
        q = attn.queries(x, positions)[0].view(b, t, cfg.n_heads, cfg.d_kv).transpose(1, 2)
        scores = None
        if layer.indexer is not None and (mode == "sparse" or index_loss):
            iq, iw = layer.indexer.queries(x.detach(), x.detach(), positions)
            keys = layer.indexer.keys(x.detach(), r.detach(), positions)  # [B, T, d_index]
            scores = batched_index_scores(iq.view(b, t, *iq.shape[1:]), iw.view(b, t, -1), keys)
        if mode == "sparse":
            if layer.indexer is not None:
                assert scores is not None
                selections[i], masks[i] = select_rows(scores, cfg.index_topk, m)
            else:  # follower or reuse: the leader's positions over this layer's own source
                masks[i] = masks[spec.leader]
        mask = masks.get(i)
        if mask is None and (m > 1 or src.window):
            mask = visible  # dense over what a compressed or windowed source shows
        window = None
        if src.window:
            if src.window not in window_of:
                window_of[src.window] = window_mask(t, src.window, dev).unsqueeze(0)
            window = (raw[spec.source], window_of[src.window])
        o = attend(q, r, mask, cfg.d_latent, attn.scale, window)  # [B, T, H, d_latent]
        if layer.indexer is not None and index_loss:
            assert scores is not None
            allowed = visible if mask is None else mask
            target = attention_target(q.detach(), r.detach(), allowed, attn.scale)
            kls.append(indexer_kl(target, scores, allowed))
        h = h + attn.output(o.reshape(n, cfg.n_heads, cfg.d_latent))
        h = h + layer.mlp(layer.mlp_norm(h))
    logits = model.logits(model.norm(h)).view(b, t, -1)
    index_kl = torch.stack(kls).mean() if kls else logits.new_zeros(())
    return TrainOutput(logits, index_kl, selections)


def attend(
    q: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor | None,
    d_v: int,
    scale: float,
    window: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """MQA attention of q [B, H, T, d_kv] over rows [B, S, d_kv] (keys: whole rows; values:
    their first ``d_v`` elements) -> [B, T, H, d_v]. ``mask``: [B or 1, T, S] bool (True:
    attend); None: causal. ``window``: (token rows [B, T, d_kv], their mask [1, T, T]), attended
    in the same softmax (the inference path concatenates window rows the same way).

    The values passed to SDPA are the whole rows and the output is cut to ``d_v``: each output
    element depends only on its own value column, so this is exact, and equal key and value
    widths keep the flash kernel eligible. The rows are copied per head (a few MB) so that no
    kernel has to accept a zero head stride."""
    if window is not None:
        assert mask is not None
        b = rows.shape[0]
        rows = torch.cat([rows, window[0]], dim=1)
        mask = torch.cat([mask.expand(b, -1, -1), window[1].expand(b, -1, -1)], dim=2)
    kv = rows.unsqueeze(1).expand(-1, q.shape[1], -1, -1).contiguous()  # [B, H, S, d_kv]
    if mask is None:
        o = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask.unsqueeze(1), scale=scale)
    return o[..., :d_v].transpose(1, 2)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats. logits: [B, T, V]; targets: [B, T]."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
