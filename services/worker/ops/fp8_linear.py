"""The FP8 block-scaled linear layer ``y = x @ W^T (+ bias)``, W stored as DeepSeek's FP8
checkpoints store it: e4m3 values ``W_fp8 [N, K]`` and one scale per 128x128 block
``scale [ceil(N/128), ceil(K/128)]`` (``weight_scale_inv``; ``W = W_fp8 * scale`` per block,
ragged last blocks included; see ``services/worker/ops/fp8_blockwise.py``).

Two activation modes (``MODES``):
- ``"w8a16"``: x stays in its dtype (bf16, fp16 or fp32); the weight is dequantized per block.
- ``"w8a8"``: x is quantized per 1x128 group along K to e4m3 with an fp32 scale per (row,
  group), as DeepSeek's reference ``act_quant`` does (``act_quant_ref``), then FP8 x FP8.

``fp8_linear_ref`` is the plain-torch reference, in fp32; ``fp8_linear_triton`` checks shapes
and lays out the launch of the kernel in ``fp8_linear_kernel.py`` (tiles by batch bucket:
``fp8_linear_tiles.py``; K splits for decode shapes: ``fp8_linear_splits.py``). Both return
x's dtype. They agree up to fp32 reassociation: the products are the same numbers (for w8a8,
the kernel quantizes x bit for bit as ``act_quant_ref`` does), only the order of the fp32 sums
and where the block scales are multiplied in differ.

A launch with several K splits sums them inside the kernel (one launch; ``fused(x)``), or,
inside ``unfused_kernels()``, writes the fp32 partials and sums them with torch
(``out.sum(dim=0)``, the bias, the cast: two more kernels). The kernel sums in split order,
``sum_splits_ref``'s order bit for bit, which is torch's up to 4 splits."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from services.worker.ops.arrivals import arrival_counters
from services.worker.ops.fp8_blockwise import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blockwise,
    scale_grid,
    scale_to_float,
)
from services.worker.ops.fp8_linear_kernel import fp8_linear_kernel
from services.worker.ops.fp8_linear_splits import k_splits, split_blocks
from services.worker.ops.fp8_linear_tiles import Tiles, launch_block_m, tiles_for
from services.worker.ops.fusion import fused

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


class LaunchPlan(NamedTuple):
    """A launch's layout: ``block_m`` rows per tile, a ``grid_m`` x ``grid_n`` grid of output
    tiles, ``splits`` splits of K of ``per`` K blocks each (the last one may be shorter)."""

    tiles: Tiles
    block_m: int
    grid_m: int
    grid_n: int
    splits: int
    per: int


def plan_launch(
    m: int, n: int, k: int, tiles: Tiles | None, splits: int | None, interpret: bool
) -> LaunchPlan:
    """The layout of ``[M, K] @ [N, K]^T`` with ``tiles`` (default ``tiles_for``'s) and
    ``splits`` K splits asked (default ``k_splits``'s for the tiles' ``split_programs``)."""
    t = tiles if tiles is not None else tiles_for(m, interpret)
    block_m = launch_block_m(t, m)
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, t.block_n)
    k_blocks = triton.cdiv(k, BLOCK)
    asked = splits if splits is not None else k_splits(grid_m * grid_n, k_blocks, interpret,
                                                       t.split_programs)  # fmt: skip
    s, per = split_blocks(k_blocks, asked, t.k_step)
    return LaunchPlan(t, block_m, grid_m, grid_n, s, per)


def _launch(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: Mode,
    y: torch.Tensor,
    part: torch.Tensor | None,
    counters: torch.Tensor | None,
    plan: LaunchPlan,
) -> None:
    """One kernel launch: ``x2 [M, K]`` against ``weight [N, K]`` with its fp32 ``scale``.
    Without ``part`` (one split) it writes ``y [M, N]``; with ``part [splits, M, N]`` fp32 it
    writes the partial sums there, and with ``counters`` as well it also sums them into y."""
    interpret = x2.device.type == "cpu"
    t, m, n, k = plan.tiles, x2.shape[0], weight.shape[0], x2.shape[1]
    p = part if part is not None else y  # unused without SPLIT
    fp8_linear_kernel[(plan.grid_m, plan.grid_n, plan.splits)](
        x2, x2.stride(0), x2.stride(1),
        weight, weight.stride(0), weight.stride(1),
        scale, scale.stride(0), scale.stride(1),
        bias if bias is not None else scale,  # unused without HAS_BIAS
        y, y.stride(0), y.stride(1),
        p, p.stride(0) if part is not None else 0, p.stride(-2), p.stride(-1),
        counters if counters is not None else scale,  # unused without SUM_SPLITS
        m, n, k, plan.per, plan.splits,
        BLOCK_M=plan.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK, K_STEP=t.k_step,
        SPLIT=part is not None, SUM_SPLITS=counters is not None,
        A8=mode == "w8a8", HAS_BIAS=bias is not None,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[x2.dtype],
        # fp32 products, never TF32: fp32 activations then match the reference closely.
        PREC="ieee",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip


def _prepare(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, mode: Mode
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x as [M, K], the scale grid as fp32)`` after checking the contract."""
    _check(x, weight, weight_scale, mode)
    x2 = x.reshape(-1, x.shape[-1])
    scale = weight_scale if weight_scale.dtype == torch.float32 else scale_to_float(weight_scale)
    return x2, scale


def fp8_linear_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    mode: Mode = "w8a16",
    splits: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """The kernel's fp32 partial sums of ``x [M, K] @ W^T`` over its K splits, without bias:
    ``[splits, M, N]`` (the splits of ``plan_launch``; one where K is one split)."""
    x2, scale = _prepare(x, weight, weight_scale, mode)
    m, k, n = x2.shape[0], x2.shape[1], weight.shape[0]
    plan = plan_launch(m, n, k, tiles, splits, x2.device.type == "cpu")
    part = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x2.device)
    if m > 0:
        _launch(x2, weight, scale, None, mode, part[0], part, None, plan)
    return part


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    mode: Mode = "w8a16",
    splits: int | None = None,
    tiles: Tiles | None = None,
    sum_splits: bool | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_linear_ref``; the scales are read as fp32 (an e8m0 or bf16 grid
    is widened here: pass fp32, as ``FP8Linear`` holds it, to avoid that copy per call).

    ``tiles``: the launch configuration (default ``tiles_for``'s); ``splits``: K splits
    (default ``k_splits``'s). With more than one split, the fp32 partial sums ``[splits, M,
    N]`` are added in split order, then the bias, then the cast: inside the kernel when
    ``sum_splits`` (default ``fused(x)``: one launch, ``sum_splits_ref``'s order bit for bit),
    else by torch (``out.sum(dim=0)``, two more kernels). ``counters``: the int32 arrival
    counters the kernel uses, zero between launches (default the device's, ``arrivals.py``,
    whose contract holds: launches that share a buffer never run at once). Capturable in a
    CUDA graph once run eagerly on the device."""
    x2, scale = _prepare(x, weight, weight_scale, mode)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    lead, (m, k), n = x.shape[:-1], x2.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    plan = plan_launch(m, n, k, tiles, splits, x.device.type == "cpu")
    if plan.splits == 1:
        _launch(x2, weight, scale, bias, mode, y, None, None, plan)
        return y.reshape(*lead, n)
    out = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device)
    if fused(x, "fp8_split_sum") if sum_splits is None else sum_splits:
        tiles_mn = plan.grid_m * plan.grid_n
        cnt = counters if counters is not None else arrival_counters(x.device, tiles_mn)
        if cnt.dtype != torch.int32 or cnt.device != x.device or cnt.numel() < tiles_mn:
            raise ValueError(
                f"counters must be at least {tiles_mn} int32 on {x.device}, got "
                f"{cnt.numel()} {cnt.dtype} on {cnt.device}"
            )
        _launch(x2, weight, scale, bias, mode, y, out, cnt, plan)
        return y.reshape(*lead, n)
    _launch(x2, weight, scale, None, mode, y, out, None, plan)
    acc = out.sum(dim=0)
    if bias is not None:
        acc += bias.to(torch.float32)
    y = acc.to(x.dtype)
    return y.reshape(*lead, n)
