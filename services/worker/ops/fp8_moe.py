"""The routed experts of DeepSeek-V3.2 / GLM-5 over FP8 block-scaled weights: per (token,
choice) pair ``p`` with expert ``e``, ``y_p = w_p * down[e](silu(gate[e] x) * up[e] x)``, and
each token's ``top_k`` outputs summed.

Weights as the checkpoint stores each expert's, stacked over experts (e4m3 values, one fp32
scale per 128x128 block, ragged last blocks included; ``services/worker/ops/fp8_blockwise.py``):
- ``gate_up [E, 2I, D]``: gate rows ``[0, I)``, up rows ``[I, 2I)``; its scale grid
  ``[E, 2 * ceil(I/128), ceil(D/128)]`` is gate's grid over up's grid. When I % 128 == 0 that is
  the grid of the stacked [2I, D] weight; otherwise a 128-row block of the stack would straddle
  gate and up, which have scales of their own, so the halves keep their own grids.
- ``down [E, D, I]`` with its grid ``[E, ceil(D/128), ceil(I/128)]``.

Modes (``MODES``) as the dense FP8 linear's: "w8a16" keeps activations in x's dtype, "w8a8"
quantizes them per 1x128 group (``act_quant_ref``) before each GEMM. The SwiGLU output, the
down projection's input, is held in x's dtype; the down projection, the routing weight and the
sum over choices are fp32, summed in a fixed pairwise order (``sum_choices``); the result has
x's dtype.

``fp8_moe_ref`` is the plain-torch reference (dequantize each used expert, fp32 matmuls);
``fp8_moe_triton`` aligns the pairs to blocks (``moe_align.py``) and launches the grouped kernel
of ``fp8_moe_kernel.py`` twice, with static shapes and no host synchronisation. Both agree up to
fp32 reassociation in each GEMM (``fp8_moe_gemm`` against ``fp8_moe_gemm_ref``), carried
through SwiGLU, the x-dtype rounding of its output and, for w8a8, its quantization.

Batch invariance: a row's output depends only on its own activation row and its expert's
weight (K blocks in a fixed order, no atomics, no split-K), and the choices are summed in a
fixed order; so a token's output does not depend on the other tokens of the batch among batches
that take the same tile (``tiles``: keyed by pairs per expert). Batches that take different
tiles may differ in the last bits of the fp32 accumulation."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from services.worker.ops.fp8_blockwise import FP8_DTYPE, dequantize_blockwise
from services.worker.ops.fp8_linear import (
    BLOCK,
    MODES,
    X_DTYPES,
    Mode,
    act_dequant_ref,
    act_quant_ref,
)
from services.worker.ops.fp8_moe_kernel import fp8_moe_kernel
from services.worker.ops.fusion import fused
from services.worker.ops.moe_align import MoEBlocks
from services.worker.ops.moe_align_triton import align
from services.worker.ops.moe_combine_triton import combine_triton, fits

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def tiles(n_pairs: int, n_experts: int, interpret: bool) -> Tiles:
    """The kernel's tile for a batch shape, from the average pairs per expert (a shape, not the
    routing). BLOCK_K is always 128, the scale block. Decode leaves most experts 0-2 pairs: the
    GEMM is bound by weight bytes, so the fewest padded rows (16, tl.dot's minimum) and more
    programs over N; larger batches take taller tiles. A fixed table, not autotuned (nothing
    may tune inside a CUDA graph, and the interpreter cannot); ``python -m bench fp8-moe``
    measures it."""
    if interpret:
        return Tiles(16, 128, 1, 1)
    per_expert = n_pairs / n_experts
    if per_expert <= 16:
        return Tiles(16, 128, 4, 3)
    if per_expert <= 48:
        return Tiles(32, 128, 4, 3)
    return Tiles(64, 128, 4, 3)


Half = tuple[torch.Tensor, torch.Tensor | None]


def gate_up_halves(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[Half, Half]:
    """One expert's ``gate_up [2I, K]`` (gate rows, then up rows) and, for FP8, its split grid
    ``[2 * ceil(I/128), ceil(K/128)]`` (gate's grid over up's) as ``((gate, its grid), (up,
    its grid))``, views; the grids are None without ``scale``."""
    i = weight.shape[0] // 2
    if scale is None:
        return (weight[:i], None), (weight[i:], None)
    sr = scale.shape[0] // 2
    return (weight[:i], scale[:sr]), (weight[i:], scale[sr:])


def dequantize_gate_up(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's ``gate_up [2I, K]`` e4m3 with its split grid ``[2 * ceil(I/128), ...]`` as
    fp32 [2I, K]."""
    return torch.cat(
        [dequantize_blockwise(w, s, (BLOCK, BLOCK)) for w, s in gate_up_halves(weight, scale)]
    )


def sum_choices(y: torch.Tensor) -> torch.Tensor:
    """``y [T, k, D]`` -> ``[T, D]``: pairwise halves, the same order for every token and batch
    (elementwise adds only, so no reduction kernel chooses an order by the batch's shape)."""
    while y.shape[1] > 1:
        h = y.shape[1] // 2
        y = torch.cat([y[:, :h] + y[:, h : 2 * h], y[:, 2 * h :]], dim=1)
    return y[:, 0]


def _check_gemm(
    a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, mode: str, glu: bool
) -> int:
    """The output width N; raises ValueError on a shape or dtype the kernel does not take."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if a.dtype not in X_DTYPES:
        raise ValueError(f"activations must be one of {X_DTYPES}, got {a.dtype}")
    if weight.dtype != FP8_DTYPE or weight.dim() != 3:
        raise ValueError(
            f"weight must be 3-D {FP8_DTYPE}, got {weight.dtype} {tuple(weight.shape)}"
        )
    e, n, k = weight.shape
    if a.dim() != 2 or a.shape[1] != k:
        raise ValueError(
            f"activations {tuple(a.shape)} and weight {tuple(weight.shape)}: K disagrees"
        )
    if glu and n % 2:
        raise ValueError(f"a gate_up weight has an even number of rows, got {n}")
    n_out = n // 2 if glu else n
    rows = 2 * -(-n_out // BLOCK) if glu else -(-n // BLOCK)
    if tuple(scale.shape) != (e, rows, -(-k // BLOCK)):
        what = "gate's and up's 128x128 grids" if glu else "the 128x128 grid"
        raise ValueError(f"scale {tuple(scale.shape)} is not {what} of {tuple(weight.shape)}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 (scale_to_float), got {scale.dtype}")
    return n_out


def fp8_moe_gemm_ref(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    idx: torch.Tensor,
    mode: Mode,
    pairs_per_row: int,
    glu: bool = False,
    pair_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pair ``p`` (``idx.reshape(-1)[p]`` its expert) takes row ``p // pairs_per_row`` of
    ``a [R, K]`` -> ``[P, N]`` (``N = 2I / 2`` with ``glu``), in fp32 then ``out_dtype`` (a's by
    default): ``a_row @ W[e]^T`` with W dequantized; ``glu`` gives ``silu(gate) * up``;
    ``pair_weight [P]`` multiplies each row. W8A8 takes ``act_dequant_ref(*act_quant_ref(a))``.
    Only the used experts are dequantized; this is not capturable (it reads the routing)."""
    n_out = _check_gemm(a, weight, scale, mode, glu)
    flat = idx.reshape(-1).to(torch.int64)
    p = flat.numel()
    rows = a[torch.arange(p, device=a.device) // pairs_per_row]  # [P, K]
    af = act_dequant_ref(*act_quant_ref(rows)) if mode == "w8a8" else rows.to(torch.float32)
    out = torch.zeros(p, n_out, dtype=torch.float32, device=a.device)
    for e in flat.unique().tolist():
        if e >= weight.shape[0]:
            continue  # an expert held elsewhere: its pairs stay zero
        sel = (flat == e).nonzero().squeeze(1)
        if glu:
            h = af[sel] @ dequantize_gate_up(weight[e], scale[e]).T
            out[sel] = F.silu(h[:, :n_out]) * h[:, n_out:]
        else:
            out[sel] = af[sel] @ dequantize_blockwise(weight[e], scale[e], (BLOCK, BLOCK)).T
    if pair_weight is not None:
        out = out * pair_weight.reshape(-1, 1).to(torch.float32)
    return out.to(out_dtype or a.dtype)


def plan(idx: torch.Tensor, n_experts: int) -> MoEBlocks:
    """The kernel's block alignment of ``idx [T, top_k]`` (static shapes, on idx's device):
    ``align_blocks``' output, by its Triton kernels where ``align`` takes them."""
    t = tiles(idx.numel(), n_experts, idx.device.type == "cpu")
    return align(idx, n_experts, t.block_m)


def fp8_moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    blocks: MoEBlocks,
    mode: Mode,
    pairs_per_row: int,
    glu: bool = False,
    pair_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_moe_gemm_ref``, the pairs given by ``blocks`` (``plan``) instead of
    idx. Allocates only the output; reads nothing back to the host."""
    n_out = _check_gemm(a, weight, scale, mode, glu)
    e, _, k = weight.shape
    out = torch.empty(blocks.n_pairs, n_out, dtype=out_dtype or a.dtype, device=a.device)
    n_blocks = blocks.block_expert.numel()
    if n_blocks == 0:
        return out
    interpret = a.device.type == "cpu"
    t = tiles(blocks.n_pairs, e, interpret)
    if t.block_m != blocks.block_m:
        raise ValueError(f"blocks of {blocks.block_m} rows, the tile has {t.block_m}: use plan()")
    if pair_weight is not None:
        pair_weight = pair_weight.reshape(-1).to(torch.float32).contiguous()  # [P]
    grid = (n_blocks, triton.cdiv(n_out, t.block_n))
    fp8_moe_kernel[grid](
        a, a.stride(0), a.stride(1),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        scale, scale.stride(0), scale.stride(1), scale.stride(2),
        blocks.sorted_ids, blocks.block_expert,
        pair_weight if pair_weight is not None else scale,  # unused without WEIGHTED
        out, out.stride(0), out.stride(1),
        blocks.n_pairs, n_out, k, pairs_per_row,
        n_out if glu else 0, -(-n_out // BLOCK) if glu else 0,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK,
        A8=mode == "w8a8", GLU=glu, WEIGHTED=pair_weight is not None,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[a.dtype],
        # fp32 products, never TF32: fp32 activations then match the reference closely.
        PREC="ieee",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def _check_moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if x.dim() != 2 or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and idx {tuple(idx.shape)}: not [T, D] and [T, k]")
    if tuple(w.shape) != tuple(idx.shape):
        raise ValueError(f"routing weights {tuple(w.shape)} do not match idx {tuple(idx.shape)}")


def fp8_moe_ref(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    mode: Mode = "w8a16",
) -> torch.Tensor:
    """``x [T, D]``, ``idx [T, k]`` experts (E, one past the last, for an expert held by
    another rank: it adds nothing), ``w [T, k]`` routing weights -> ``[T, D]`` in x's
    dtype: ``sum_j w[t, j] * down(act)`` with ``act = silu(gate x) * up x`` rounded to x's
    dtype; every matmul in fp32 on the dequantized weights (see the module docstring)."""
    _check_moe(x, idx, w, mode)
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(x)
    act = fp8_moe_gemm_ref(x, gate_up, gate_up_scale, idx, mode, k, glu=True)  # [P, I]
    y = fp8_moe_gemm_ref(act, down, down_scale, idx, mode, 1, False, w, torch.float32)
    return sum_choices(y.view(t, k, -1)).to(x.dtype)


def fp8_moe_triton(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    mode: Mode = "w8a16",
) -> torch.Tensor:
    """Same contract as ``fp8_moe_ref``; every shape depends on (T, k, E, D, I) alone and nothing
    is read back to the host, so it can be captured in a CUDA graph."""
    _check_moe(x, idx, w, mode)
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(x)
    blocks = plan(idx, gate_up.shape[0])
    pair_w = w.reshape(-1)
    act = fp8_moe_gemm(x, gate_up, gate_up_scale, blocks, mode, k, glu=True)  # [P, I]
    y = fp8_moe_gemm(act, down, down_scale, blocks, mode, 1, False, pair_w, torch.float32)
    if fused(y, "moe_combine") and fits(k):  # the lines below in one kernel, bit for bit
        return combine_triton(y, idx, gate_up.shape[0], x.dtype)
    # pairs of experts held elsewhere (id E) are computed by no block: their rows are undefined
    y = torch.where((idx.reshape(-1, 1) < gate_up.shape[0]), y, 0)
    return sum_choices(y.view(t, k, -1)).to(x.dtype)
