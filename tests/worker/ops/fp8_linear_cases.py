"""Data and error bounds shared by the FP8 linear tests (CPU and GPU); the bound is explained
in ``test_fp8_linear.py``."""

from __future__ import annotations

import torch

from services.worker.ops.fp8_blockwise import (
    dequantize_blockwise,
    quantize_blockwise,
    scale_to_float,
)
from services.worker.ops.fp8_linear import act_dequant_ref, act_quant_ref

EPS32 = 2.0**-23
BF16_ULP = 2.0**-7


def make_case(seed: int, m: int, n: int, k: int, scale_dtype: str, x_dtype, device="cpu"):
    """Fresh non-trivial data: x with rows of very different magnitudes and a few outliers
    (so per-row groups matter), W with blocks of different magnitudes (so per-block scales
    matter), quantized as the checkpoint writer does; the scale as the loader returns it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    x[torch.rand(m, k, generator=g) < 0.01] *= 20.0
    w = torch.randn(n, k, generator=g) * 0.02
    block_mag = torch.exp(torch.randn(-(-n // 128), -(-k // 128), generator=g))
    w *= block_mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    w_fp8, scale = quantize_blockwise(w, (128, 128), scale_dtype)
    bias = torch.randn(n, generator=g)
    return (
        x.to(device, x_dtype), w_fp8.to(device), scale_to_float(scale).to(device),
        bias.to(device),
    )  # fmt: skip


def bound(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor, mode: str, y_ref, rel):
    """The elementwise error bound: ``rel * (|x| @ |W|^T)`` plus a bf16 ulp for bf16 output."""
    x2 = x.reshape(-1, x.shape[-1])
    xf = act_dequant_ref(*act_quant_ref(x2)) if mode == "w8a8" else x2.float()
    w = dequantize_blockwise(w_fp8, scale, (128, 128))
    b = rel * (xf.abs() @ w.abs().T)
    if x.dtype != torch.float32:
        b = b + BF16_ULP * y_ref.float().abs().reshape(b.shape)
    return b.reshape(y_ref.shape)


def assert_within(y, y_ref, tol, what: str = "") -> None:
    err = (y.float() - y_ref.float()).abs()
    worst = (err - tol).argmax()
    assert (err <= tol).all(), (
        f"{what + ': ' if what else ''}error {err.flatten()[worst]:.3e} > bound {tol.flatten()[worst]:.3e} "
        f"(max error {err.max():.3e}, |y| max {y_ref.float().abs().max():.3e})"
    )
