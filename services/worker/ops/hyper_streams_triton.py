"""DeepSeek-V4's hyper-connection streams (``model/v4_hyper.py``, whose torch forms are the
references) collapsed into a block's input and merged with its output, each one Triton kernel
(``hyper_streams_kernel.py``) instead of three and five small torch kernels per block site.

- ``hyper_collapse_triton(streams, pre)``: ``streams`` [N, H, D], ``pre`` [N, H] fp32 ->
  ``sum_j pre[:, j] * streams[:, j]`` [N, D] in the streams' dtype (fp32 products and sum).
- ``hyper_merge_triton(streams, out, post, comb)``: ``out`` [N, D] the block's output,
  ``post`` [N, H], ``comb`` [N, H, H] fp32 -> new streams [N, H, D]: stream k is
  ``post_k * out + sum_j comb[j, k] * stream_j``, rounded to the streams' dtype where the torch
  form rounds (``comb`` and ``post`` on reading, the mixed streams, the placed output, their
  sum).

Each equals its reference up to the order of the fp32 sums over H values (an ulp of the fp32
sum, rarely a bf16 ulp after rounding). One program per token and block of channels, no host
synchronisation: capturable in a CUDA graph."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.hyper_streams_kernel import hyper_collapse_kernel, hyper_merge_kernel

BLOCK_D = 256


def _check(streams: torch.Tensor, weights: torch.Tensor, what: str) -> tuple[int, int, int]:
    if streams.dim() != 3 or weights.shape[:2] != streams.shape[:2]:
        raise ValueError(
            f"streams {tuple(streams.shape)} are not [N, H, D], or {what} "
            f"{tuple(weights.shape)} does not start [N, H]"
        )
    return streams.shape


def hyper_collapse_triton(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    n, h, d = _check(streams, pre, "pre")
    streams, pre = streams.contiguous(), pre.float().contiguous()
    out = torch.empty(n, d, dtype=streams.dtype, device=streams.device)
    if n:
        grid = (n, triton.cdiv(d, BLOCK_D))
        hyper_collapse_kernel[grid](
            streams, pre, out, h, d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=BLOCK_D
        )
    return out


def hyper_merge_triton(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """See the module docstring."""
    n, h, d = _check(streams, post, "post")
    if comb.shape != (n, h, h) or out.shape != (n, d):
        raise ValueError(
            f"comb {tuple(comb.shape)} is not [{n}, {h}, {h}], or the block's output "
            f"{tuple(out.shape)} is not [{n}, {d}]"
        )
    streams = streams.contiguous()
    out = out.to(streams.dtype).contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    new = torch.empty_like(streams)
    if n:
        grid = (n, triton.cdiv(d, BLOCK_D))
        hyper_merge_kernel[grid](
            streams, out, post, comb, new, h, d,
            BLOCK_H=triton.next_power_of_2(h), BLOCK_D=BLOCK_D,
        )  # fmt: skip
    return new
