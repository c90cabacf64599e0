"""A norm and a RoPE in one kernel, for the two rows the MLA models build per token:

- the MLA stored row (``mla_row_kernel.py``): the kv_a projection's ``[N, d_norm + d_rope]``
  -> ``[rms_norm(latent) ; rope(k_rope)]``, the 576-element row the KV cache stores;
- the index key (``index_key_kernel.py``): the indexer's ``wk`` output ``[N, D]`` ->
  ``rope(layer_norm(k))`` on its first ``d_rope`` elements, the rest as the LayerNorm left them.

``mla_row_ref`` and ``index_key_ref`` are the torch forms (the model's lines on the CPU). The
RoPE of the stored row is bit for bit theirs; a norm differs from theirs only in the order of
its fp32 sums and in rsqrt's last bits, so each output is at most one ulp of its dtype away
(and the index key's rotated part carries that ulp of its inputs through the rotation)."""

from __future__ import annotations

import torch
import triton
from torch.nn import functional as F

from services.worker.ops.index_key_kernel import index_key_kernel
from services.worker.ops.mla_row_kernel import mla_row_kernel
from services.worker.ops.rms_norm import rms_norm_ref
from services.worker.ops.rope import X_DTYPES, rope_ref


def mla_row_ref(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = True,
) -> torch.Tensor:
    """``kv [N, d_norm + d_rope]``, the norm's ``weight [d_norm]``, ``cos``/``sin
    [N, d_rope / 2]`` fp32 -> ``[N, d_norm + d_rope]`` in kv's dtype."""
    d_norm = weight.shape[0]
    latent, k_rope = kv[:, :d_norm], kv[:, d_norm:]
    return torch.cat(
        [rms_norm_ref(latent, weight, eps), rope_ref(k_rope, cos, sin, interleaved)], -1
    )


def index_key_ref(
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """``k [N, D]``, LayerNorm's ``weight``/``bias [D]``, ``cos``/``sin [N, d_rope / 2]`` fp32
    -> ``[N, D]`` in k's dtype."""
    return rope_ref(F.layer_norm(k, (k.shape[-1],), weight, bias, eps), cos, sin, interleaved)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d_rope_max: int) -> None:
    if x.dtype not in X_DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] of {X_DTYPES} with unit last stride")
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape != (x.shape[0], half) or 2 * half > d_rope_max:
        raise ValueError(f"tables {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must be fp32 tables of one layout")
    if cos.stride(1) != 1:
        raise ValueError("the tables need a unit last stride")


def mla_row_triton(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = True,
) -> torch.Tensor:
    """Same contract as ``mla_row_ref``; a new contiguous ``[N, d_norm + d_rope]``."""
    d_norm = weight.shape[0]
    _check(kv, cos, sin, kv.shape[1] - d_norm)
    if kv.shape[1] != d_norm + 2 * cos.shape[1] or not weight.is_contiguous():
        raise ValueError(f"kv {tuple(kv.shape)} is not [N, {d_norm} + d_rope]")
    n = kv.shape[0]
    out = torch.empty(n, kv.shape[1], dtype=kv.dtype, device=kv.device)
    if n:
        block = triton.next_power_of_2(d_norm)
        mla_row_kernel[(n,)](
            kv, kv.stride(0),
            weight,
            cos, sin, cos.stride(0),
            out, out.stride(0),
            d_norm, cos.shape[1], eps,
            BLOCK_NORM=block, BLOCK_HALF=triton.next_power_of_2(cos.shape[1]),
            INTERLEAVED=interleaved,
            num_warps=min(max(block // 256, 1), 8), enable_fp_fusion=False,
        )  # fmt: skip
    return out


def index_key_triton(
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """Same contract as ``index_key_ref``; a new contiguous ``[N, D]``."""
    _check(k, cos, sin, k.shape[1])
    d = k.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        if tuple(t.shape) != (d,) or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} is not a contiguous [{d}]")
    n = k.shape[0]
    out = torch.empty(n, d, dtype=k.dtype, device=k.device)
    if n:
        index_key_kernel[(n,)](
            k, k.stride(0),
            weight, bias,
            cos, sin, cos.stride(0),
            out, out.stride(0),
            d, cos.shape[1], eps,
            BLOCK_D=triton.next_power_of_2(d), BLOCK_HALF=triton.next_power_of_2(cos.shape[1]),
            INTERLEAVED=interleaved,
            num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return out
