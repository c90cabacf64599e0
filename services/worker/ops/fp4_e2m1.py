"""FP4 e2m1 weights with UE8M0 scales, as DeepSeek-V4's released routed experts store them.

A weight ``W [R, C]`` is stored as ``int8 [R, C / 2]``: two e2m1 codes per byte, the lower
nibble the even column; a code is a sign bit over the magnitudes
``(0, 0.5, 1, 1.5, 2, 3, 4, 6)``. Each row has one scale per 32 columns (``[R, C / 32]``,
powers of two stored as float8_e8m0fnu), so ``W[i, j] = e2m1(code[i, j]) * scale[i, j // 32]``."""

from __future__ import annotations

import torch

from services.worker.ops.fp8_blockwise import E8M0_BIAS, scale_to_float

FP4_GROUP = 32  # columns per scale
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def fp4_scale_grid(packed_shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale grid ``[R, C / 32]`` of a packed weight ``[R, C / 2]``."""
    rows, half = packed_shape
    return rows, 2 * half // FP4_GROUP


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packed [R, C / 2]`` int8 or uint8 with ``scale [R, C / 32]`` -> ``W [R, C]`` float32."""
    if packed.dim() != 2 or 2 * packed.shape[1] % FP4_GROUP:
        raise ValueError(f"an FP4 weight is [R, C / 2] with C a multiple of {FP4_GROUP}")
    if tuple(scale.shape) != fp4_scale_grid(tuple(packed.shape)):
        raise ValueError(
            f"FP4 scale grid {tuple(scale.shape)} does not fit packed weight "
            f"{tuple(packed.shape)} (expected {fp4_scale_grid(tuple(packed.shape))})"
        )
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1)
    values = values.view(packed.shape[0], -1)  # [R, C]
    per_col = scale_to_float(scale).to(values.device).repeat_interleave(FP4_GROUP, dim=1)
    return values * per_col


def ue8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """A UE8M0 scale grid as its biased exponents, uint8 (``scale = 2 ** (byte - 127)``): the
    bits of float8_e8m0fnu as stored, or float32 / bfloat16 powers of two in
    ``[2**-127, 2**127]`` encoded; ValueError for a value that is not one. Reads the values (a
    load-time conversion, not for a captured pass)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"a UE8M0 scale is float8_e8m0fnu, float32 or bfloat16, not {scale.dtype}")
    mantissa, exponent = torch.frexp(scale.to(torch.float32))
    biased = exponent - 1 + E8M0_BIAS  # frexp: scale = mantissa * 2**exponent, mantissa 0.5
    if not bool(((mantissa == 0.5) & (biased >= 0) & (biased <= 2 * E8M0_BIAS)).all()):
        raise ValueError("UE8M0 scales must be powers of two in [2**-127, 2**127]")
    return biased.to(torch.uint8)
