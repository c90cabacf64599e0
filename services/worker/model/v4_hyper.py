"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is ``hc_mult``
streams of ``hidden`` channels per token.

Before each block, mixing logits come from the RMS-normalised (unweighted) flattened streams:
``fn`` [(2 + H) H, H hidden], with ``scale`` [3] on the pre / post / comb parts and ``base``
added. ``pre = sigmoid(.) + eps`` collapses the streams into the block's input;
``post = 2 sigmoid(.)`` places the block's output on each stream; ``comb`` (softmax over the
rows, then Sinkhorn to doubly stochastic) mixes the streams: new stream k =
``post_k * out + sum_j comb[j, k] * stream_j``. All of it in fp32. The head collapses the
streams once more (``pre`` only) before the final norm.

Fused (``fused``: a CUDA pass), the weights come from one kernel (``ops/hyper_mix_triton.py``)
and the collapse and the merge from one kernel each (``ops/hyper_streams_triton.py``)."""

from __future__ import annotations

import torch

from services.worker.model.v4_norm import rms_normalise
from services.worker.ops.fusion import fused
from services.worker.ops.hyper_mix_triton import hyper_weights_triton
from services.worker.ops.hyper_streams_triton import hyper_collapse_triton, hyper_merge_triton


def mix_logits(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams: [N, H, hidden] -> [N, rows of fn] fp32."""
    flat = rms_normalise(streams.flatten(1).float(), eps)
    return flat @ fn.float().T


def hyper_weights_ref(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, h: int, iters: int,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Mixing logits [N, (2 + H) H] -> (pre [N, H], post [N, H], comb [N, H, H]), fp32."""
    pre_w, post_w, comb_w = logits.split([h, h, h * h], dim=-1)
    pre_b, post_b, comb_b = base.float().split([h, h, h * h])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, h, h) * scale[2] + comb_b.view(h, h), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hyper_mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    iters: int, hc_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """streams: [N, H, hidden] -> (post [N, H], comb [N, H, H], collapsed [N, hidden])."""
    h = streams.shape[1]
    logits = mix_logits(streams, fn, norm_eps)
    weights = hyper_weights_triton if fused(logits, "hyper_mix") else hyper_weights_ref
    pre, post, comb = weights(logits, base, scale, h, iters, hc_eps)
    return post, comb, collapse(streams, pre)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [N, H, hidden] weighed by ``pre`` [N, H] fp32 and summed -> [N, hidden] in the
    streams' dtype."""
    if fused(streams, "hyper_streams"):
        return hyper_collapse_triton(streams, pre)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hyper_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The block's output ``out`` [N, hidden] placed on the streams [N, H, hidden]."""
    dtype = streams.dtype
    if out.dtype == dtype and fused(streams, "hyper_streams"):
        return hyper_merge_triton(streams, out, post, comb)
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hyper_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    hc_eps: float, norm_eps: float,
) -> torch.Tensor:  # fmt: skip
    """streams: [N, H, hidden] -> [N, hidden]."""
    pre = torch.sigmoid(mix_logits(streams, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return collapse(streams, pre)
