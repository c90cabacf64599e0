"""Block-wise FP8 (e4m3) weights, as DeepSeek-V3/V3.2 and GLM-5 store them.

A weight ``W [R, C]`` is cut into blocks of ``[bm, bn]`` on a ceil-div grid; the last block of
each dimension may be ragged (``kv_a_proj_with_mqa [576, 7168]`` with blocks of 128 has a grid
of ``[5, 56]``). Each block stores its values in e4m3 and one scale (``weight_scale_inv`` in the
checkpoint), so that ``W[i, j] = W_fp8[i, j] * scale[i // bm, j // bn]``. Scales are float32, or
powers of two stored as UE8M0 (``F8_E8M0``: the byte ``b`` means ``2 ** (b - 127)``)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# The scale encodings that quantize_blockwise writes, by safetensors dtype name.
SCALE_DTYPES = {"F32": torch.float32, "F8_E8M0": torch.float8_e8m0fnu}
E8M0_BIAS = 127


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a 2-D weight: ``(ceil(R / bm), ceil(C / bn))``."""
    (rows, cols), (bm, bn) = shape, block
    return -(-rows // bm), -(-cols // bn)


def decode_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8, any shape) as float32 ``2 ** (byte - 127)``; the byte 255 is NaN."""
    exponent = raw.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(torch.ones(raw.shape, dtype=torch.float32, device=raw.device), exponent)
    return out.masked_fill_(raw == 255, float("nan"))


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale grid (float32, bfloat16 or float8_e8m0fnu) as float32."""
    if scale.dtype == torch.float8_e8m0fnu:
        return decode_e8m0(scale.view(torch.uint8))
    return scale.to(torch.float32)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0, float32), exactly: frexp gives x = m * 2**e with
    m in [0.5, 1), so x is itself a power of two iff m == 0.5."""
    mantissa, exponent = torch.frexp(x)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)  # UE8M0's range; 255 is NaN
    return torch.ldexp(torch.ones_like(x), exponent)


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_dtype: str = "F32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` (any float dtype) as ``(w_fp8 [R, C] float8_e4m3fn, scale [nR, nC])``.

    Each block's scale is its amax / 448, so the block's largest value maps onto e4m3's largest;
    with ``scale_dtype="F8_E8M0"`` the scale is rounded up to a power of two (values then use
    less than the full range, never more) and stored as float8_e8m0fnu. An all-zero block has
    scale 1. Values are divided by the scale in float32 and rounded to nearest by the cast."""
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise takes a 2-D weight, got shape {tuple(w.shape)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype!r} is not one of {sorted(SCALE_DTYPES)}")
    (rows, cols), (bm, bn) = w.shape, block
    n_r, n_c = scale_grid((rows, cols), block)
    padded = w.new_zeros((n_r * bm, n_c * bn), dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.view(n_r, bm, n_c, bn)  # zero padding leaves every block's amax as it is
    amax = blocks.abs().amax(dim=(1, 3))  # [nR, nC]
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_blockwise: the weight has non-finite values")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_dtype == "F8_E8M0":
        scale = _pow2_ceil(scale)
    scaled = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    w_fp8 = scaled.view(n_r * bm, n_c * bn)[:rows, :cols].to(FP8_DTYPE)
    return w_fp8, scale.to(SCALE_DTYPES[scale_dtype])


def dequantize_blockwise(
    w_fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``w_fp8 [R, C]`` times its block's scale, in float32 (``scale [ceil(R/bm), ceil(C/bn)]``
    float32, bfloat16 or float8_e8m0fnu). One float32 multiply per element, on w_fp8's device;
    besides the result it allocates only the scale grid widened to ``[nR, C]``."""
    (rows, cols), (bm, bn) = w_fp8.shape, block
    if tuple(scale.shape) != scale_grid((rows, cols), block):
        raise ValueError(
            f"scale grid {tuple(scale.shape)} does not fit weight {(rows, cols)} with block "
            f"{tuple(block)} (expected {scale_grid((rows, cols), block)})"
        )
    out = w_fp8.to(torch.float32)
    per_col = scale_to_float(scale).to(out.device).repeat_interleave(bn, dim=1)[:, :cols]
    full = rows // bm  # row blocks of full height; at most one ragged block follows
    out[: full * bm].view(full, bm, cols).mul_(per_col[:full, None, :])
    out[full * bm :].mul_(per_col[full:])
    return out
