"""The plain-torch reference codec of the FP8 row formats (``fp8_format.py`` gives the layout
and the scale and rounding rules): what the Triton store/gather kernels are checked against,
bit for bit."""

from __future__ import annotations

import torch

from dhisparse.family.fp8_kv_format import E4M3_MAX, Fp8RowFormat


def tile_scales(fmt: Fp8RowFormat, values: torch.Tensor) -> torch.Tensor:
    """[N, n_values] -> [N, n_tiles] fp32: each tile's power-of-two scale 2^k, the smallest
    with amax <= 448 * 2^k. The exponent comes from frexp of amax / 448 in float64 (exact for
    an fp32 amax at the boundaries amax = 448 * 2^k, where a log2 may land a hair above k, as
    CUDA's does)."""
    amax = values.double().abs().reshape(len(values), fmt.n_tiles, fmt.tile).amax(-1)
    mantissa, exp = torch.frexp(amax / E4M3_MAX)  # q = m * 2^e, m in [0.5, 1); 0 for q = 0
    exp = torch.where(mantissa == 0.5, exp - 1, exp)  # q = 2^(e-1) exactly
    exp = exp.clamp(min=fmt.min_scale_exp).double()
    return torch.exp2(exp).float()


def pack(fmt: Fp8RowFormat, rows: torch.Tensor) -> torch.Tensor:
    """rows [N, width] bf16/fp32 -> uint8 [N, row_bytes] (the reference quantizer)."""
    if rows.ndim != 2 or rows.shape[1] != fmt.width:
        raise ValueError(f"rows {tuple(rows.shape)} do not match width {fmt.width}")
    n = len(rows)
    values = rows[:, : fmt.n_values].float()
    scales = tile_scales(fmt, values)  # [N, n_tiles]
    scaled = values.reshape(n, fmt.n_tiles, fmt.tile) / scales[..., None]
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    tail = rows[:, fmt.n_values :].to(torch.bfloat16).contiguous()
    return torch.cat(
        [q.reshape(n, fmt.n_values), scales.view(torch.uint8), tail.view(torch.uint8)], dim=1
    )


def unpack(fmt: Fp8RowFormat, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, row_bytes] -> [N, width] in ``dtype`` (the reference dequantizer)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] != fmt.row_bytes:
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype}: want uint8 "
                         f"[N, {fmt.row_bytes}]")  # fmt: skip
    n = len(packed)
    packed = packed.contiguous()
    q = packed[:, : fmt.n_values].view(torch.float8_e4m3fn).float()
    scales = packed[:, fmt.scales_offset : fmt.tail_offset].contiguous().view(torch.float32)
    values = (q.reshape(n, fmt.n_tiles, fmt.tile) * scales[..., None]).reshape(n, -1)
    tail = packed[:, fmt.tail_offset :].contiguous().view(torch.bfloat16).float()
    return torch.cat([values, tail], dim=1).to(dtype)
