"""The FP8 block-scaled linear layer ``y = x @ W^T (+ bias)``, W stored as DeepSeek's FP8
checkpoints store it: e4m3 values ``W_fp8 [N, K]`` and one scale per 128x128 block
``scale [ceil(N/128), ceil(K/128)]`` (``weight_scale_inv``; ``W = W_fp8 * scale`` per block,
ragged last blocks included; see ``services/worker/ops/fp8_blockwise.py``).

Two activation modes (``MODES``):
- ``"w8a16"``: x stays in its dtype (bf16, fp16 or fp32); the weight is dequantized per block.
- ``"w8a8"``: x is quantized per 1x128 group along K to e4m3 with an fp32 scale per (row,
  group), as DeepSeek's reference ``act_quant`` does (``act_quant_ref``), then FP8 x FP8.

``fp8_linear_ref`` is the plain-torch reference, in fp32; ``fp8_linear_triton`` checks shapes
and picks the grid of the kernel in ``fp8_linear_kernel.py``. Both return x's dtype. They agree
up to fp32 reassociation: the products are the same numbers (for w8a8, the kernel quantizes x
bit for bit as ``act_quant_ref`` does), only the order of the fp32 sums and where the block
scales are multiplied in differ."""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from services.worker.ops.fp8_blockwise import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blockwise,
    scale_grid,
    scale_to_float,
)
from services.worker.ops.fp8_linear_kernel import fp8_linear_kernel
from services.worker.ops.launch import TARGET_PROGRAMS

Mode = Literal["w8a16", "w8a8"]
MODES: tuple[Mode, ...] = ("w8a16", "w8a8")
BLOCK = 128  # the weight's scale block (both dimensions) and the activation's group
AMAX_MIN = 1e-4  # DeepSeek's act_quant clamps a group's amax from below
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as ``(x_fp8 [M, K] float8_e4m3fn, x_scale [M, ceil(K/128)] float32)``.

    Per row and group of 128 columns (the last one may be ragged): ``scale = max(amax, 1e-4) /
    448`` and ``x_fp8 = round_to_nearest_even(x / scale)``, both in fp32 with IEEE division, so
    that ``x_fp8 * scale`` approximates x. This is exactly what the w8a8 kernel computes."""
    m, k = x.shape
    groups = -(-k // BLOCK)
    padded = x.new_zeros((m, groups * BLOCK), dtype=torch.float32)
    padded[:, :k] = x
    g = padded.view(m, groups, BLOCK)
    amax = g.abs().amax(dim=2).clamp_min(AMAX_MIN)  # [M, groups]; zero padding leaves it as is
    scale = amax / FP8_MAX
    q = (g / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q.view(m, groups * BLOCK)[:, :k].to(FP8_DTYPE), scale


def act_dequant_ref(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """The inverse of ``act_quant_ref`` in fp32: ``x_fp8 [M, K] * x_scale [M, ceil(K/128)]``."""
    k = x_fp8.shape[1]
    return x_fp8.to(torch.float32) * x_scale.repeat_interleave(BLOCK, dim=1)[:, :k]


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D {FP8_DTYPE}, got {weight.dtype} {tuple(weight.shape)}"
        )
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}, got {x.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: K disagrees")
    if tuple(scale.shape) != scale_grid(tuple(weight.shape), (BLOCK, BLOCK)):
        raise ValueError(
            f"scale {tuple(scale.shape)} is not the 128x128 grid of weight {tuple(weight.shape)}"
        )


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    mode: Mode = "w8a16",
) -> torch.Tensor:
    """``x [..., K]`` (bf16, fp16 or fp32), ``weight [N, K]`` e4m3, ``weight_scale
    [ceil(N/128), ceil(K/128)]`` (fp32, bf16 or e8m0), ``bias [N]`` -> ``[..., N]`` in x's dtype.

    Dequantize, then one fp32 matmul: W8A16 takes x as it is; W8A8 takes
    ``act_dequant_ref(*act_quant_ref(x))``. The bias is added in fp32 before the cast."""
    _check(x, weight, weight_scale, mode)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xf = act_dequant_ref(*act_quant_ref(x2)) if mode == "w8a8" else x2.to(torch.float32)
    w = dequantize_blockwise(weight, weight_scale, (BLOCK, BLOCK))  # [N, K] fp32
    y = xf @ w.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


def _tiles(m: int, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Under the interpreter a program is slow, so
    few large tiles; on a GPU, small M (decode) takes narrow tiles for more programs, and
    tl.dot needs at least 16 rows. A fixed table, not autotuned (the interpreter cannot
    autotune); ``python -m bench fp8-linear`` measures it."""
    if interpret:
        return min(64, max(16, triton.next_power_of_2(m))), 128, 1, 1
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return triton.next_power_of_2(m), 64, 4, 4
    return 128, 128, 8, 3


def k_splits(tiles_mn: int, k_blocks: int, interpret: bool) -> int:
    """How many K splits a launch of ``tiles_mn`` output tiles takes: enough programs for
    ``TARGET_PROGRAMS`` (decode shapes such as [576, 7168] have few output tiles and a long
    K), at most one per K block; one under the interpreter. A function of the shape only, so
    a given shape always sums in the same order (deterministic, replayable in a graph)."""
    if interpret or tiles_mn >= TARGET_PROGRAMS:
        return 1
    return max(1, min(k_blocks, -(-TARGET_PROGRAMS // tiles_mn)))


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    mode: Mode = "w8a16",
    splits: int | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_linear_ref``; the scales are read as fp32 (an e8m0 or bf16 grid
    is widened here: pass fp32, as ``FP8Linear`` holds it, to avoid that copy per call).
    ``splits``: K splits (default ``k_splits``'s); with more than one, the fp32 partial sums
    [splits, M, N] are added in split order, then the bias, then the cast."""
    _check(x, weight, weight_scale, mode)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    scale = weight_scale if weight_scale.dtype == torch.float32 else scale_to_float(weight_scale)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    interpret = x.device.type == "cpu"
    block_m, block_n, warps, stages = _tiles(m, interpret)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, BLOCK)
    s = splits if splits is not None else k_splits(tiles, k_blocks, interpret)
    per = triton.cdiv(k_blocks, s)
    s = triton.cdiv(k_blocks, per)  # no empty split
    out = y if s == 1 else torch.empty(s, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), s)
    fp8_linear_kernel[grid](
        x2, x2.stride(0), x2.stride(1),
        weight, weight.stride(0), weight.stride(1),
        scale, scale.stride(0), scale.stride(1),
        bias if bias is not None else scale,  # unused without HAS_BIAS
        out, out.stride(0) if s > 1 else 0, out.stride(-2), out.stride(-1),
        m, n, k, per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK,
        A8=mode == "w8a8", HAS_BIAS=bias is not None and s == 1,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[x.dtype],
        # fp32 products, never TF32: fp32 activations then match the reference closely.
        PREC="ieee",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if s > 1:
        acc = out.sum(dim=0)
        if bias is not None:
            acc += bias.to(torch.float32)
        y = acc.to(x.dtype)
    return y.reshape(*lead, n)
