"""RMSNorm as one kernel, and the residual add joined to the RMSNorm after it as one kernel
(``rms_norm_kernel.py``): the decoder's ``h = h + a; x = norm(h)`` in one pass over h.

``rms_norm_ref`` and ``add_rms_norm_ref`` are the torch forms, the exact lines the model runs
on the CPU. Against them the kernels' residual add is bit-identical (one fp32 add of the two
widened values, rounded once to x's dtype, as torch does); the norm differs only in the order
of the fp32 sum of squares and in rsqrt's last bits, so at most one ulp of the output dtype
apart after rounding (the tests state the bound)."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.rms_norm_kernel import rms_norm_kernel

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the widest row one program holds: hidden sizes up to 7168, and DeepSeek-V4's hyper-connection
# streams flattened (hc_mult 4 x hidden 7168)
MAX_D = 32768


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x [..., D]``, ``weight [D]`` -> ``[..., D]`` in x's dtype: the norm in fp32 (``weight``
    None: unweighted, x over its RMS)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf if weight is None else xf * weight.float()).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (``rms_norm(residual + x)``, ``residual + x``), the sum as torch's add forms it."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def _check(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}, got {x.dtype}")
    d = x.shape[-1]
    if weight is not None and (tuple(weight.shape) != (d,) or not weight.is_contiguous()):
        raise ValueError(f"weight {tuple(weight.shape)} is not a contiguous [{d}]")
    if not 0 < d <= MAX_D:
        raise ValueError(f"rows of {d} elements: at most {MAX_D}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., D]`` as [M, D] with unit column stride (a view where one exists)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x, weight)
    d = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty(m, d, dtype=x.dtype, device=x.device)
    summed = None
    r2 = x2
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {residual.dtype} {tuple(residual.shape)} does not match "
                f"x {x.dtype} {tuple(x.shape)}"
            )
        r2 = _rows(residual)
        summed = torch.empty(m, d, dtype=x.dtype, device=x.device)
    if m:
        block_d = triton.next_power_of_2(d)
        s = summed if summed is not None else out
        rms_norm_kernel[(m,)](
            x2, x2.stride(0),
            r2, r2.stride(0),
            x2 if weight is None else weight,  # unread without a weight
            out, out.stride(0),
            s, s.stride(0),
            d, eps,
            BLOCK_D=block_d, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            # 16 warps only past 8192 elements (narrower rows keep their launch)
            num_warps=min(max(block_d // 256, 1), 8 if block_d <= 8192 else 16),
        )  # fmt: skip
    shape = x.shape
    return out.view(shape), None if summed is None else summed.view(shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as ``rms_norm_ref``: ``x [..., D]`` (D <= 8192, unit last stride or
    copied), ``weight [D]`` of any float dtype or None -> a new contiguous ``[..., D]``."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``add_rms_norm_ref`` for ``x`` and ``residual`` of one shape and
    dtype: (normed, summed), both new contiguous tensors; the sum bit for bit torch's."""
    normed, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return normed, summed
