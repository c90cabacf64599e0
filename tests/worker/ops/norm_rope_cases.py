"""Inputs and bounds shared by the norm and RoPE kernel tests (CPU interpreter and GPU).

Bound of a norm's output against its torch form: both compute the same fp32 formula but sum the
squares (and the LayerNorm's mean) in different orders and take rsqrt with different last
bits; a sum of D terms of one sign is off by at most ``(D - 1) * 2**-24`` relatively, so each
fp32 output differs by at most ``(D + 8) * 2**-24`` of its magnitude (for the LayerNorm, of
``(|x| + |mean|) * rstd * |w| + |b|``, the cancellation in ``x - mean`` included). Rounded to a
narrower dtype the two may land on neighbouring values: one ulp, at most ``2**-p * |y|``
(p = 7 bf16, 10 fp16, 23 fp32), plus the smallest subnormal's step for values near zero."""

from __future__ import annotations

import torch

from dhisparse.family.rope_spec import RopeSpec
from services.worker.model.rotary import Rotary

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The families' RoPE: DeepSeek-V3.2's YaRN (tests.hf_tiny.YARN at theta 1e4) and GLM-5's plain
# RoPE at theta 8e6.
V32_ROPE = RopeSpec(
    theta=10000.0, kind="yarn", factor=40.0, original_max_position=4096,
    mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip
GLM_ROPE = RopeSpec(theta=8e6)
SPECS = {"v32": V32_ROPE, "glm": GLM_ROPE}
POSITIONS = (0, 1, 7, 4095, 4096, 65_537, 163_839, 202_751, 1_048_575)
_MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def rotary(n: int, spec: RopeSpec, seed: int, device: str = "cpu") -> Rotary:
    """A Rotary of n positions cycling through ``POSITIONS``, each shifted by a random few."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([POSITIONS[i % len(POSITIONS)] for i in range(n)])
    return Rotary((base + torch.randint(0, 3, (n,), generator=g)).to(device), spec)


def randn(shape: tuple[int, ...], g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * scale


def norm_weight(d: int, g: torch.Generator) -> torch.Tensor:
    """1 + N(0, 0.2^2): no weight at its init value of 1."""
    return 1.0 + 0.2 * torch.randn(d, generator=g)


def ulp_rel(dtype: torch.dtype) -> float:
    return 2.0 ** -_MANTISSA[dtype]


def tiny(dtype: torch.dtype) -> float:
    """The step between subnormals of dtype."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def assert_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape, what
    err = (y.float() - ref.float()).abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{what}: exceeds the bound by {worst:.3g}"


def norm_bound(ref: torch.Tensor, fp32_scale: torch.Tensor, d: int) -> torch.Tensor:
    """The module docstring's bound for a norm's output ``ref`` whose fp32 error scales with
    ``fp32_scale`` (``|ref|`` for RMSNorm)."""
    return (
        ulp_rel(ref.dtype) * ref.float().abs()
        + (d + 8) * 2.0**-24 * fp32_scale.float()
        + tiny(ref.dtype)
    )


def layer_norm_scale(k: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """``(|x| + |mean|) * rstd * |w| + |b|``, per element of ``k [N, D]``."""
    x = k.float()
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    return (x.abs() + mean.abs()) * rstd * w.float().abs() + b.float().abs()
