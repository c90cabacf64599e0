"""DeepSeek-V4's hyper-connection weights (``model/v4_hyper.py``, whose torch code
``hyper_weights_ref`` is the reference) as one Triton kernel (``hyper_mix_kernel.py``) instead
of some 130 small torch kernels per block site (Sinkhorn's 20 iterations each a sum, an add
and a division over [N, H, H]).

``hyper_weights_triton(logits, base, scale, h, iters, hc_eps)``: ``logits`` [N, (2 + H) H]
fp32 (the pre, post and comb parts), ``base`` [(2 + H) H], ``scale`` [3] -> ``(pre [N, H],
post [N, H], comb [N, H, H])`` fp32, each as the reference computes it up to the order of its
sums over H values and the last bit of ``exp`` (a few fp32 ulps). One program per token, no
host synchronisation: capturable in a CUDA graph."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.hyper_mix_kernel import hyper_mix_kernel


def hyper_weights_triton(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, h: int, iters: int,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """See the module docstring."""
    n = logits.shape[0]
    if logits.dim() != 2 or logits.shape[1] != (2 + h) * h or iters < 1:
        raise ValueError(
            f"logits {tuple(logits.shape)} are not [N, (2 + {h}) * {h}], or iters {iters} < 1"
        )
    logits = logits.float().contiguous()
    base, scale = base.float().contiguous(), scale.float().contiguous()
    pre = torch.empty(n, h, dtype=torch.float32, device=logits.device)
    post = torch.empty_like(pre)
    comb = torch.empty(n, h, h, dtype=torch.float32, device=logits.device)
    if n:
        hyper_mix_kernel[(n,)](
            logits, logits.stride(0), base, scale, pre, post, comb, h, iters, hc_eps,
            BLOCK_H=triton.next_power_of_2(h),
        )  # fmt: skip
    return pre, post, comb
