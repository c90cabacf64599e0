"""The routed experts of DeepSeek-V3.2 / GLM-5 over FP8 block-scaled weights: per (token,
choice) pair ``p`` with expert ``e``, ``y_p = w_p * down[e](silu(gate[e] x) * up[e] x)``, and
each token's ``top_k`` outputs summed. With ``limit`` the SwiGLU is DeepSeek-V4's clamped one,
``silu(min(gate, limit)) * clamp(up, -limit, limit)``; without, the kernel compiles no clamp.

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
sum over choices are fp32, summed in a fixed pairwise order (``moe_pairs.sum_choices``); the
result has x's dtype.

``fp8_moe_ref`` is the plain-torch reference (dequantize each used expert, fp32 matmuls);
``fp8_moe_triton`` aligns the pairs to blocks (``moe_pairs.plan``) and launches the grouped
kernel of ``fp8_moe_kernel.py`` twice, with static shapes and no host synchronisation, then the
combine of ``moe_pairs``. Both agree up to fp32 reassociation in each GEMM (``fp8_moe_gemm``
against ``fp8_moe_gemm_ref``), carried through SwiGLU, the x-dtype rounding of its output and,
for w8a8, its quantization.

Batch invariance: a row's output depends only on its own activation row and its expert's
weight (K blocks in a fixed order, no atomics, no split-K), and the choices are summed in a
fixed order; so a token's output does not depend on the other tokens of the batch among batches
that take the same tile (``tiles``: keyed by pairs per expert, ``moe_pairs.block_rows``).
Batches that take different tiles may differ in the last bits of the fp32 accumulation."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

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
from services.worker.ops.moe_align import MoEBlocks
from services.worker.ops.moe_pairs import (
    block_rows,
    check_limit,
    check_routing,
    combine,
    gemm_output,
    pair_gemm_ref,
    plan,
    sum_choices,
)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def tiles(n_pairs: int, n_experts: int, interpret: bool) -> Tiles:
    """The kernel's tile for a batch shape: ``block_rows`` rows (by pairs per expert), 128
    columns; BLOCK_K is always 128, the scale block. A fixed table, not autotuned;
    ``python -m bench fp8-moe`` measures it."""
    if interpret:
        return Tiles(16, 128, 1, 1)
    return Tiles(block_rows(n_pairs, n_experts, False), 128, 4, 3)


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
    limit: float | None = None,
) -> torch.Tensor:
    """Pair ``p`` (``idx.reshape(-1)[p]`` its expert) takes row ``p // pairs_per_row`` of
    ``a [R, K]`` -> ``[P, N]`` (``N = 2I / 2`` with ``glu``), in fp32 then ``out_dtype`` (a's by
    default): ``a_row @ W[e]^T`` with W dequantized; ``glu`` gives ``silu(gate) * up``, clamped
    by ``limit`` (``moe_pairs.swiglu_ref``); ``pair_weight [P]`` multiplies each row. W8A8
    takes ``act_dequant_ref(*act_quant_ref(a))``. Only the used experts are dequantized; this is
    not capturable (it reads the routing)."""
    n_out = _check_gemm(a, weight, scale, mode, glu)
    check_limit(limit, glu)
    rows = a[torch.arange(idx.numel(), device=a.device) // pairs_per_row]  # [P, K]
    af = act_dequant_ref(*act_quant_ref(rows)) if mode == "w8a8" else rows.to(torch.float32)

    def expert_weight(e: int) -> torch.Tensor:
        if glu:
            return dequantize_gate_up(weight[e], scale[e])
        return dequantize_blockwise(weight[e], scale[e], (BLOCK, BLOCK))

    return pair_gemm_ref(
        af, idx, weight.shape[0], expert_weight, n_out, glu, limit, pair_weight,
        out_dtype or a.dtype,
    )  # fmt: skip


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
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_moe_gemm_ref``, the pairs given by ``blocks`` (``plan``) instead of
    idx. Allocates only the output; reads nothing back to the host."""
    n_out = _check_gemm(a, weight, scale, mode, glu)
    check_limit(limit, glu)
    e, _, k = weight.shape
    interpret = a.device.type == "cpu"
    t = tiles(blocks.n_pairs, e, interpret)
    out, pair_weight = gemm_output(a, blocks, n_out, out_dtype, pair_weight, t.block_m)
    n_blocks = blocks.block_expert.numel()
    if n_blocks == 0:
        return out
    grid = (n_blocks, triton.cdiv(n_out, t.block_n))
    fp8_moe_kernel[grid](
        a, a.stride(0), a.stride(1),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        scale, scale.stride(0), scale.stride(1), scale.stride(2),
        blocks.sorted_ids, blocks.block_expert,
        pair_weight if pair_weight is not None else scale,  # unused without WEIGHTED
        out, out.stride(0), out.stride(1),
        blocks.n_pairs, n_out, k, pairs_per_row,
        n_out if glu else 0, -(-n_out // BLOCK) if glu else 0, limit or 0.0,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK,
        A8=mode == "w8a8", GLU=glu, CLAMP=limit is not None, WEIGHTED=pair_weight is not None,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[a.dtype],
        # fp32 products, never TF32: fp32 activations then match the reference closely.
        PREC="ieee",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def _check_moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    check_routing(x, idx, w)


def fp8_moe_ref(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    mode: Mode = "w8a16",
    limit: float | None = None,
) -> torch.Tensor:
    """``x [T, D]``, ``idx [T, k]`` experts (E, one past the last, for an expert held by
    another rank: it adds nothing), ``w [T, k]`` routing weights -> ``[T, D]`` in x's
    dtype: ``sum_j w[t, j] * down(act)`` with ``act = silu(gate x) * up x`` (clamped by
    ``limit``) rounded to x's dtype; every matmul in fp32 on the dequantized weights (see the
    module docstring)."""
    _check_moe(x, idx, w, mode)
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(x)
    act = fp8_moe_gemm_ref(x, gate_up, gate_up_scale, idx, mode, k, True, limit=limit)  # [P, I]
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
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_moe_ref``; every shape depends on (T, k, E, D, I) alone and nothing
    is read back to the host, so it can be captured in a CUDA graph."""
    _check_moe(x, idx, w, mode)
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(x)
    blocks = plan(idx, gate_up.shape[0])
    pair_w = w.reshape(-1)
    act = fp8_moe_gemm(x, gate_up, gate_up_scale, blocks, mode, k, True, limit=limit)  # [P, I]
    y = fp8_moe_gemm(act, down, down_scale, blocks, mode, 1, False, pair_w, torch.float32)
    return combine(y, idx, gate_up.shape[0], x.dtype)
